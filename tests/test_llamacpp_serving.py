"""`epikv serve --engine llama.cpp` (epikv.serving.llamacpp.LlamaBackend) on the embedded GGUF, with the unified
cache (kv="unified": the default for `full`; a stream per sequence, the default for evicting policies, is tested in
tests/test_llamacpp_streams.py; the command's tests here run its defaults): sequences batched
in one llama.cpp context agree with the single-sequence engine, a sequence's cache after eviction holds exactly its
kept positions while others run in the same batches, cells return when sequences evict and end, more sequences run
than `full` allows in the same cells, and the command answers the `openai` client and refuses in one line.

Batch invariance, measured on this CPU (LLAMACPP.md asks): llama.cpp's output for a sequence is NOT bit-invariant to
where its cells lie in the unified cache. With flash attention off, the same prompt decoded alone gives bit-equal
logits whether another sequence's cells sit 0 or 8 cells below it, and different logits (max |diff| 0.57 and 0.75)
at 1 or 37 cells: the attention-times-V product (a dot product over cells of the transposed f16 V cache) sums in
8-lane groups by cell index. Batch size alone changes nothing (the same cells, 1 or 8 rows: bit-equal). With flash
attention on, the offset alone changes nothing but the batch's composition does (0.71). Continuous batching
interleaves sequences' cells, so tokens cannot be compared one for one; the tests compare (flash attention off,
the single-sequence engine fed the served sequence's own tokens): captured block outputs within 2 % of the largest
entry (measured: at most 0.41 %; reading another sequence's rows gives O(1)), logits within 2.5 (measured: at most
1.61; reading another sequence's rows gives up to 4.4), and one served sequence at a time equals
`epikv.llamacpp.generate` token for token (its cells are then laid out as generate's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
KW = dict(policy="epikv", budget=64, tau=8)  # prompts of 45-50 tokens: eviction within a few dozen tokens
N = 48


@pytest.fixture(scope="module")
def gm():
    from epikv.llamacpp import available, load_gguf

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    return load_gguf("smollm2")


def _prompts(gm, n):
    from epikv.engine import encode_prompts

    return [encode_prompts(gm.tokenizer, [f"Question {i}: what is {i} plus {2 * i + 1}? Think step by step."],
                           chat=True)[0] for i in range(n)]


def _run(be, prompts, max_tokens=N, sampling=None):
    """Submit all at once; {rid: final Output}. Fails on a lost, repeated or failed request."""
    for k, ids in enumerate(prompts):
        be.submit(str(k), ids, max_tokens, sampling=sampling, seed=k, ignore_eos=False)
    done, last = {}, {}
    while len(done) < len(prompts):
        o = be.next_output(60)
        assert o is not None, f"no output within 60 s; finished {sorted(done)}"
        assert o.error is None, o.error
        assert o.request_id not in done, f"output after the end of {o.request_id}"
        prev = last.get(o.request_id, [])
        assert o.tokens[:len(prev)] == prev and len(o.tokens) == len(prev) + 1, "a token sent twice or taken back"
        last[o.request_id] = o.tokens
        if o.finished:
            done[o.request_id] = o
    return done


def _backend(gm, request, **kw):
    from epikv.serving.llamacpp import LlamaBackend

    args = {**KW, "flash_attn": False, "threads": 1, "kv": "unified", **kw}
    be = LlamaBackend(gm, **args)
    request.addfinalizer(be.stop)
    return be


def test_one_sequence_at_a_time_equals_generate(gm, request):
    """Served alone, a request's cells lie as generate's: token for token the same answer (greedy and sampled)."""
    from epikv.engine import Sampling
    from epikv.llamacpp import generate

    prompts = _prompts(gm, 2)
    be = _backend(gm, request, ctx=256, sequences=1, max_batch_tokens=64)
    got = _run(be, prompts)
    samp = Sampling(temperature=0.8, top_p=0.9, seed=0)
    got_s = _run(be, prompts[:1], sampling=samp)
    for k, ids in enumerate(prompts):
        ref = generate(gm, ids, max_new_tokens=N, flash_attn=False, threads=1, **KW)
        assert got[str(k)].tokens[:len(ref.token_ids[0])] == ref.token_ids[0]
    ref = generate(gm, prompts[0], max_new_tokens=N, flash_attn=False, threads=1, sampling=samp, seed=0, **KW)
    assert got_s["0"].tokens[:len(ref.token_ids[0])] == ref.token_ids[0]
    assert be.stats()["evictions"] > 0


def _chat(gm, turns: int) -> list[int]:
    """A multi-turn chat: a system prompt, `turns` question / answer pairs, and a last question."""
    msgs = [{"role": "system", "content": "You answer questions about numbers briefly."}]
    for i in range(turns):
        msgs += [{"role": "user", "content": f"What is the sum of the first {i + 3} odd numbers?"},
                 {"role": "assistant", "content": f"It is {(i + 3) ** 2}: " + " + ".join(
                     str(2 * j + 1) for j in range(i + 3)) + "."}]
    msgs.append({"role": "user", "content": "And of the first ten?"})
    return list(gm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))


def test_prompt_over_the_budget_is_served_evicted_inside(gm, request):
    """A prompt whose protection does not fit K = 64 (a multi-turn chat, about 150 tokens) used to be refused; it is
    served with prompt protection off, as `--no-protect-prompt` does: alone, token for token the single-sequence
    engine's run with protect_prompt=False. A prompt longer than the 256 cells is evicted between its prefill
    chunks. Mutant: Policy.for_prompt returning self (the old refusal) fails both at submit."""
    from epikv.llamacpp import generate

    chat, huge = _chat(gm, 3), _chat(gm, 8)
    assert 64 < len(chat) <= 192 < 256 < len(huge), (len(chat), len(huge))
    be = _backend(gm, request, ctx=256, sequences=1, max_batch_tokens=192)
    assert be.prompt_refusal(len(chat)) is None and be.prompt_refusal(len(huge)) is None
    got = _run(be, [chat])
    ref = generate(gm, chat, max_new_tokens=N, flash_attn=False, threads=1, protect_prompt=False, **KW)
    assert got["0"].tokens[:len(ref.token_ids[0])] == ref.token_ids[0]
    got = _run(be, [huge], max_tokens=8)
    st = be.stats()
    assert len(got["0"].tokens) == 8 and st["prompts_evicted"] == 2 and st["peak_cells"] <= 256


def test_batched_sequences_agree_with_the_single_sequence_engine(gm, request, monkeypatch):
    """6 sequences batched together: each one's captured rows and logits match the single-sequence decoder fed the
    same tokens, within the tolerances of the module docstring."""
    from epikv.llamacpp import LlamaDecoder
    from epikv.llamacpp.sequence import SequenceCache

    record = SequenceCache.record

    def logged(self, t, rows):  # each sequence's own log (not by id(): a freed object's id is reused)
        self.__dict__.setdefault("test_log", []).append({b: r.copy() for b, r in rows.items()})
        record(self, t, rows)

    monkeypatch.setattr(SequenceCache, "record", logged)
    prompts = _prompts(gm, 6)
    be = _backend(gm, request, ctx=1024, sequences=6, max_batch_tokens=64)
    be.trace = {}
    seq_of = {}
    be.on_step = lambda b: seq_of.update({r.rid: r.seq for r in b._running})
    done = _run(be, prompts)
    assert be.stats()["max_running"] == 6 and be.stats()["evictions"] >= 6
    for k, ids in enumerate(prompts):
        toks = done[str(k)].tokens
        dec = LlamaDecoder(gm, max_tokens=len(ids) + N, flash_attn=False, n_batch=len(ids), threads=1, **KW)
        lg = [dec.prefill(ids)]
        for t in toks[:-1]:
            lg.append(dec.step(t))
        dec.close()
        mine, ref = seq_of[str(k)].test_log, dec.test_log
        for b in mine[0]:
            a, r = np.concatenate([x[b] for x in mine]), np.concatenate([x[b] for x in ref])
            assert a.shape == r.shape
            assert np.abs(a - r).max() <= 0.02 * np.abs(r).max(), (k, b, np.abs(a - r).max() / np.abs(r).max())
        assert _logit_gap(be.trace[str(k)], lg) <= 2.5, k


def _forced(gm, ids, toks, **kw):
    """The single-sequence decoder's logits before each of `toks`, fed the prompt and then those tokens."""
    from epikv.llamacpp import LlamaDecoder

    dec = LlamaDecoder(gm, max_tokens=len(ids) + len(toks), flash_attn=False, n_batch=len(ids), threads=1, **KW)
    lg = [dec.prefill(ids)]
    for t in toks[:-1]:
        lg.append(dec.step(t))
    dec.close()
    return lg


