"""Issue 56: quantized KV cells in the llama.cpp engine, peak KV bytes and --kv-memory, and llama.cpp's own context
shift as a baseline policy. Each test is checked against llama.cpp itself (its state sizes, its count of a
sequence's cells and positions, llama-server's own context shift) rather than against epikv's figures.

llama-cpp-python is required (as the other llama.cpp tests); the llama-server comparison skips, with its reason,
where `bash benchmarks/build_llama_server.sh` has not built the binary."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from epikv.errors import EpiKVError

ROOT = Path(__file__).resolve().parents[1]
META_BYTES = 12  # a saved cell besides its K and V rows (llama_kv_cache::state_write_meta)


@pytest.fixture(scope="module")
def gm():
    from epikv.llamacpp import available, load_gguf

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    return load_gguf("smollm2")


def _ids(gm, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, gm.tokenizer.n_vocab - 100, n)]


def _greedy(dec, prompt: list[int], steps: int) -> list[int]:
    logits, out = dec.prefill(prompt), []
    for _ in range(steps):
        assert np.isfinite(logits).all()
        out.append(int(np.argmax(logits)))
        logits = dec.step(out[-1])
    return out


# -- 1. quantized cells ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", ["q8_0", "q4_0"])
def test_quantized_cells_evict_and_their_peak_is_llama_cpps_state(gm, cell):
    """On q8_0 / q4_0 cells (flash attention switched on, as llama.cpp requires) a sequence under Seg-Q evicts; its
    cells equal llama.cpp's own count, a cell's bytes from the type sizes equal llama.cpp's state growth per cell,
    and after every decode (before its eviction) the cells' bytes are what llama_state_seq_get_size says; the peak
    is the largest of those plus the buffers held at that moment, measured here on the buffers themselves (the
    mirror's rows, the rows waiting for their statistic, the queries). Mutants: a wrong block size in CACHE_TYPES
    (q8_0 34 -> 32 bytes), a peak that leaves the mirror (or the waiting rows) out."""
    from epikv.llamacpp import LlamaDecoder
    from epikv.llamacpp.kvtypes import cell_bytes
    from epikv.llamacpp.lib import load

    ll = load().ll
    dec = LlamaDecoder(gm, "epikv-seg-q", 40, tau=8, max_tokens=120, threads=1, type_k=cell, type_v=cell)
    per_cell = cell_bytes(gm, cell, cell)
    assert dec.cells.per_cell == per_cell + META_BYTES  # the type sizes are llama.cpp's own
    assert per_cell < cell_bytes(gm, "f16", "f16") // 1.8
    moments = []
    note = dec._note_peak

    def measured():  # after a decode, before the sequence scores or evicts
        note()
        n = dec.stored()
        assert dec.cell_count() == n  # llama.cpp's own count of the sequence's cells
        cells = int(ll.llama_state_seq_get_size(dec.ctx, 0)) - dec.cells.base - n * META_BYTES
        kv = dec._kv
        mirror = 0 if kv is None else n * kv[:, :, :, 0].numel() * kv.element_size()
        waiting = sum(a.nbytes for r in dec._rows for a in r.values()) + \
            sum(a.nbytes for r in dec._arriving for a in r.values())
        queries = sum(q.numel() * q.element_size() for q in dec._queries.values())
        moments.append((cells + mirror + waiting + queries, cells, n, mirror))

    dec._note_peak = measured
    _greedy(dec, _ids(gm, 12), 90)
    assert dec.evictions > 3 and dec.cell_count() == dec.stored()
    for total, cells, n, _ in moments:
        assert cells == n * per_cell
    top = max(moments)
    p = dec.peak
    assert (p["bytes"], p["cell_bytes"], p["cells"], p["mirror_bytes"]) == top and top[3] > 0
    assert dec.max_cells == max(m[2] for m in moments) == 40 + 8  # K + tau: the step's token before the eviction
    assert dec.peak_report()["kv_peak_buffer_bytes"] == p["bytes"] - p["cell_bytes"] > 0
    dec.close()


def test_cache_type_names_are_ggmls(gm):
    """CACHE_TYPES's ggml type ids, block sizes and block bytes are ggml's own (ggml_blck_size, ggml_type_size), and
    the CLI's names are CACHE_TYPES's. Mutant: q4_1's 20 bytes -> 18."""
    import ctypes

    from epikv.commands.engines import CACHE_TYPE_NAMES
    from epikv.llamacpp.kvtypes import CACHE_TYPES
    from epikv.llamacpp.lib import load

    base = ctypes.CDLL(str(Path(load().ll.__file__).parent / "lib" / "libggml-base.so"))
    base.ggml_blck_size.restype = ctypes.c_int64
    base.ggml_type_size.restype = ctypes.c_size_t
    for name, (t, blck, size) in CACHE_TYPES.items():
        assert (base.ggml_blck_size(t), base.ggml_type_size(t)) == (blck, size), name
    assert set(CACHE_TYPE_NAMES) == set(CACHE_TYPES)


# -- 2. --kv-memory ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy,cell", [("random", "f16"), ("epikv-seg-q", "q8_0"), ("epikv", "q4_0"),
                                         ("epikv", "f16")])
