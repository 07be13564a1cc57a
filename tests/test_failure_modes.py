"""Failure-mode detectors: empty output, no final answer, token cap, degenerate repetition."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

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


def test_detect_all_on_a_real_generation():
    import torch

    from epikv.engine import generate
    from epikv.models import load_model

    torch.manual_seed(0)
    lm = load_model("random:tiny")
    r = generate(lm.model, lm.tokenizer, ["a b c", "one two three four"], policy="h2o", budget=8, max_new_tokens=40)
    fails = detect_all(r)
    assert len(fails) == 2
    for f, ids in zip(fails, r.token_ids):
        assert f.hit_cap and f.no_answer  # a random model never closes a \\boxed{} nor stops in 40 tokens
        assert f.repetition == is_degenerate(ids)
    rates = summarise(fails)
    assert rates["hit_cap"] == 1.0 and rates["empty"] == 0.0