def _logit_gap(served, ref) -> float:
    assert len(served) == len(ref), (len(served), len(ref))  # one drawn token per logits row, none drawn twice
    return max(float(np.abs(x - y).max()) for x, y in zip(served, ref))


def _held_positions(ll, mem, seq, spare, upto):
    """The positions llama.cpp's cache holds for `seq`, read one by one: copy position p to a spare sequence and
    see whether it arrived (no numerics involved)."""
    held = []
    for p in range(upto):
        ll.llama_memory_seq_rm(mem, spare, -1, -1)
        ll.llama_memory_seq_cp(mem, seq, spare, p, p + 1)
        if ll.llama_memory_seq_pos_max(mem, spare) == p:
            held.append(p)
    ll.llama_memory_seq_rm(mem, spare, -1, -1)
    return held


def test_cache_holds_exactly_the_kept_positions_with_others_in_the_batch(gm, request):
    """After each eviction, with other sequences in the same batches, llama.cpp holds exactly the sequence's kept
    positions (its mirror), and the cells in use are the sum of what the sequences hold."""
    be = _backend(gm, request, ctx=512, sequences=4, max_batch_tokens=64, spare_sequences=1)
    ll, checks, seen = be._ll, [], {}

    def check(b):
        for r in b._running:
            s = r.seq
            if s.evictions and seen.get(r.rid) != s.evictions:
                seen[r.rid] = s.evictions
                held = _held_positions(ll, b.mem, s.seq, b.sequences, s.seen)
                checks.append((len(b._running), held == s.positions.tolist()))
                assert len(held) <= KW["budget"] + KW["tau"]
        # the gauge against llama.cpp's own count of every sequence's cells (not the mirrors it is summed from)
        assert b.gauges()["cells_in_use"] == b.llama_cells()

    be.on_step = check
    _run(be, _prompts(gm, 6), max_tokens=40)
    assert be.healthy(), be.fatal
    assert checks and all(ok for _, ok in checks), checks
    assert max(n for n, _ in checks) > 1  # checked while other sequences ran


