"""The llama.cpp engine's review (issue 41): each test fails on the defect it names, checked against llama.cpp itself
(its own count of a sequence's cells, its positions, its state sizes) rather than against epikv's own figures.

llama-cpp-python is required (the README's test command installs it); these tests fail, never skip, without it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import warnings
from pathlib import Path

import numpy as np
import pytest

from epikv.errors import EpiKVError

ROOT = Path(__file__).resolve().parents[1]
META_BYTES = 12  # llama.cpp's state bytes per cell besides its K and V rows (measured on SmolLM2, test below)


@pytest.fixture(scope="module")
def gm():
    from epikv.llamacpp import available, load_gguf

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    return load_gguf("smollm2")


def _py(code: str, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


# -- 1. the tokenizer keeps its model alive ---------------------------------------------------------------------------

def test_tokenizer_outlives_the_model_object_and_refuses_after_close():
    """`load_gguf(...).tokenizer` alone keeps the vocabulary (the model is freed with its last holder), and after an
    explicit close() the tokenizer raises EpiKVError instead of reading freed memory. In a child process: the
    defect is a segfault once the heap is reused."""
    p = _py("""
import gc
from epikv.errors import EpiKVError
from epikv.llamacpp import load_gguf
tok = load_gguf("smollm2").tokenizer
gc.collect()
junk = [bytearray(1 << 20) for _ in range(256)]  # reuse the heap the model would have freed
ids = tok.encode("Hello world, twice.", False)
print(tok.decode(ids))
assert not tok._model.closed
gm = load_gguf("smollm2")
tok2 = gm.tokenizer
gm.close()
try:
    tok2.encode("Hello", False)
    print("no error after close")
except EpiKVError as e:
    print("refused:", e)
