"""Ctrl-C and the capture callbacks (issue 46; the C callback, issue 55 item 10): a real SIGINT sent while llama.cpp
decodes reaches the caller as one KeyboardInterrupt after the step, with the step whole (llama.cpp's cells, the
sequence's tokens and the mirror agree, and the next step runs); an exception kept by the Python callback is raised by
the first reader of the forward's rows, queries / keys / values included.

llama-cpp-python is required (the README's test command installs it); these tests fail, never skip, without it."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest

from epikv.errors import EpiKVError

TRIES = 16


@pytest.fixture(scope="module")
def gm():
    from epikv.llamacpp import available, load_gguf

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    return load_gguf("smollm2")


@pytest.mark.parametrize("capture", ["python", "c"])
@pytest.mark.parametrize("policy", ["epikv", "epikv-seg-q"])  # block outputs; rotated queries and keys
def test_a_real_sigint_during_decodes_is_raised_once_after_the_step(gm, policy, capture, monkeypatch):
    """A timer thread sends SIGINT (os.kill) at a random moment of a run of decode steps, TRIES times. Each time
    exactly one KeyboardInterrupt reaches the caller; when the signal arrived inside llama_decode, it is raised after
    that decode returned and the step was recorded (the sequence has every token it was fed, its mirror equals
    llama.cpp's cells); nothing escapes into ctypes (an unraisable exception) and the next steps run clean."""
    from epikv.llamacpp import LlamaDecoder, lib

    ll = lib.load().ll
    real = ll.llama_decode
    spans: list[tuple[float, float]] = []

    def timed(ctx, batch):
        t0 = time.monotonic()
        try:
            return real(ctx, batch)
        finally:
            spans.append((t0, time.monotonic()))

    monkeypatch.setattr(ll, "llama_decode", timed)
    # Python's own SIGINT handler, as a user's process has it (an earlier test in the session may have left another)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    escaped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: escaped.append(u.exc_type))
    dec = LlamaDecoder(gm, policy, 1024, max_tokens=1200, threads=1, capture=capture)
    assert dec.capture.method == capture
    logits = dec.prefill(list(range(300, 316)))
    rng = random.Random(0)
    inside = 0
    for _ in range(TRIES):
        sent: list[float] = []
        fed = dec.seen
        timer = threading.Timer(rng.uniform(0.0, 0.05), lambda: (sent.append(time.monotonic()),
                                                                  os.kill(os.getpid(), signal.SIGINT)))
        raised = 0
        steps_before = len(spans)
        timer.start()
        try:
            for _ in range(400):
                logits = dec.step(int(np.argmax(logits)))
                fed += 1
        except KeyboardInterrupt:
            raised += 1
            t_raised = time.monotonic()
        timer.join()
        time.sleep(0.01)  # a second delivery would come now
        assert raised == 1, f"{raised} KeyboardInterrupt for one SIGINT"
        assert not escaped, f"an exception escaped the capture callback: {escaped}"
        hit = [(a, b) for a, b in spans[steps_before:] if a <= sent[0] <= b]
        if hit:  # the signal arrived during a decode: raised after it, the step recorded whole
            inside += 1
            assert t_raised >= hit[0][1]
            assert dec.seen == fed + 1, "the interrupted step was not recorded"
        else:  # it arrived between Python statements (before a step, after one, or while its rows were read)
            assert dec.seen in (fed, fed + 1)
        assert dec.stored() == dec.cell_count()
        dec._check_mirror()
        fed = dec.seen + 1
        logits = dec.step(int(np.argmax(logits)))  # the next step runs clean
        assert dec.seen == fed
    assert inside >= TRIES // 2, f"only {inside} of {TRIES} signals arrived inside llama_decode"


@pytest.mark.parametrize("policy", ["epikv", "epikv-seg-q"])
def test_ctrl_c_during_a_c_callback_decode_leaves_the_step_whole(gm, policy, monkeypatch):
    """SIGINT sent as llama_decode returns, with the C capture callback (which runs no Python, so Python sees a signal
    that arrived during the decode only then), every fifth step of a run that evicts: one KeyboardInterrupt each
    time, after the step; the sequence counts the token, llama.cpp holds exactly its cells, the mirror equals them,
    and the next step succeeds (unheld, the step was lost: one cell more than tokens, then status -1)."""
    from epikv.llamacpp import LlamaDecoder, lib

    ll = lib.load().ll
    real, armed = ll.llama_decode, []

    def interrupted(ctx, batch):
        rc = real(ctx, batch)
        if armed:
            os.kill(os.getpid(), signal.SIGINT)
        return rc

    signal.signal(signal.SIGINT, signal.default_int_handler)
    dec = LlamaDecoder(gm, policy, 32, 8, max_tokens=120, threads=1, capture="c")
    assert dec.capture.method == "c"
    dec.prefill(list(range(300, 316)))
    monkeypatch.setattr(ll, "llama_decode", interrupted)
    interrupts = 0
    for i in range(60):
        fed = dec.seen
        armed[:] = [1] if i % 5 == 0 else []
        try:
            dec.step(400 + i)
            raised = False
        except KeyboardInterrupt:
            raised = True
        assert raised == bool(armed), f"step {i}: KeyboardInterrupt {raised}, signal sent {bool(armed)}"
        interrupts += raised
        assert dec.seen == fed + 1, f"step {i}: the interrupted step was not recorded"
        assert dec.stored() == dec.cell_count(), f"step {i}: {dec.stored()} tokens, {dec.cell_count()} cells"
        dec._check_mirror()
    assert interrupts == 12 and dec.evictions > 0


def test_the_stored_callback_error_is_raised_by_attn_rows(gm, monkeypatch):
    """A policy that reads no block outputs (Seg-Q reads rotated queries and keys only) reads a forward with
    attn_rows alone: an exception the Python callback kept (here raised while it checks a query node's op) is raised
    there, with its own message, not dropped or turned into a missing-node error."""
    from epikv.llamacpp import LlamaDecoder, capture

    class Bomb:
        @staticmethod
        def from_address(_):
            raise RuntimeError("boom")

    dec = LlamaDecoder(gm, "epikv-seg-q", 72, max_tokens=80, threads=1, capture="python")
    assert not dec.capture.blocks and dec.capture.attn_nodes
    monkeypatch.setattr(capture, "_TensorHead", Bomb)
    with pytest.raises(EpiKVError, match="capture callback failed.*RuntimeError: boom"):
        dec.prefill([1, 2, 3, 4])
    monkeypatch.undo()
    ref = LlamaDecoder(gm, "epikv-seg-q", 72, max_tokens=80, threads=1, capture="python")
    dec2 = LlamaDecoder(gm, "epikv-seg-q", 72, max_tokens=80, threads=1, capture="python")
    assert np.array_equal(dec2.prefill([5, 6, 7]), ref.prefill([5, 6, 7]))