def test_cells_return_after_eviction_and_finishing(gm, request):
    """Free cells go back up when a sequence evicts and to all of --ctx when it ends; llama.cpp then holds nothing for
    any sequence id; a context that fits only two sequences serves six, one after another."""
    be = _backend(gm, request, ctx=160, sequences=2, max_batch_tokens=64)
    seen = []  # (the gauge, llama.cpp's own count of every sequence's cells) after each step
    be.on_step = lambda b: seen.append((b.gauges()["cells_in_use"], b.llama_cells()))
    _run(be, _prompts(gm, 6), max_tokens=40)
    in_use = [g for g, _ in seen]
    assert max(in_use) <= 160 and all(g == n for g, n in seen)  # the gauge is what llama.cpp counts
    assert any(b < a for a, b in zip(in_use, in_use[1:]))  # evictions and endings freed cells
    g = be.gauges()
    assert g["cells_in_use"] == 0 and g["cells_free"] == 160 and g["evictions"] > 0
    assert all(be._ll.llama_memory_seq_pos_max(be.mem, s) == -1 for s in range(2))
    assert be.stats()["finished"] == 6


def test_more_sequences_than_full_in_the_same_cells(gm, request):
    """In 320 cells, `full` (whole length reserved) runs 2 requests of ~47 + 60 tokens at once; epikv at K=64 all 4
    (twice as many). The in-flight figures bench serve reports: `full` holds 2 in every decode in which a request
    waited for cells; epikv's cache never held one back; the peak cells are what the decodes held, within --ctx."""
    prompts = _prompts(gm, 4)
    full = _backend(gm, request, ctx=320, sequences=8, max_batch_tokens=128, policy="full", budget=None)
    held = []  # (sequences holding cells, cells in use) after each of full's decodes
    full.on_step = lambda b: held.append((len(b._running), b.gauges()["cells_in_use"]))
    _run(full, prompts, max_tokens=60)
    epi = _backend(gm, request, ctx=320, sequences=8, max_batch_tokens=128)
    _run(epi, prompts, max_tokens=60)
    fs, es = full.stats(), epi.stats()
    assert fs["max_running"] == 2 and fs["preemptions"] == 0
    assert es["max_running"] == 4 and es["evictions"] > 0, es
    assert fs["max_in_flight"] == 2 and es["max_in_flight"] == 4
    assert sum(full.in_flight_hist.values()) == fs["steps"] and sum(epi.in_flight_hist.values()) == es["steps"]
    # full: two waited while the first two decoded (up to 60 tokens: they may end at EOS); the last decodes, with no
    # one waiting, are not counted
    assert fs["cache_full_steps"] >= 20 and fs["in_flight_cache_full_mean"] == 2.0, fs
    assert fs["cache_full_steps"] < fs["steps"] and es["cache_full_steps"] == 0 and es["in_flight_cache_full_mean"] is None
    # no eviction in full: its fullest decode holds its running sequences' cells, before one of them ends
    assert max(c for _, c in held) < fs["peak_cells"] <= 320 and es["peak_cells"] <= 320