""")
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    lines = p.stdout.splitlines()
    assert lines[0] == "Hello world, twice."
    assert lines[1].startswith("refused: the llama.cpp model smollm2 was closed"), lines


# -- 2. kv_bytes at the GGUF's own key / value lengths -----------------------------------------------------------------

def test_kv_bytes_per_cell_equal_llama_cpps_own_state_sizes(gm, tmp_path):
    """llama.cpp's state grows by a cell's K and V rows of every layer plus META_BYTES per cell (CellCounter's
    per_cell, measured by llama.cpp). On SmolLM2 (30 layers, 3 KV heads of 64) that fixes META_BYTES; on a
    Qwen3-shaped GGUF whose key/value length (32) is not n_embd / n_head (16), kv_bytes must follow the GGUF's
    lengths: the old n_embd / n_head formula gives half."""
    from epikv.llamacpp import LlamaDecoder, load_gguf
    from test_llamacpp import _tiny_gguf

    dec = LlamaDecoder(gm, "epikv", 72, max_tokens=80, threads=1)
    assert dec.cells.per_cell == 30 * 2 * 3 * 64 * 2 + META_BYTES
    assert dec.kv_bytes() == dec.n_ctx * (dec.cells.per_cell - META_BYTES)
    q = load_gguf(str(_tiny_gguf(tmp_path / "qwen3.gguf", arch="qwen3", n_embd=64, n_head=4, n_head_kv=2,
                                 head_dim=32)))
    assert (q.head_dim_k, q.head_dim_v, q.n_head_kv_layers) == (32, 32, (2, 2, 2, 2))
    for type_kv, elem in (("f16", 2), ("f32", 4)):
        d = LlamaDecoder(q, "epikv", 48, max_tokens=80, threads=1, type_kv=type_kv)
        per_cell = d.cells.per_cell - META_BYTES  # llama.cpp's own bytes per cell
        assert per_cell == 4 * 2 * 2 * 32 * elem
        assert d.kv_bytes() == d.n_ctx * per_cell
        d.prefill(list(range(100, 120)))  # and the model runs, its cells counted
        assert d.cell_count() == 20


# -- 3. the in-engine check counts cells, and the oracle runs at tau > 1 ------------------------------------------------

def test_mirror_check_counts_cells_not_only_bounds(gm):
    """A cell removed from the middle of the sequence behind the engine's back keeps seq_pos_min / max as they
    were: only the count shows it, and the check after an eviction raises."""
    from epikv.llamacpp import LlamaDecoder, load

    dec = LlamaDecoder(gm, "epikv", 128, max_tokens=200, threads=1)
    dec.prefill(list(range(100, 160)))
    dec._check_mirror()
    assert dec.cell_count() == dec.stored() == 60
    load().ll.llama_memory_seq_rm(dec.mem, 0, 30, 31)
    assert dec.cache_bounds() == (0, 59)  # the bounds cannot see it
    with pytest.raises(EpiKVError, match="holds 59 cells of sequence 0 but epikv's mirror 60"):
        dec._check_mirror()


def test_runs_of_several_positions_are_removed_whole(gm):
    """At tau = 8 an eviction removes runs of adjacent positions in one seq_rm; after every eviction llama.cpp
    counts exactly the mirror's cells, and at least one run was longer than one position (the case a removal
    that stops one short gets wrong while both bounds stay right)."""
    from epikv.engine import encode_prompts
    from epikv.llamacpp import LlamaDecoder, load

    ids = encode_prompts(gm.tokenizer, ["Explain step by step why the sum of two odd numbers is even."],
                         chat=True)[0]
    dec = LlamaDecoder(gm, "epikv", 64, tau=8, max_tokens=len(ids) + 120, threads=1)
    runs = []
    seq_rm = load().ll.llama_memory_seq_rm
    logits = dec.prefill(ids)
    orig = dec._ll

    class Spy:  # every seq_rm the engine makes, by run length
        def __getattr__(self, name):
            return getattr(orig, name)

        @staticmethod
        def llama_memory_seq_rm(mem, seq, p0, p1):
            runs.append(p1 - p0)
            return seq_rm(mem, seq, p0, p1)

    dec._ll = Spy()
    for _ in range(100):
        logits = dec.step(int(np.argmax(logits)))
        assert dec.cell_count() == dec.stored()
    assert dec.evictions >= 8 and max(runs) >= 2, runs


# -- 4. /metrics counters never go down ---------------------------------------------------------------------------------

def test_eviction_totals_never_count_an_ending_sequence_twice(gm, request):
    """A scrape while a request ends (its cells being removed) reads the same totals as after it: the sequence's
    counts move from the running to the ended totals in one step."""
    from epikv.llamacpp.sequence import SequenceCache
    from epikv.serving.llamacpp import LlamaBackend
    from test_llamacpp_serving import _prompts

    be = LlamaBackend(gm, "epikv", 64, 4, ctx=256, sequences=2, max_batch_tokens=64, threads=1)
    request.addfinalizer(be.stop)
    scraped, inside = [], threading.Event()
    drop = SequenceCache.drop

    def slow_drop(self):  # hold the engine thread inside _end
        inside.set()
        time.sleep(0.3)
        drop(self)

    def scrape():
        inside.wait(60)
        for _ in range(20):
            scraped.append(be.gauges()["evicted_tokens"])
            time.sleep(0.02)

    t = threading.Thread(target=scrape)
    t.start()
    from unittest import mock

    with mock.patch.object(SequenceCache, "drop", slow_drop):
        be.submit("a", _prompts(gm, 1)[0], 40, sampling=None, seed=0, ignore_eos=True)
        while not (o := be.next_output(60)).finished:
            assert o.error is None
        t.join()
    final = be.gauges()["evicted_tokens"]
    assert final > 0 and scraped and all(a <= b for a, b in zip(scraped, scraped[1:])), scraped
    assert max(scraped) <= final, (scraped, final)


# -- 5. an exception inside the Python capture callback --------------------------------------------------------------

@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_exception_in_the_python_callback_is_raised_not_swallowed(gm, exc):
    """Raised inside the callback after the first block's rows were copied, it would stop ggml's forward half-way
    (ctypes answers false) while llama_decode reports success: the decode must raise instead (KeyboardInterrupt as
    itself), and the next decode runs clean."""
    from epikv.llamacpp import LlamaDecoder

    dec = LlamaDecoder(gm, "epikv", 72, max_tokens=80, threads=1, capture="python")
    first = dec.blocks[0]

    def fault(block):
        if block == first:
            raise exc

    dec.capture.on_node = fault
    with pytest.raises(type(exc) if isinstance(exc, KeyboardInterrupt) else EpiKVError,
                       match=None if isinstance(exc, KeyboardInterrupt) else "capture callback failed.*boom"):
        dec.prefill([1, 2, 3, 4])
    dec.capture.on_node = None
    ref = LlamaDecoder(gm, "epikv", 72, max_tokens=80, threads=1, capture="python")
    dec2 = LlamaDecoder(gm, "epikv", 72, max_tokens=80, threads=1, capture="python")
    assert np.array_equal(dec2.prefill([5, 6, 7]), ref.prefill([5, 6, 7]))


# -- 6. a server that cannot capture is refused at start; a request's error is its own ------------------------------

SITE_NO_LOUT = """
import epikv.llamacpp.capture as c
_init = c.BlockCapture.__init__
def init(self, *a, **k):
    _init(self, *a, **k)
    self.struct.names[0].value = b"l_out-nowhere"  # as a builder that names no block output
