"""Failure-mode detectors: empty output, no final answer, token cap, degenerate repetition."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from epikv.failure import Failures, detect, detect_all, is_degenerate, last_boxed, repeated_tail, summarise


def test_last_boxed_handles_nesting_and_unclosed():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{3} and \boxed{4") == "3"  # the unclosed last one is not an answer
    assert last_boxed("no answer here") is None


def test_repeated_tail_finds_the_loop():
    assert repeated_tail([1, 2, 3] + [7, 8, 9] * 5) == (3, 15)
    assert repeated_tail([5] * 10) == (1, 10)
    assert repeated_tail([1, 2, 3, 4, 5]) == (0, 0)
    assert is_degenerate([1, 2] + [4, 5, 6, 7] * 10)
    assert not is_degenerate([4, 5, 6, 7] * 3)  # too short to be a collapse
    assert not is_degenerate(list(range(100)))


def test_detect_flags_each_mode():
    ok = detect(r"... so the answer is \boxed{42}.", [1, 2, 3], "eos")
    assert ok == Failures(empty=False, no_answer=False, hit_cap=False, repetition=False) and not ok.any
    empty = detect("  \n", [0], "eos")
    assert empty.empty and empty.no_answer and not empty.hit_cap
    loop = detect("the the the", [9, 10] * 40, "length")
    assert loop.hit_cap and loop.repetition and loop.no_answer
    # a loop that stopped by EOS did not run into the cap: not a degenerate collapse
    assert not detect("x", [9, 10] * 40, "eos").repetition
    cap = detect("long but varied", list(range(200)), "length")
    assert cap.hit_cap and not cap.repetition


@pytest.fixture(scope="module")
def tiny_lm():
    from epikv.models import load_model

    return load_model("random:tiny")


def _gen(lm, **kw):
    from epikv.engine import generate

    return generate(lm.model, lm.tokenizer, ["a b c", "one two three four"], policy="h2o", budget=8,
                    max_new_tokens=CAP, **kw)


CAP = 80


def _loops(ids, period_max=8, tail=32):
    """Independent check: the last `tail` tokens repeat with some period <= period_max."""
    return any(all(ids[-i] == ids[-i - p] for i in range(1, tail + 1)) for p in range(1, period_max + 1))


def test_detect_all_on_real_generations(tiny_lm):
    """Real generations whose failure modes are known from how they were made, not from the detectors.

    - a repetition penalty below 1 (0.001) makes greedy decoding re-pick what it has seen: a loop to the cap;
    - temperature 1 over a 49k vocabulary: varied tokens to the cap, no loop;
    - EOS set to the token greedy decoding picks first: it stops at once, by EOS (not the cap, no loop).
    No EOS in the first two (eos_token_ids=[]), and a random model never writes a complete \\boxed{}."""
    from epikv.engine import Sampling

    loop = _gen(tiny_lm, sampling=Sampling(repetition_penalty=0.001), eos_token_ids=[])
    varied = _gen(tiny_lm, sampling=Sampling(temperature=1.0, seed=1), eos_token_ids=[])
    first = _gen(tiny_lm, eos_token_ids=[])
    stop = _gen(tiny_lm, eos_token_ids=[first.token_ids[0][0], first.token_ids[1][0]])
    for r, looping in ((loop, True), (varied, False)):
        fails = detect_all(r)
        assert len(fails) == 2
        for f, ids, text in zip(fails, r.token_ids, r.texts):
            assert len(ids) == CAP and _loops(ids) == looping  # the premise, checked independently
            if not looping:
                assert len(set(ids[-32:])) > 16
            assert f.hit_cap and f.no_answer and not f.empty and f.repetition == looping, (f, ids[-8:])
        assert summarise(fails) == {"empty": 0.0, "no_answer": 1.0, "hit_cap": 1.0, "repetition": float(looping)}
    fails = detect_all(stop)
    assert [len(ids) for ids in stop.token_ids] == [1, 1] and stop.finish_reasons == ["eos", "eos"]
    for f, ids in zip(fails, stop.token_ids):
        blank = not tiny_lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
        assert f.empty == blank and f.no_answer and not f.hit_cap and not f.repetition