def test_preemption_is_counted_and_sends_nothing_twice(gm, request):
    """A context too small for its sequences' growth preempts (counted); a preempted request is prefilled again and
    its tokens fed back without being sent again (_run checks every output extends the last by one token), and it
    ends with its full answer, each token drawn from logits that match the single-sequence engine's fed the same
    tokens (tolerance of the module docstring); the cells never exceed --ctx."""
    prompts = _prompts(gm, 3)
    tight = _backend(gm, request, ctx=160, sequences=3, max_batch_tokens=64)
    in_use = []
    tight.on_step = lambda b: in_use.append(b.gauges()["cells_in_use"])
    tight.trace = {}
    got = _run(tight, prompts, max_tokens=40)
    st = tight.stats()
    assert st["preemptions"] > 0 and st["admitted"] == 3 + st["preemptions"], st
    assert st["finished"] == 3 and max(in_use) <= 160
    eog = set(gm.tokenizer.eog_ids())
    assert all(len(o.tokens) == 40 or o.tokens[-1] in eog for o in got.values())
    for k, ids in enumerate(prompts):  # each token drawn from logits of the rebuilt cache, as in the batched test
        assert _logit_gap(tight.trace[str(k)], _forced(gm, ids, got[str(k)].tokens)) <= 2.5, k


# -- the command ------------------------------------------------------------------------------------------------------
def _env(extra=""):
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra, str(ROOT / "src"),
                                                                   os.environ.get("PYTHONPATH", "")) if p),
                HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "epikv.cli", *argv], capture_output=True, text=True, timeout=300,
                          env=env or _env())