c.BlockCapture.__init__ = init
"""


def test_a_graph_without_block_outputs_is_refused_at_server_start(gm, tmp_path, monkeypatch):
    """The probe decode at start: the backend refuses to be built, and `epikv serve` says why in one line, exit 2,
    before it listens (it used to start, then turn unhealthy for good on the first request)."""
    import epikv.llamacpp.capture as c
    from epikv.serving.llamacpp import LlamaBackend

    init = c.BlockCapture.__init__

    def broken(self, *a, **k):
        init(self, *a, **k)
        self.struct.names[0].value = b"l_out-nowhere"

    monkeypatch.setattr(c.BlockCapture, "__init__", broken)
    with pytest.raises(EpiKVError, match="does not name block outputs"):
        LlamaBackend(gm, "epikv", 64, ctx=256, sequences=2, threads=1)
    monkeypatch.undo()
    (tmp_path / "sitecustomize.py").write_text(SITE_NO_LOUT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src")]), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "epikv.cli", "serve", "--engine", "llama.cpp", "--policy", "epikv",
                        "--ctx", "256",
                        "--sequences", "2", "--budget", "64", "--threads", "1", "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "does not name block outputs" in p.stderr, p.stderr


def test_a_request_that_fails_in_the_engine_fails_alone(gm, request, caplog):
    """An exception while one request is sampled fails that request (its cells removed, counted by llama.cpp), the
    others finish, the server stays healthy, and the traceback is logged."""
    from epikv.serving.llamacpp import LlamaBackend
    from test_llamacpp_serving import _prompts

    be = LlamaBackend(gm, "epikv", 64, 8, ctx=512, sequences=3, max_batch_tokens=128, threads=1)
    request.addfinalizer(be.stop)
    sample = be._sample

    def bad(r, logits):
        if r.rid == "bad" and len(r.generated) == 5:
            raise ValueError("a broken sampler")
        return sample(r, logits)

    be._sample = bad
    with caplog.at_level(logging.ERROR, logger="epikv.serve"):
        for rid, ids in zip(("a", "bad", "b"), _prompts(gm, 3)):
            be.submit(rid, ids, 30, sampling=None, seed=0, ignore_eos=True)
        ended = {}
        while len(ended) < 3:
            o = be.next_output(60)
            assert o is not None
            if o.finished:
                ended[o.request_id] = o
    assert ended["bad"].error == "ValueError: a broken sampler" and len(ended["bad"].tokens) == 5
    assert ended["a"].error is None and len(ended["a"].tokens) == 30 and len(ended["b"].tokens) == 30
    assert be.healthy() and be.stats()["failed"] == 1 and be.stats()["finished"] == 2
    assert any(r.exc_info and "a broken sampler" in str(r.exc_info[1]) for r in caplog.records)
    _wait_idle(be)
    st = be.stats()  # llama.cpp's own count, taken when the engine went idle: the failed request's cells went too
    assert st["idle_checks"] >= 1 and st["cells_held_when_idle"] == 0


def _wait_idle(be, timeout=30):
    end = time.monotonic() + timeout
    while (be._running or be._waiting or be._in_use) and time.monotonic() < end:
        time.sleep(0.05)


# -- 7. a vocabulary without BOS or EOS -------------------------------------------------------------------------------

def test_negative_token_ids_never_reach_llama_cpp():
    """A vocabulary without BOS / EOS reports -1; rendering a chat template asked llama.cpp for the piece of -1,
    which aborts the process (rc 134). In a child process."""
    p = _py("""
