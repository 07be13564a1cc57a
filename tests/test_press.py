"""epikv.press: a fresh evicting cache for every model.generate / text-generation pipeline call inside the block."""

import pytest
import torch

import epikv
from epikv import EpiKVCache, EpiKVError
from epikv.cache import cache_kwarg

PROMPT = "The quick brown fox jumps over the lazy dog and then"
GEN = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)


def _gen(lm, **kw):
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    out = lm.model.generate(**enc, pad_token_id=lm.tokenizer.pad_token_id, **GEN, **kw)
    return out[0, enc.input_ids.shape[1]:].tolist()


def _is_original(model) -> bool:
    return "generate" not in model.__dict__ and model.generate.__func__ is type(model).generate


def test_press_equals_explicit_cache_and_is_fresh_per_call(tiny):
    m = tiny.model
    plain = _gen(tiny)
    explicit_cache = EpiKVCache(m, "epikv", budget=16, tau=2)
    explicit = _gen(tiny, **{cache_kwarg(m): explicit_cache})
    with epikv.press(m, policy="epikv", budget=16, tau=2) as p:
        first = _gen(tiny)
        stats = p.last_stats
        second = _gen(tiny)  # a reused cache would continue from the first call's tokens
    assert first == explicit == second
    assert first != plain  # eviction bites at this budget
    assert p.calls == 2 and stats["evictions"] == explicit_cache.evictions > 0
    assert stats["max_cache_tokens"] <= 17
    assert _is_original(m)


def test_pipeline_inside_press_uses_the_cache(tiny):
    from transformers import pipeline

    m, tok = tiny.model, tiny.tokenizer
    pipe = pipeline("text-generation", model=m, tokenizer=tok)  # built before the block: it calls model.generate
    kw = dict(max_new_tokens=30, do_sample=False, return_full_text=False, pad_token_id=tok.pad_token_id)
    plain = pipe(PROMPT, **kw)[0]["generated_text"]
    with epikv.press(m, policy="streaming", budget=12) as p:
        pressed = pipe(PROMPT, **kw)[0]["generated_text"]
    assert p.calls == 1 and p.last_stats["evictions"] > 0 and p.last_stats["max_cache_tokens"] == 12
    assert pressed != plain
    assert pipe(PROMPT, **kw)[0]["generated_text"] == plain and _is_original(m)


def test_restored_on_exception_and_nested(tiny):
    m = tiny.model
    with pytest.raises(RuntimeError, match="boom"):
        with epikv.press(m, budget=16):
            assert not _is_original(m)
            raise RuntimeError("boom")
    assert _is_original(m)
    with epikv.press(m, policy="epikv", budget=16) as outer:
        with epikv.press(m, policy="streaming", budget=12) as inner:
            _gen(tiny)
        assert inner.calls == 1 and outer.calls == 0  # the inner press's cache reached generate, the outer left it
        _gen(tiny)
        assert outer.calls == 1
    assert _is_original(m)


def test_callers_own_cache_wins(tiny):
    m = tiny.model
    own = EpiKVCache(m, "streaming", budget=12)
    with epikv.press(m, budget=64) as p:
        _gen(tiny, **{cache_kwarg(m): own})
    assert p.calls == 0 and own.evictions > 0 and own.stats()["max_cache_tokens"] == 12


def test_bad_settings_refused_before_patching(tiny):
    m = tiny.model
    for kw, match in [(dict(budget=0), "positive integer"), (dict(policy="nope"), "unknown policy"),
                      (dict(budget=4), None)]:
        with pytest.raises(EpiKVError, match=match):
            with epikv.press(m, **kw):
                if kw.get("budget") == 4:  # a budget below what is protected fails at the first call
                    _gen(tiny)
        assert _is_original(m)


def test_attention_policy_gets_eager_per_call(tiny):
    m = tiny.model
    before = m.config._attn_implementation
    with epikv.press(m, policy="h2o", budget=16) as p:
        assert m.config._attn_implementation == before  # switched only around each call
        pressed = _gen(tiny)
    ref = epikv.generate(m, tiny.tokenizer, PROMPT, policy="h2o", budget=16, max_new_tokens=40, eos_token_ids=[])
    assert p.last_stats["evictions"] > 0 and pressed == ref.token_ids[0]
    assert m.config._attn_implementation == before
    with torch.inference_mode():
        assert _is_original(m)


def test_last_stats_describe_the_last_call(tiny):
    m, tok = tiny.model, tiny.tokenizer
    enc = tok(PROMPT, return_tensors="pt")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    short = EpiKVCache(m, "epikv", budget=16, tau=2)
    m.generate(**enc, max_new_tokens=8, **kw, **{cache_kwarg(m): short})
    with epikv.press(m, policy="epikv", budget=16, tau=2) as p:
        m.generate(**enc, max_new_tokens=40, **kw)
        first = p.last_stats
        m.generate(**enc, max_new_tokens=8, **kw)
    assert p.calls == 2 and p.last_stats == short.stats() and p.last_stats != first
    assert first["evictions"] > p.last_stats["evictions"]