@pytest.mark.parametrize("argv, needle", [
    (["--policy", "h2o"], "policy h2o is not supported by --engine llama.cpp"),
    (["--num-blocks", "8"], "--num-blocks: options of the torch engine's paged cache"),
    (["--dtype", "bfloat16"], "--dtype: torch engine options"),
    (["--budget", "256", "--ctx", "200", "--kv", "unified"], "cannot hold one sequence at its budget"),
    (["--budget", "256", "--ctx", "400"], "--ctx 400 gives each of the 2 streams 200 cells"),
])
def test_cli_refusals_exit_2_in_one_line(argv, needle):
    base = ["serve", "--engine", "llama.cpp", "--ctx", "512", "--sequences", "2", "--budget", "64", "--port", "0"]
    p = _cli(*base, *argv)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--engine", "llama.cpp", "--num-blocks", "8", "--ctx", "512"], "--num-blocks: options of the torch engine's paged"),
    (["--engine", "llama.cpp"], "--ctx is required (or --url for a running server)"),
    (["--engine", "llama.cpp", "--ctx", "512", "--equal-batch", "2"], "--equal-batch times transformers' engine"),
    (["--ctx", "512", "--num-blocks", "8"], "--ctx: options of --engine llama.cpp"),
    (["--sequences", "4", "--num-blocks", "8"], "--sequences: options of --engine llama.cpp"),
])
def test_bench_serve_refusals_exit_2_in_one_line(tmp_path, argv, needle):
    p = _cli("bench", "serve", "--model", "smollm2", "--requests", "2", "--out", str(tmp_path / "b"), *argv)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr


def test_bench_serve_on_llama_cpp(tmp_path):
    """`epikv bench serve --engine llama.cpp` end to end: both rows served over HTTP by `epikv serve --engine
    llama.cpp` in the same cells: the first 4 prompts of <= 100 tokens (80, 79, 46 and 72) + 96 tokens; in 600 cells
    `full` holds 3 and the cache held the fourth back, epikv K=128 (at most 129 cells each) runs all 4; the table is
    in cells; a second run reuses both rows."""
    out = tmp_path / "b"
    argv = ["bench", "serve", "--engine", "llama.cpp", "--model", "smollm2", "--policies", "full,epikv", "--budgets",
            "128", "--ctx", "600", "--requests", "4", "--concurrency", "4", "--max-tokens", "96",
            "--max-prompt-tokens", "100", "--threads", "1", "--timeout", "240", "--kv", "unified", "--out", str(out)]
    r = _cli(*argv)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [x["label"] for x in rows] == ["full", "epikv K=128"]
    full, epi = rows
    for x in rows:
        assert x["engine"] == "llama.cpp" and x["cells"] == 600 and x["server"]["engine"] == "llama.cpp"
        assert x["completed"] == x["complete_length"] == 4 and x["generated_tokens"] == 4 * 96, x
        assert 0 < x["peak_cells"] <= 600 and x["tokens_per_s"] > 0 and x["preemptions"] == 0
        assert "CPU" in x["server"]["system_info"]  # the build's CPU features, recorded with the row
        assert x["settings"]["ctx"] == 600 and x["settings"]["sequences"] == 4 and x["settings"]["page"] is None
    assert full["max_in_flight"] == 3 and full["cache_full_steps"] > 0 and full["in_flight_cache_full_mean"] == 3.0
    assert epi["max_in_flight"] == 4 and epi["cache_full_steps"] == 0 and epi["evictions"] > 0
    text = (out / "table.md").read_text()
    assert "llama.cpp, 600 cells, 4 sequences" in text and "| peak cells / cells |" in text
    assert f"| {full['peak_cells']} / 600 |" in text and epi["peak_cells"] <= 4 * 129 and "never full (>= 4)" in text
    r2 = _cli(*argv)
    assert r2.returncode == 0 and r2.stderr.count("reusing the finished row") == 2, r2.stderr


def test_cli_without_llama_cpp_one_line(tmp_path):
    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libllama.so: cannot open shared object file')\n")
    p = _cli("serve", "--engine", "llama.cpp", "--ctx", "512", "--sequences", "2", "--port", "0",
             env=_env(str(tmp_path)))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "needs llama-cpp-python" in p.stderr, p.stderr


