"""The decoding loop and the evicting cache on tiny random models: parity, oracle, bounds, positions, batching."""

import pytest
import torch
from transformers import DynamicCache

from epikv import EpiKVCache, EpiKVError, generate, get_policy, load_model
from epikv.cache import cache_kwarg
from epikv.engine import Decoder
from epikv.policies import REGISTRY

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Once upon a time"]
ALL = ["epikv", "epikv-raw", "epikv-a", "epikv-band", "lag-kv", "full", "streaming", "random"]  # baselines: test_baselines.py


def hf_greedy(lm, prompts, n):
    tok = lm.tokenizer
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = lm.model.generate(**enc, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id,
                            **{cache_kwarg(lm.model): DynamicCache()})
    return out[:, enc.input_ids.shape[1]:].tolist()


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("batch", [1, 2])
def test_large_budget_equals_plain_generate(tiny, policy, batch):
    prompts = PROMPTS[:batch]
    ref = hf_greedy(tiny, prompts, 24)
    res = generate(tiny.model, tiny.tokenizer, prompts, policy=policy, budget=4096, max_new_tokens=24,
                   eos_token_ids=[])
    assert res.token_ids == ref
    assert res.stats["evictions"] == 0


@pytest.mark.parametrize("arch", ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_other_architectures(arch):
    lm = load_model(f"random:{arch}")
    ref = hf_greedy(lm, PROMPTS, 12)
    assert generate(lm.model, lm.tokenizer, PROMPTS, policy="epikv", budget=4096, max_new_tokens=12,
                    eos_token_ids=[]).token_ids == ref
    res = generate(lm.model, lm.tokenizer, PROMPTS, policy="epikv", budget=16, tau=2, max_new_tokens=30,
                   eos_token_ids=[])
    assert res.stats["evictions"] > 0 and res.stats["max_cache_tokens"] <= 17


def _ids(lm, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 2000, (1, n), generator=g)


@pytest.mark.parametrize("policy", ["epikv", "lag-kv", "random", "streaming", "epikv-band"])
def test_eviction_oracle(tiny, policy):
    """After an eviction, next-token logits equal the full model's with a 4D mask hiding the evicted tokens,
    at true positions."""
    m = tiny.model
    ids = _ids(tiny, 61)
    budget = 24
    with torch.inference_mode():
        dec = Decoder(m, policy, budget=budget, tau=64, recent=4, protect_prompt=False, n_sink=2)
        dec.prefill(ids[:, :4], [0])
        dec.step(ids[:, 4:60])  # one chunk: 60 tokens > budget + tau - 1? no: the chunk ends at 60 <= 87
        assert dec.cache.evictions == 0
        dec.cache.evict()  # one eviction of tokens whose K/V were computed with full attention
        kept = dec.cache.token_data["pos"][0].tolist()
        assert len(kept) == budget and kept == sorted(kept)
        got = dec.step(ids[:, 60:61])[0]
        n = 61
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
        mask[n - 1] = False
        mask[n - 1, kept + [n - 1]] = True
        ref = m(ids, attention_mask=mask[None, None]).logits[0, -1]
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_wrong_positions_would_differ(tiny):
    """The oracle has teeth: the physical length as position (what a naive loop does) gives other logits."""
    m = tiny.model
    ids = _ids(tiny, 61)
    with torch.inference_mode():
        dec = Decoder(m, "streaming", budget=24, tau=64)
        dec.prefill(ids[:, :60], [0])
        dec.cache.evict()
        right = dec.step(ids[:, 60:61])[0]
        dec2 = Decoder(m, "streaming", budget=24, tau=64)
        dec2.prefill(ids[:, :60], [0])
        dec2.cache.evict()
        wrong = m(ids[:, 60:61], **{cache_kwarg(m): dec2.cache}, position_ids=torch.tensor([[24]])).logits[0, -1]
    assert (right - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("tau", [1, 5, 16])
@pytest.mark.parametrize("policy", ["epikv", "lag-kv", "streaming"])
def test_cache_bound(tiny, tau, policy):
    budget = 32
    lengths = []
    with torch.inference_mode():
        dec = Decoder(tiny.model, policy, budget=budget, tau=tau)
        ids = _ids(tiny, 120, seed=3)
        dec.prefill(ids[:, :8], [0])
        for t in range(8, 120):
            before = dec.cache.evictions
            dec.step(ids[:, t : t + 1])
            n = dec.cache.stored_length()
            lengths.append(n)
            assert n <= budget + tau - 1
            if dec.cache.evictions > before:
                assert n == budget
            for layer in dec.cache.layers:  # every layer the same, storage really bounded
                assert layer.length == n and layer.capacity <= 2 * (budget + tau)
        pos = dec.cache.token_data["pos"][0]
    assert max(lengths) == budget + tau - 1
    head = 4 if policy == "streaming" else 8  # streaming keeps 4 sinks, the others protect the 8-token prompt
    assert pos[-1].item() == 119 and pos[:head].tolist() == list(range(head))  # true positions


def test_chunked_scores_equal_token_by_token(tiny):
    ids = _ids(tiny, 90, seed=5)
    runs = []
    with torch.inference_mode():
        for chunk in (None, 7, 1):
            dec = Decoder(tiny.model, "epikv", budget=10_000, window=16)
            dec.prefill(ids[:, :40], [0], chunk=chunk)
            step = {None: 50, 7: 7, 1: 1}[chunk]
            for s in range(40, 90, step):
                dec.step(ids[:, s : s + step])
            runs.append(dec.cache.token_data["score"][0])
    assert runs[0].shape == (90,)
    assert torch.allclose(runs[0], runs[2], atol=1e-4) and torch.allclose(runs[1], runs[2], atol=1e-4)
    assert runs[2].abs().sum() > 0


def test_padded_batch_rows_match_single_runs(tiny):
    """Each sequence of a left-padded batch keeps its own tokens: the same greedy tokens as run alone.
    (With tau > 1 the rows of a batch share one eviction schedule, so only tau = 1 is step-for-step identical.)"""
    kw = dict(policy="epikv", budget=20, tau=1, max_new_tokens=40, eos_token_ids=[])
    both = generate(tiny.model, tiny.tokenizer, PROMPTS, **kw)
    for i, p in enumerate(PROMPTS):
        alone = generate(tiny.model, tiny.tokenizer, [p], **kw)
        assert both.token_ids[i] == alone.token_ids[0]
    assert both.stats["evictions"] > 0


def test_padded_batch_oracle_logits(tiny):
    """Batch logits after evictions equal each row decoded alone (tolerance 1e-4)."""
    tok = tiny.tokenizer
    rows = [tok(p)["input_ids"] for p in PROMPTS]
    cont = _ids(tiny, 40, seed=9)
    with torch.inference_mode():
        singles = []
        for r in rows:
            d = Decoder(tiny.model, "epikv", budget=18, tau=1)
            d.prefill(torch.tensor([r]), [0])
            singles.append(torch.stack([d.step(cont[:, t : t + 1])[0] for t in range(40)]))
        w = max(map(len, rows))
        pad = [w - len(r) for r in rows]
        ids = torch.tensor([[0] * p + r for p, r in zip(pad, rows)])
        d = Decoder(tiny.model, "epikv", budget=18, tau=1)
        d.prefill(ids, pad)
        both = torch.stack([d.step(cont.expand(2, -1)[:, t : t + 1]) for t in range(40)], dim=1)
    for i in range(2):
        assert torch.allclose(both[i], singles[i], atol=1e-4)


def test_padded_batch_with_interval(tiny):
    """tau > 1 in a padded batch: bounds hold, padding is dropped first, every row keeps real tokens only."""
    tok = tiny.tokenizer
    rows = [tok(p)["input_ids"] for p in PROMPTS]
    w = max(map(len, rows))
    pad = [w - len(r) for r in rows]
    with torch.inference_mode():
        d = Decoder(tiny.model, "lag-kv", budget=16, tau=5)
        d.prefill(torch.tensor([[0] * p + r for p, r in zip(pad, rows)]), pad)
        for t in range(30):
            d.step(torch.tensor([[100 + t], [200 + t]]))
            assert d.cache.stored_length() <= 20
    assert d.cache.n_pad.tolist() == [0, 0]
    pos = d.cache.token_data["pos"]
    for i, r in enumerate(rows):  # protected prompt, then own decode positions, strictly increasing
        assert pos[i, : len(r)].tolist() == list(range(len(r)))
        assert bool((pos[i, 1:] > pos[i, :-1]).all()) and pos[i, -1].item() == len(r) + 29


def test_same_call_twice_and_no_state_leak(tiny):
    kw = dict(policy="epikv", budget=16, tau=1, max_new_tokens=30, eos_token_ids=[])
    a = generate(tiny.model, tiny.tokenizer, PROMPTS[0], **kw)
    b = generate(tiny.model, tiny.tokenizer, PROMPTS[1], **kw)
    a2 = generate(tiny.model, tiny.tokenizer, PROMPTS[0], **kw)
    assert a.token_ids == a2.token_ids and a.token_ids != b.token_ids


def test_sampling_seeded(tiny):
    from epikv import Sampling

    kw = dict(policy="epikv", budget=16, max_new_tokens=20, eos_token_ids=[])
    s1 = generate(tiny.model, tiny.tokenizer, PROMPTS[0], sampling=Sampling(0.8, 0.9, 50, seed=1), **kw)
    s2 = generate(tiny.model, tiny.tokenizer, PROMPTS[0], sampling=Sampling(0.8, 0.9, 50, seed=1), **kw)
    s3 = generate(tiny.model, tiny.tokenizer, PROMPTS[0], sampling=Sampling(0.8, 0.9, 50, seed=2), **kw)
    assert s1.token_ids == s2.token_ids != s3.token_ids


def test_gumbel_draw_per_row_and_robust_to_rounding(tiny):
    """draw="gumbel" (what epikv serve uses): seeded per row (a row's tokens the same alone and in a batch), and a
    token drawn from logits moved by rounding-sized noise stays the same (the inverse CDF of a flat distribution
    does not)."""
    import torch

    from epikv import Sampling
    from epikv.engine import Sampler

    kw = dict(policy="full", budget=None, max_new_tokens=20, eos_token_ids=[])
    smp = Sampling(0.8, 0.95, seed=5, draw="gumbel")
    alone = generate(tiny.model, tiny.tokenizer, PROMPTS[1], sampling=smp, seeds=[9], **kw).token_ids[0]
    both = generate(tiny.model, tiny.tokenizer, [PROMPTS[0], PROMPTS[1]], sampling=smp, seeds=[4, 9], **kw)
    assert both.token_ids[1] == alone and both.token_ids[0] != alone
    greedy = generate(tiny.model, tiny.tokenizer, PROMPTS[1], **kw).token_ids[0]
    assert alone != greedy
    # flat distributions over 49,152 tokens (a random model's), their logits moved by 1e-4 (rounding in another
    # batch composition)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(128, 49152, generator=g) * 1e-3
    moved = logits + torch.randn(128, 49152, generator=g) * 1e-4
    ids = torch.zeros(128, 1, dtype=torch.long)
    flips = {}
    for draw in ("gumbel", "cdf"):
        cfg = Sampling(1.0, draw=draw)
        a = Sampler(cfg, range(128), ids, [0] * 128, 4, "cpu")(logits, 0)
        b = Sampler(cfg, range(128), ids, [0] * 128, 4, "cpu")(moved, 0)
        flips[draw] = int((a != b).sum())
    assert flips["gumbel"] == 0 and flips["cdf"] > 0, flips
    with pytest.raises(EpiKVError, match="draw must be"):
        Sampling(0.5, draw="multinomial")


def test_top_k_one_is_greedy(tiny):
    from epikv import Sampling

    kw = dict(policy="full", budget=None, max_new_tokens=15, eos_token_ids=[])
    g = generate(tiny.model, tiny.tokenizer, PROMPTS[0], **kw)
    s = generate(tiny.model, tiny.tokenizer, PROMPTS[0], sampling=Sampling(1.0, 1.0, 1, seed=3), **kw)
    assert g.token_ids == s.token_ids


def test_eos_and_stop_strings(tiny):
    tok = tiny.tokenizer
    base = generate(tiny.model, tok, PROMPTS[0], policy="full", budget=None, max_new_tokens=12, eos_token_ids=[])
    ids = base.token_ids[0]
    eos = ids[5]
    first = ids.index(eos)
    r = generate(tiny.model, tok, PROMPTS[0], policy="full", budget=None, max_new_tokens=12, eos_token_ids=[eos])
    assert r.token_ids[0] == ids[: first + 1] and r.finish_reasons == ["eos"]
    piece = tok.decode(ids[first + 1 : first + 3], skip_special_tokens=True)
    assert piece.strip()
    full = tok.decode(ids, skip_special_tokens=True)
    at = full.index(piece)
    streamed = []
    r = generate(tiny.model, tok, PROMPTS[0], policy="full", budget=None, max_new_tokens=12, eos_token_ids=[],
                 stop=[piece], on_step=lambda info: streamed.append(info.new_text))
    # the one stop rule (epikv.stops): text and ids end before the stop string; the stream never shows it
    assert r.finish_reasons == ["stop"] and r.texts[0] == full[:at]
    kept = r.token_ids[0]
    assert kept == ids[:len(kept)] and tok.decode(kept, skip_special_tokens=True) == full[:at]
    assert "".join(streamed) == r.texts[0] and r.stats["new_tokens"] == [len(kept)]


def test_epikv_family_is_attention_free(tiny, tiny_settings, monkeypatch):
    """EPIKV policies never request attention weights and never leave SDPA."""
    import transformers.models.llama.modeling_llama as ml

    def boom(*a, **k):
        raise AssertionError("eager attention was used")

    monkeypatch.setattr(ml, "eager_attention_forward", boom)
    m = tiny.model
    orig = m.forward

    def guarded(*a, **k):
        assert not k.get("output_attentions"), "output_attentions requested"
        assert m.config._attn_implementation == "sdpa"
        return orig(*a, **k)

    monkeypatch.setattr(m, "forward", guarded)
    for name, cls in REGISTRY.items():
        pol = cls()
        if pol.attention_free and not pol.renumbers_positions:  # context-shift: llama.cpp only
            assert not pol.observes(4).attention_layers
            prompts = PROMPTS if name in ALL else PROMPTS[:1]  # baselines have their own padded-batch tests
            generate(m, tiny.tokenizer, prompts, policy=name, budget=16, tau=2, max_new_tokens=24, eos_token_ids=[],
                     **tiny_settings(name))
    assert {"epikv", "epikv-raw", "epikv-a", "epikv-band", "lag-kv"} <= {n for n, c in REGISTRY.items()
                                                                          if c.attention_free}


def test_drop_in_cache_matches_engine(tiny):
    """EpiKVCache in model.generate evicts by the same rules and gives the engine's greedy tokens."""
    tok = tiny.tokenizer
    enc = tok(PROMPTS[0], return_tensors="pt")
    for policy, tau in [("epikv", 1), ("epikv", 4), ("lag-kv", 8), ("streaming", 1)]:
        cache = EpiKVCache(tiny.model, policy, budget=20, tau=tau)
        out = tiny.model.generate(**enc, max_new_tokens=40, do_sample=False, eos_token_id=None,
                                  pad_token_id=tok.pad_token_id, **{cache_kwarg(tiny.model): cache})
        res = generate(tiny.model, tok, PROMPTS[0], policy=policy, budget=20, tau=tau, max_new_tokens=40,
                       eos_token_ids=[])
        assert out[0, enc.input_ids.shape[1]:].tolist() == res.token_ids[0]
        assert cache.evictions > 0 and cache.stored_length() <= 20 + tau - 1


def test_drop_in_refuses_right_padding(tiny):
    """Left-padded batches work in model.generate (tests/test_dropin.py); right padding is refused."""
    tok = tiny.tokenizer
    tok.padding_side = "right"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    tok.padding_side = "left"
    with pytest.raises(EpiKVError, match="left padding only"):
        tiny.model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id,
                            **{cache_kwarg(tiny.model): EpiKVCache(tiny.model, "epikv", budget=64)})


def test_layer_override_changes_observation(tiny):
    assert get_policy("epikv").observes(32).hidden_layers == (10, 21)
    assert get_policy("epikv").observes(30).hidden_layers == (9, 20)
    assert get_policy("epikv", layers=(0, 3)).observes(4).hidden_layers == (0, 3)
    assert get_policy("epikv-band").observes(32).hidden_layers == tuple(range(7, 14)) + tuple(range(18, 26))
    a = generate(tiny.model, tiny.tokenizer, PROMPTS[0], policy="epikv", budget=16, max_new_tokens=30,
                 eos_token_ids=[], layers=(0, 3))
    b = generate(tiny.model, tiny.tokenizer, PROMPTS[0], policy="epikv", budget=16, max_new_tokens=30,
                 eos_token_ids=[], layers=(1, 2))
    assert a.stats["evictions"] > 0 and a.token_ids != b.token_ids


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=8), "smaller than what is protected"),
    (dict(layers=(0, 9)), "out of range"),
    (dict(budget=0), "positive integer"),
    (dict(tau=0), "tau"),
    (dict(policy="nope"), "unknown policy"),
    (dict(max_new_tokens=0), "max new tokens"),
    (dict(window=-1), "must not be negative"),
    (dict(foo=1), "no setting foo"),
])
def test_bad_settings(tiny, kwargs, match):
    kw = dict(policy="epikv", budget=64, max_new_tokens=4)
    kw.update(kwargs)
    with pytest.raises(EpiKVError, match=match):
        generate(tiny.model, tiny.tokenizer, PROMPTS[0], **kw)