from epikv.errors import EpiKVError
from epikv.llamacpp import load_gguf
gm = load_gguf("smollm2")
tok = gm.tokenizer
tok.bos_token_id = tok.eos_token_id = -1
print(repr(tok.piece(-1)))
text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
print("rendered", len(text) > 0)
try:
    tok.decode([5, -1])
except EpiKVError as e:
    print("refused:", e)
""")
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.splitlines() == ["''", "rendered True",
                                     "refused: token id -1 is outside this vocabulary of 49152 tokens"]


# -- 8. the lesser ones ---------------------------------------------------------------------------------------------------

def test_build_c_says_why_a_compile_failed_and_keys_by_compiler(tmp_path, monkeypatch):
    """A failing compiler: no library, and a warning carrying the compiler's own message (it used to be hidden); the
    cached library's name changes with the compiler; an unwritable cache folder falls back to a temporary one."""
    from epikv.llamacpp import capture

    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'badcc 1.0'; exit 0; fi\n"
                   "echo 'capture.c:1: error: no such thing' >&2; exit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(bad))
    with pytest.warns(UserWarning, match="capture.c:1: error: no such thing"):
        assert capture.build_c(force=True) is None
    cc = capture._compiler()
    monkeypatch.delenv("CC")
    good = capture._compiler()
    assert cc != good and capture._lib_path(cc).name != capture._lib_path(good).name
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(blocker / "sub"))  # mkdir under a file fails, even as root
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        so = capture.build_c()
    assert so is not None and so.exists() and not str(so).startswith(str(blocker))


def test_a_full_request_beyond_ctx_is_refused_at_submit(gm, request):
    """Called directly (not through the app), a `full` request longer than --ctx used to sit in the queue for ever,
    blocking every request behind it."""
    from epikv.serving.llamacpp import LlamaBackend

    be = LlamaBackend(gm, "full", None, ctx=256, sequences=2, threads=1)
    request.addfinalizer(be.stop)
    with pytest.raises(RuntimeError, match=r"exceeds the 256 cells of this server's llama.cpp cache \(--ctx\)"):
        be.submit("big", list(range(100, 200)), 200, sampling=None, seed=0, ignore_eos=True)
    be.submit("ok", list(range(100, 110)), 3, sampling=None, seed=0, ignore_eos=True)
    while not (o := be.next_output(60)).finished:
        pass
    assert o.request_id == "ok" and o.error is None and len(o.tokens) == 3