def test_serve_answers_twenty_concurrent_openai_requests(gm):
    """The command on the embedded GGUF with eviction on: 20 concurrent requests through the `openai` client (a
    third streamed) all answered, once each, each with its own prompt's answer (its start equals the lone
    single-sequence engine's: batched sequences may part from it after a near-tie, module docstring); /metrics
    shows cells, /stats the engine's evictions; SIGTERM drains and exits 0."""
    import re

    proc = subprocess.Popen([sys.executable, "-m", "epikv.cli", "serve", "--engine", "llama.cpp", "--policy", "epikv",
                             "--sequences", "8", "--budget", "72", "--tau", "8", "--recent", "16",
                             "--max-batch-tokens", "128",
                             "--threads", "1", "--port", "0", "--max-tokens", "40"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    url, err = None, []
    end = time.monotonic() + 120
    while time.monotonic() < end:
        line = proc.stderr.readline()
        err.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    assert url, "".join(err)
    threading.Thread(target=lambda: [err.append(x) for x in proc.stderr], daemon=True).start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        questions = [f"Question {i}: what is {i} plus {2 * i + 1}? Think step by step." for i in range(20)]

        def ask(i):
            msgs = [{"role": "user", "content": questions[i]}]
            if i % 3 == 0:
                chunks = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, stream=True)
                return i, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40)
            return i, r.choices[0].message.content

        with ThreadPoolExecutor(20) as ex:
            answers = dict(ex.map(ask, range(20)))
        assert sorted(answers) == list(range(20))
        import urllib.request

        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        # a stream per sequence (the default for epikv), --ctx derived: 72 + 8 - 1 + 128 cells, 256 by llama.cpp
        assert "epikv_cache_cells_free 2048.0" in metrics and "epikv_cache_cells_in_use 0.0" in metrics
        assert 'epikv_requests_total{outcome="completed"} 20.0' in metrics
        stats = json.loads(urllib.request.urlopen(url + "/stats", timeout=30).read().decode())
        assert stats["engine"]["engine"] == "llama.cpp" and stats["engine"]["max_running"] > 1
        assert stats["engine"]["evictions"] > 0 and stats["engine"]["kv"] == "streams"
        assert stats["engine"]["stream_cells"] == 256
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0, "".join(err)
    # each answer is its own prompt's: the library's engine on the same prompt (one at a time: the same cells as
    # a lone request) gives the same text
    from epikv.engine import encode_prompts
    from epikv.llamacpp import LlamaDecoder

    for i in (0, 7, 19):
        ids = encode_prompts(gm.tokenizer, [questions[i]], chat=True)[0]
        dec = LlamaDecoder(gm, "epikv", 72, 8, recent=16, max_tokens=len(ids) + 40, n_batch=len(ids), threads=1)
        lg, toks = dec.prefill(ids), []
        for _ in range(40):
            toks.append(int(np.argmax(lg)))
            if toks[-1] in gm.tokenizer.eog_ids():
                break
            lg = dec.step(toks[-1])
        dec.close()
        ref = gm.tokenizer.decode([t for t in toks if t not in gm.tokenizer.eog_ids()])
        # a stream per sequence: the batched answer is the lone one, whole (tests/test_llamacpp_streams.py)
        assert answers[i] == ref, (i, answers[i], ref)