def test_kv_memory_picks_the_largest_budget_that_fits(gm, policy, cell):
    """budget_for_memory's K: its planned peak fits the memory and K + 1's does not; a real run at K reaches the
    planned peak cells, and its measured peak bytes (cells as stored + buffers) stay within the memory. Mutants: a
    peak of K + tau - 1 cells (the run holds one more), a plan in which rows wait one step only (the epikv run on
    f16 cells, where a step's moment is the peak, exceeds the memory)."""
    from epikv.llamacpp import LlamaDecoder
    from epikv.llamacpp.kvtypes import budget_for_memory, cell_bytes, plan_peak
    from epikv.policies import get_policy

    pol = get_policy(policy, tau=4)
    memory = 52 * cell_bytes(gm, cell, cell) + 123_457
    plan = budget_for_memory(gm, pol, memory, cell, cell)
    k = plan.budget
    assert plan.total <= memory < plan_peak(gm, pol, k + 1, cell, cell).total
    dec = LlamaDecoder(gm, pol, k, max_tokens=k + 80, threads=1, type_k=cell, type_v=cell)
    _greedy(dec, _ids(gm, 6), k + 60)
    assert dec.evictions > 0
    assert dec.max_cells == plan_peak(gm, pol, k, cell, cell).cells == k + 4
    assert dec.peak["bytes"] <= plan.total <= memory
    dec.close()


def test_kv_memory_below_one_cell_is_refused(gm):
    from epikv.llamacpp.kvtypes import budget_for_memory, cell_bytes
    from epikv.policies import get_policy

    with pytest.raises(EpiKVError, match="below one q4_0/q4_0 cell"):
        budget_for_memory(gm, get_policy("random"), cell_bytes(gm, "q4_0", "q4_0") - 1, "q4_0", "q4_0")