def test_empty_prompt(tiny):
    with pytest.raises(EpiKVError, match="empty prompt"):
        generate(tiny.model, tiny.tokenizer, "   ")


def test_streamed_text_adds_up(smollm2):
    """The streaming callback's pieces, joined, are the final text; the status numbers are live."""
    pieces, caches = [], []

    def on_step(info):
        pieces.append(info.new_text)
        caches.append(info.cache_tokens)

    res = generate(smollm2.model, smollm2.tokenizer, "Write the numbers one to ten in words:", chat=True,
                   budget=56, tau=4, max_new_tokens=40, on_step=on_step)  # the default policy, evicting
    assert "".join(pieces).strip() == res.texts[0].strip()
    assert res.stats["evictions"] > 0 and max(caches) <= 56 + 4 - 1 and len(pieces) == len(res.token_ids[0])


def test_protected_part_and_recency_must_fit_the_budget_exactly():
    # one rule for the cache, the serving scheduler and the up-front checks: the protected prompt (or, with
    # protect_prompt off, its first n_sink tokens) + the recency window may fill the budget exactly, not one more
    pol = get_policy("epikv")
    assert pol.protected(30) == 30 and pol.protected_overflow(40, 10, 30) is None
    assert pol.protected_overflow(39, 10, 30) == ("budget 39 is smaller than what is protected: 30 prompt + 10 "
                                                  "recent tokens; raise the budget or shorten the prompt")
    sinks = get_policy("epikv", protect_prompt=False, n_sink=4)
    assert sinks.protected(30) == 4 and sinks.protected(3) == 3
    assert sinks.protected_overflow(14, 10, 30) is None and "4 sink tokens" in sinks.protected_overflow(13, 10, 30)
    assert pol.protected_overflow(None, 10, 30) is None  # no budget: nothing to fit