def test_over_limit_and_stop_strings_on_the_llama_cpp_server():
    """Over the cells, the 400 names --ctx (not the torch engine's --num-blocks x --page); a completion ended by a
    stop string is counted finished by the engine, not cancelled; /stats' llama.cpp-counted idle cells are 0."""
    from test_serving_http import Served

    s = Served(["--engine", "llama.cpp", "--ctx", "256", "--sequences", "2", "--policy", "full", "--threads", "1",
                "--max-tokens", "40"])
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            s.post_raw("/v1/completions", {"model": "smollm2", "prompt": "Hello", "max_tokens": 400})
        text = e.value.read().decode()
        assert e.value.code == 400 and "(--ctx)" in text and "--num-blocks" not in text, text
        parts = list(s.client.completions.create(model="smollm2", prompt="Count: 1, 2, 3,", max_tokens=40,
                                                 stop=[","], temperature=0, stream=True))
        assert parts[-1].choices[0].finish_reason == "stop"  # streamed: the app ends the request at the stop
        st = s.get("/stats")
        for _ in range(100):
            if st["engine"]["running"] == 0 and st["engine"]["finished"] + st["engine"]["cancelled"] >= 1:
                break
            time.sleep(0.1)
            st = s.get("/stats")
        assert st["engine"]["finished"] == 1 and st["engine"]["cancelled"] == 0, st["engine"]
        assert st["engine"]["steps"] < 40  # ended by the stop string, not by max_tokens
    finally:
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, "".join(s.err)


def test_a_cancelled_request_leaves_no_cell_in_llama_cpp(gm, request):
    """Cancelled mid-answer while another request runs: from the next step on, llama.cpp holds no cell of its
    sequence id (its own count, read by the engine thread), and none of either once idle."""
    from epikv.serving.llamacpp import LlamaBackend
    from test_llamacpp_serving import _prompts

    be = LlamaBackend(gm, "epikv", 64, 8, ctx=512, sequences=2, max_batch_tokens=128, threads=1)
    request.addfinalizer(be.stop)
    ids, after = {}, []  # request -> its sequence id; llama.cpp's cells of a's id in the steps after its cancel

    def on_step(b):
        running = {r.rid: r.seq.seq for r in b._running}
        ids.update(running)
        if "a" in ids and "a" not in running:
            after.append(b.llama_cells([ids["a"]]))

    be.on_step = on_step
    a, b = _prompts(gm, 2)
    be.submit("a", a, 200, sampling=None, seed=0, ignore_eos=True)
    be.submit("b", b, 40, sampling=None, seed=0, ignore_eos=True)
    got, ended = {}, set()
    while "b" not in ended:
        o = be.next_output(60)
        assert o is not None and o.error is None
        got[o.request_id] = len(o.tokens)
        if o.finished:
            ended.add(o.request_id)
        if o.request_id == "a" and len(o.tokens) == 5:
            be.cancel("a")
    _wait_idle(be)
    assert got["a"] < 200 and "a" not in ended and be.stats()["cancelled"] == 1
    assert after and all(n == 0 for n in after), after
    assert be.stats()["idle_checks"] >= 1 and be.stats()["cells_held_when_idle"] == 0


def test_full_on_streams_refuses_a_request_beyond_its_stream(gm, request):
    """`full` may ask for a stream per sequence (as llama-server's slots): a request must then fit its stream,
    --ctx / --sequences cells (rounded up to 256 by llama.cpp), not the whole cache."""
    from epikv.serving.llamacpp import LlamaBackend

    be = LlamaBackend(gm, "full", None, ctx=512, sequences=2, threads=1, kv="streams")
    request.addfinalizer(be.stop)
    assert be.streams and be.stream_cells == 256
    with pytest.raises(RuntimeError, match=r"exceeds the 256 cells of a sequence's stream"):
        be.submit("big", list(range(100, 200)), 200, sampling=None, seed=0, ignore_eos=True)  # 300 > 256 < 512
    be.submit("ok", list(range(100, 110)), 3, sampling=None, seed=0, ignore_eos=True)
    while not (o := be.next_output(60)).finished:
        pass
    assert o.request_id == "ok" and o.error is None and len(o.tokens) == 3