def _cli(*argv, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "epikv.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


LLAMA = ("--engine", "llama.cpp", "--model", "smollm2", "--threads", "1")


@pytest.mark.parametrize("argv,needle", [
    (("--cache-type-v", "q8_0", "--flash-attn", "off"), "needs flash attention"),
    (("--cache-type-k", "q3_k"), "unknown cache type 'q3_k'"),
    (("--kv-memory", "20KiB"), "below one f16/f16 cell"),
    (("--kv-memory", "lots"), "expected a size like 48MiB"),
    (("--kv-memory", "8MiB", "--budget", "64"), "give --kv-memory or --budget, not both"),
    (("--policy", "context-shift", "--engine", "torch", "--model", "random:tiny"), "keeps every token at its true"),
])
def test_bad_cell_options_exit_2_in_one_line(argv, needle):
    """Mutants: resolve_flash_attn letting --flash-attn off through (llama.cpp then fails to make the context, a
    different message), the memory check against one layer's bytes instead of a cell's."""
    if "torch" in argv:
        r = _cli("generate", "--prompt", "hi", "--max-new-tokens", "2", *argv)
    else:
        r = _cli("generate", "--prompt", "hi", "--max-new-tokens", "2", *LLAMA, *argv)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_generate_says_flash_attention_and_kv_memory_pick():
    """A quantized V cache under --flash-attn auto: one line says flash attention was switched on; --kv-memory
    prints the budget it picked, and the run's JSON carries the peak bytes within that memory."""
    r = _cli("generate", "--prompt", "Count to ten.", "--max-new-tokens", "40", *LLAMA, "--cache-type-k", "q8_0",
             "--cache-type-v", "q8_0", "--kv-memory", "1MiB", "--policy", "streaming", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["flash_attn"] == "on" and (out["cache_type_k"], out["cache_type_v"]) == ("q8_0", "q8_0")
    assert out["kv_peak_bytes"] <= 2 ** 20 and out["budget"] > 0
    r = _cli("generate", "--prompt", "Count to ten.", "--max-new-tokens", "3", *LLAMA, "--cache-type-v", "q4_0",
             "--kv-memory", "1MiB", "--policy", "streaming")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "flash attention switched on" in r.stderr and re.search(r"--kv-memory 1048576 bytes .* K = \d+", r.stderr)


def test_served_stats_give_the_peak_of_quantized_sequences(gm, request):
    """`/stats` of the llama.cpp backend on q8_0 cells (flash attention on) names the cell types and gives the
    largest peak KV bytes of its sequences, running or ended, as each sequence measured it. Mutant: an ended
    sequence's peak forgotten (the figure drops to 0 once requests finish)."""
    from epikv.serving.llamacpp import LlamaBackend

    be = LlamaBackend(gm, "epikv-seg-q", 48, 8, sequences=2, max_batch_tokens=64, threads=1, flash_attn=True,
                      type_k="q8_0", type_v="q8_0")
    request.addfinalizer(be.stop)
    peaks, end = [], be._end

    def ended(r):  # each sequence's own peak as it ends
        if r.seq is not None:
            peaks.append(r.seq.peak["bytes"])
        end(r)

    be._end = ended
    for k in range(2):
        be.submit(str(k), _ids(gm, 10, seed=k), 70, sampling=None, seed=k, ignore_eos=True)
    done = 0
    while done < 2:
        o = be.next_output(120)
        assert o is not None and o.error is None
        done += o.finished
    st = be.stats()
    assert (st["cache_type_k"], st["cache_type_v"]) == ("q8_0", "q8_0") and st["evictions"] > 0
    assert st["kv_peak_bytes"] == max(peaks) > 0 and st["kv_peak_buffer_bytes"] > 0


# -- 3. context-shift --------------------------------------------------------------------------------------------------

def _shifts_by_rule(n_prompt: int, steps: int, cells: int, n_keep: int) -> list[tuple[int, int, int]]:
    """llama-server's schedule (server-context.cpp pre_decode): before a decode, when n_tokens + 1 >= n_ctx, keep
    min(n_ctx - 4, n_keep), discard (n_tokens - n_keep) / 2 (at most n_left - 1). (n_keep, n_discard, tokens seen)."""
    n, seen, out = n_prompt, n_prompt, []
    for _ in range(steps):
        if n + 1 >= cells:
            keep = min(cells - 4, n_keep)
            left = n - keep
            disc = min(max(left // 2, 0), max(0, left - 1))
            out.append((keep, disc, seen))
            n -= disc
        n, seen = n + 1, seen + 1
    return out


def test_context_shift_keeps_n_keep_and_renumbers_contiguously(gm):
    """context-shift on llama.cpp: shifts happen when llama-server's rule says (n_keep, n_discard and the step);
    after each, llama.cpp holds exactly the cells 0 .. n - 1 (contiguous positions, counted by llama.cpp) and the
    first n_keep tokens (their own ids, read back from the cache's logits is not possible: their mirror entries)
    are never dropped. Mutants: n_discard = n_left / 2 + 1, skipping llama_memory_seq_add (the mirror check then
    refuses), n_keep off by one."""
    from epikv.llamacpp import LlamaDecoder

    cells, n_keep, prompt, steps = 40, 6, _ids(gm, 10), 90
    dec = LlamaDecoder(gm, "context-shift", cells, max_tokens=200, threads=1, n_keep=n_keep)
    kept = []

    def after(seq, keep):
        kept.append(keep[:n_keep].tolist())

    dec.on_evict = after
    logits = dec.prefill(prompt)
    for _ in range(steps):
        logits = dec.step(int(np.argmax(logits)))
        n = dec.stored()
        assert dec.cache_bounds() == (0, n - 1) and dec.cell_count() == n  # contiguous after every step
        assert n <= cells - 1
    got = [(s["n_keep"], s["n_discard"], s["at"]) for s in dec.shifts]
    # epikv shifts after the step that fills the cells, llama-server before the next decode: the same state, at the
    # same count of tokens seen
    assert got == _shifts_by_rule(len(prompt), steps, cells, n_keep)[:len(got)]
    assert len(got) >= 3 and all(k == list(range(n_keep)) for k in kept)
    assert dec.next_pos == dec.stored()
    dec.close()


def test_context_shift_n_keep_minus_one_keeps_the_whole_prompt(gm):
    """n_keep = -1 (llama-server's "keep the prompt") keeps every prompt token through each shift: shifts follow the
    rule with n_keep = the prompt's length. Mutants: n_keep < 0 read as 0 in shift() (the prompt goes) or in
    protected() (the policy protects nothing)."""
    from epikv.llamacpp import LlamaDecoder
    from epikv.policies import get_policy

    assert get_policy("context-shift", n_keep=-1).protected(10) == 10
    cells, prompt, steps = 40, _ids(gm, 10), 90
    dec = LlamaDecoder(gm, "context-shift", cells, max_tokens=200, threads=1, n_keep=-1)
    kept = []
    dec.on_evict = lambda seq, keep: kept.append(keep[:len(prompt)].tolist())
    logits = dec.prefill(prompt)
    for _ in range(steps):
        logits = dec.step(int(np.argmax(logits)))
        assert dec.cache_bounds() == (0, dec.stored() - 1)
    got = [(s["n_keep"], s["n_discard"], s["at"]) for s in dec.shifts]
    assert got == _shifts_by_rule(len(prompt), steps, cells, len(prompt))[:len(got)]
    assert len(got) >= 3 and all(k == list(range(len(prompt))) for k in kept)
    dec.close()


def test_context_shift_logits_match_llama_cpp_doing_it_by_hand(gm):
    """The same shifts done with llama.cpp's calls alone (seq_rm, seq_add, as llama-server's pre_decode does them)
    on a second context of the same size fed the same tokens give bit-identical next-token logits at every step.
    Mutants: n_discard = n_left / 2 + 1 (different cells kept), n_keep off by one."""
    from epikv.llamacpp import LlamaDecoder
    from epikv.llamacpp.lib import load

    ll = load().ll
    cells, n_keep = 24, 4
    dec = LlamaDecoder(gm, "context-shift", cells, max_tokens=120, threads=1, n_keep=n_keep, flash_attn=False)
    ref = LlamaDecoder(gm, "full", None, max_tokens=120, threads=1, n_ctx=dec.n_ctx, n_batch=dec.n_batch,
                       flash_attn=False)
    b = ref.batch

    def by_hand(tokens: list[int], pos0: int) -> np.ndarray:
        b.n_tokens = len(tokens)
        for j, t in enumerate(tokens):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, pos0 + j, 1, int(j == len(tokens) - 1)
            b.seq_id[j][0] = 0
        assert ll.llama_decode(ref.ctx, b) == 0
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(ref.ctx, len(tokens) - 1), shape=(ref.n_vocab,)).copy()

    prompt = _ids(gm, 8, seed=3)
    mine = dec.prefill(prompt)
    theirs, n = by_hand(prompt, 0), len(prompt)
    shifted = 0
    for _ in range(40):
        assert np.array_equal(mine, theirs), f"max |dlogit| {np.abs(mine - theirs).max()} after {shifted} shifts"
        tok = int(np.argmax(mine))
        if n + 1 >= cells:  # llama-server's pre_decode
            disc = (n - n_keep) // 2
            ll.llama_memory_seq_rm(ref.mem, 0, n_keep, n_keep + disc)
            ll.llama_memory_seq_add(ref.mem, 0, n_keep + disc, n, -disc)
            n -= disc
            shifted += 1
        theirs = by_hand([tok], n)
        n += 1
        mine = dec.step(tok)
    assert shifted >= 2 and len(dec.shifts) == shifted
    dec.close()
    ref.close()


def test_context_shift_in_chunks_of_tau_stays_below_k(gm):
    """Fed chunks of tau tokens (as `retention` feeds a trace), context-shift shifts before a chunk would pass
    K - 1 cells, so the peak is at most K - 1 cells, as planned. Mutant: the one-token rule (n + 1 >= K) with chunks."""
    from epikv.llamacpp import LlamaDecoder
    from epikv.llamacpp.kvtypes import peak_cells
    from epikv.policies import get_policy

    pol = get_policy("context-shift", tau=8, n_keep=4)
    dec = LlamaDecoder(gm, pol, 50, max_tokens=200, threads=1, n_batch=16)
    ids = _ids(gm, 150, seed=5)
    dec.prefill(ids[:10])
    for s in range(10, 150, 8):
        dec.feed(ids[s:s + 8], all_logits=True)
    assert len(dec.shifts) >= 3 and dec.max_cells <= peak_cells(pol, 50) == 49
    dec.close()


# -- the same against llama-server --context-shift ----------------------------------------------------------------------

def _llama_server() -> Path | None:
    cache = Path(os.environ.get("EPIKV_CACHE_DIR", Path.home() / ".cache" / "epikv"))
    p = Path(os.environ.get("EPIKV_LLAMA_SERVER", cache / "llama-server" / "build" / "bin" / "llama-server"))
    return p if p.is_file() and os.access(p, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.mark.skipif(_llama_server() is None, reason="llama-server is not built: run `bash benchmarks/build_llama_server.sh`"
                                                     " (or set EPIKV_LLAMA_SERVER to its binary)")
def test_context_shift_against_llama_server(gm, request, tmp_path):
    """A seeded greedy request, the same prompt tokens, 256 cells per sequence (llama-server -c 256 --parallel 1
    --context-shift) and n_keep: epikv serve's llama.cpp backend with --policy context-shift makes llama-server's
    shifts (n_keep, n_left, n_discard, as it logs them, in order) and gives its tokens (where batching sums
    differ: its tokens up to the first shift; the test prints where they part). Mutant: n_discard = n_left / 2 + 1."""
    from epikv.llamacpp.model import gguf_path
    from epikv.serving.llamacpp import LlamaBackend

    cells, n_keep, new = 256, 8, 400
    # a prompt greedy decoding continues without end-of-text (llama-server's ignore_eos masks EOS, epikv's does not)
    prompt = gm.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", True)
    port = _free_port()
    log = tmp_path / "llama-server.log"
    with open(log, "w") as f:
        srv = subprocess.Popen([str(_llama_server()), "-m", str(gguf_path("smollm2")), "--port", str(port),
                                "-c", str(cells), "--parallel", "1", "--context-shift", "--threads", "1",
                                "-fa", "off", "--no-warmup", "-b", "512", "-ub", "512"],
                               stdout=f, stderr=subprocess.STDOUT)
    request.addfinalizer(srv.kill)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:
            time.sleep(0.2)
    else:
        pytest.fail("llama-server did not start: " + log.read_text()[-2000:])
    theirs = _post(url + "/completion", {"prompt": prompt, "n_predict": new, "temperature": 0, "n_keep": n_keep,
                                         "cache_prompt": False, "ignore_eos": True, "return_tokens": True,
                                         "seed": 0})
    srv.kill()
    srv.wait()
    from epikv.llamacpp.lib import load

    ll = load().ll
    add_bos = int(ll.llama_vocab_get_add_bos(ll.llama_model_get_vocab(gm.ptr)))
    be = LlamaBackend(gm, "context-shift", cells, None, sequences=1, max_batch_tokens=512, threads=1,
                      flash_attn=False, n_keep=n_keep + add_bos)  # llama-server adds one for the BOS it keeps
    request.addfinalizer(be.stop)
    ours_shifts: list = []

    def snapshot(backend):  # the engine thread, after each step
        for r in backend._running:
            if r.seq is not None and len(r.seq.shifts) > len(ours_shifts):
                ours_shifts[:] = list(r.seq.shifts)

    be.on_step = snapshot
    be.submit("0", prompt, new, sampling=None, seed=0, ignore_eos=True)
    out = None
    while out is None or not out.finished:
        out = be.next_output(120)
        assert out is not None and out.error is None
    ours = out.tokens
    logged = [tuple(int(x) for x in m) for m in
              re.findall(r"context shift, n_keep = (\d+), n_left = (\d+), n_discard = (\d+)", log.read_text())]
    assert len(logged) >= 2, "llama-server logged fewer than two context shifts: " + log.read_text()[-1500:]
    assert len(theirs["tokens"]) == len(ours) == new
    # the shifts: llama-server's n_keep, n_left and n_discard, as it logs them, in order
    assert [(s["n_keep"], s["cells"] - s["n_keep"], s["n_discard"]) for s in ours_shifts][:len(logged)] == logged
    if ours != theirs["tokens"]:  # batching sums may differ: then the same tokens up to the first shift
        upto = cells - len(prompt) - 1
        assert ours[:upto] == theirs["tokens"][:upto]
        first = next(i for i, (a, t) in enumerate(zip(ours, theirs["tokens"])) if a != t)
        print(f"the tokens agree up to {first} of {new} (the first shift after {upto}); the shifts agree")