def test_soak_on_llama_cpp():
    """The server-features soak (tests/test_serving_soak.py) on this engine, at its size: 100 warm-up requests, then
    500 of random short lengths at 16 concurrent (half sampled, a third streamed, one in ten dropped mid-stream, one
    in twenty malformed): every well-formed request answered once with distinct ids, none failed, every cell back
    when idle, RSS after the soak within 10 % of after the warm-up, /metrics agreeing with /stats, /health ok
    throughout. EPIKV_SOAK_OUT: write the figures there (benchmarks/results/serve/soak/)."""
    from prometheus_client.parser import text_string_to_metric_families
    from test_serving_soak import HealthWatch, soak

    from test_serving_http import Served  # the serve tests' launcher

    # epikv-seg-q at tau 16 (the default when this soak was sized; its "steps" rule evicts these short requests):
    # budget + tau fits the 80 cells a stream gets
    s = Served(["--engine", "llama.cpp", "--policy", "epikv-seg-q", "--ctx", "1280", "--sequences", "16", "--budget",
                "64", "--tau", "16",
                "--threads", "1", "--max-batch-tokens", "128", "--max-tokens", "40"])
    try:
        health = HealthWatch(s)
        r = soak(s, "smollm2", 2000, "cells_in_use")
        warm, got, st_warm, st, rss_warm, rss_after = (r[k] for k in ("warm", "got", "idle_warm", "idle",
                                                                      "rss_warm", "rss_after"))
        health_bad = health.stop()
        kinds = [k for k, _ in warm + got]
        ids = [x for _, x in warm + got if x is not None]
        answered = kinds.count("whole") + kinds.count("streamed")
        http_st, eng = st["http"], st["engine"]
        figures = {"engine": "llama.cpp", "requests": len(got), "warmup": len(warm), "whole": kinds.count("whole"),
                   "streamed": kinds.count("streamed"), "dropped": kinds.count("dropped"),
                   "malformed": kinds.count("malformed"), "soak_seconds": round(r["soak_s"], 1),
                   "total_seconds": round(r["total_s"], 1),
                   "rss_after_warmup_mib": round(rss_warm / 1024, 1), "rss_after_soak_mib": round(rss_after / 1024, 1),
                   "rss_ratio": round(rss_after / rss_warm, 3), "completed": http_st["completed"],
                   "cancelled": http_st["cancelled"], "failed": http_st["failed"], "evictions": eng["evictions"],
                   "peak_cells": eng["peak_cells"], "cells_in_use_idle": eng["cells_in_use"],
                   "max_in_flight": eng["max_in_flight"], "health_failures": len(health_bad)}
        print("soak:", json.dumps(figures))
        if os.environ.get("EPIKV_SOAK_OUT"):
            Path(os.environ["EPIKV_SOAK_OUT"]).write_text(json.dumps(figures, indent=1) + "\n")
        assert len(ids) == answered == len(set(ids))  # every well-formed request answered once, ids distinct
        assert kinds.count("dropped") == 60 and kinds.count("malformed") == 30
        # the dropped ones: cancelled, or finished before the hang-up was seen; none failed, none left in flight
        assert http_st["completed"] + http_st["cancelled"] == answered + kinds.count("dropped")
        assert http_st["failed"] == 0 and http_st["in_flight"] == 0
        assert st_warm["engine"]["cells_in_use"] == 0 and eng["cells_in_use"] == 0 and eng["running"] == 0
        # and llama.cpp's own count once idle: every ended, dropped or failed request's cells were removed
        assert st_warm["engine"]["cells_held_when_idle"] == 0 and eng["cells_held_when_idle"] == 0
        assert eng["idle_checks"] > st_warm["engine"]["idle_checks"] >= 1  # counted after each part, not the start's
        assert eng["max_running"] > 1 and eng["evictions"] > 0
        assert rss_after <= 1.10 * rss_warm, (rss_warm, rss_after)
        assert not health_bad, health_bad[:3]
        fams = {f.name: f for f in text_string_to_metric_families(s.get_text("/metrics"))}
        val = {(x.name, x.labels.get("outcome")): x.value for f in fams.values() for x in f.samples}
        assert val[("epikv_requests_total", "completed")] == http_st["completed"]
        assert val[("epikv_requests_total", "invalid")] == kinds.count("malformed")
        # 16 streams (epikv's default), each rounded up to 256 cells by llama.cpp
        assert val[("epikv_cache_cells_in_use", None)] == 0 and val[("epikv_cache_cells_free", None)] == 16 * 256
        assert val[("epikv_evictions_total", None)] == eng["evictions"]
        assert val[("epikv_time_to_first_token_seconds_count", None)] >= answered
    finally:
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, "".join(s.err)
