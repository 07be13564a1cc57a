"""The authors' later methods (METHOD.md section 4): EpiKV-Seg, EpiKV-Seg-Q, the value reserve, KV-key / KV-val,
Lag-KV-key. Constructed inputs for each rule, the tiny model for what needs one."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from epikv.cache import cache_kwarg
from epikv.engine import Decoder, attention_for
from epikv.errors import EpiKVError
from epikv.policies import CacheView, get_policy, select_keep
from epikv.policies.epikv_seg import seg_keep, segment_tiers, tier_pass
from epikv.policies.epikv_seg_q import query_relevance, zscore_over
from epikv.policies.kv_var import slot_statistic
from epikv.signals import lag_normalised_spread

NEW = ("epikv-seg", "epikv-seg-q", "kv-key", "kv-val", "lag-kv-key")


def _view(n, budget, recent, n_protect=0, n_pad=0, batch=1, **kw):
    pad = n_pad if isinstance(n_pad, torch.Tensor) else torch.full((batch,), n_pad)
    prot = n_protect if isinstance(n_protect, torch.Tensor) else torch.full((batch,), n_protect)
    return CacheView(length=n, budget=budget, token_data=kw.pop("token_data", {}), n_pad=pad, n_protect=prot,
                     recent=recent, keys=kw.pop("keys", []), values=kw.pop("values", []), device=torch.device("cpu"),
                     **kw)


# -- tiers -------------------------------------------------------------------------------------------------------------

def test_tiers_by_tertile_ties_up_lone_segment_r():
    R, E, T = 0, 1, 2
    # n = 6: t_low = s[2] = 3, t_high = s[4] = 5
    assert segment_tiers(torch.tensor([6.0, 1, 4, 2, 5, 3])).tolist() == [R, T, E, T, R, E]
    # n = 4: t_low = s[1] = 2 = t_high = s[2]: the tie goes up, to R
    assert segment_tiers(torch.tensor([1.0, 2, 2, 3])).tolist() == [T, R, R, R]
    assert segment_tiers(torch.tensor([7.0])).tolist() == [R]  # a lone segment
    assert segment_tiers(torch.tensor([1.0, 1, 1])).tolist() == [R, R, R]


# a cache of 30 slots: prompt 0..3, segments of 8 from slot 0 (the first holds prompt and decode slots), a partial
# last segment 24..26, recency window 27..29. Segment statistics 2, 4, 1, 3 -> tiers E, R, T, R.
PROMPT, SEG, RECENT, N = 4, 8, 3, 30
CAPS = (4, 2, 1)  # R, E, T


def _seg_inputs():
    stat = torch.zeros(1, N)
    for s, v in enumerate([2.0, 4.0, 1.0, 3.0]):
        stat[0, s * SEG : (s + 1) * SEG] = v
    stat[0, :PROMPT] = 2.0  # prompt slots enter their segment's mean
    g = torch.Generator().manual_seed(0)
    rank = torch.randperm(N, generator=g).float()[None]
    return rank, stat


def _top(rank, lo, hi, k):
    ids = torch.arange(lo, hi)
    return set(ids[rank[0, lo:hi].topk(k).indices].tolist())


def test_tier_caps_bind_and_cache_ends_below_budget():
    rank, stat = _seg_inputs()
    budget = PROMPT + RECENT + 20  # the tier pass could use 20 decode slots; the caps allow 2 + 4 + 1 + 3 = 10
    view = _view(N, budget, RECENT, n_protect=PROMPT)
    keep = seg_keep(rank, stat, view, SEG, CAPS)[0].tolist()
    expect = set(range(PROMPT)) | set(range(N - RECENT, N))
    expect |= _top(rank, 4, 8, 2) | _top(rank, 8, 16, 4) | _top(rank, 16, 24, 1) | _top(rank, 24, 27, 3)
    assert set(keep) == expect and keep == sorted(keep)
    assert len(keep) == PROMPT + RECENT + 10 < budget


def test_tier_budget_is_spent_oldest_first():
    rank, stat = _seg_inputs()
    budget = PROMPT + RECENT + 5  # E segment 0 takes 2, R segment 1 the remaining 3 of its 4, newer ones nothing
    view = _view(N, budget, RECENT, n_protect=PROMPT)
    keep = set(seg_keep(rank, stat, view, SEG, CAPS)[0].tolist())
    assert keep == set(range(PROMPT)) | _top(rank, 4, 8, 2) | _top(rank, 8, 16, 3) | set(range(N - RECENT, N))
    chosen = tier_pass(rank[0], stat[0], 0, PROMPT, N - RECENT, 5, SEG, CAPS)
    assert int(chosen.sum()) == 5 and not chosen[16:].any()


def test_fill_makes_the_cache_exactly_budget_with_best_ranked_rest():
    rank, stat = _seg_inputs()
    budget = PROMPT + RECENT + 14  # tier pass 10, fill 4
    view = _view(N, budget, RECENT, n_protect=PROMPT)
    keep = set(seg_keep(rank, stat, view, SEG, CAPS, fill=True)[0].tolist())
    assert len(keep) == budget
    tiers = set(seg_keep(rank, stat, view, SEG, CAPS)[0].tolist())
    rest = [i for i in range(PROMPT, N - RECENT) if i not in tiers]
    best = sorted(rest, key=lambda i: -rank[0, i].item())[:4]
    assert keep == tiers | set(best)


def test_value_swap_replaces_lowest_ranked_kept_by_highest_value_evicted():
    rank, stat = _seg_inputs()
    budget = PROMPT + RECENT + 20
    view = _view(N, budget, RECENT, n_protect=PROMPT)
    value = torch.rand(1, N, generator=torch.Generator().manual_seed(1))
    base = set(seg_keep(rank, stat, view, SEG, CAPS)[0].tolist())
    keep = set(seg_keep(rank, stat, view, SEG, CAPS, value=value, swap=2)[0].tolist())
    assert len(keep) == len(base)  # the count is unchanged
    kept_decode = [i for i in base if PROMPT <= i < N - RECENT]
    out = [i for i in range(PROMPT, N - RECENT) if i not in base]
    lose = sorted(kept_decode, key=lambda i: rank[0, i].item())[:2]
    gain = sorted(out, key=lambda i: -value[0, i].item())[:2]
    assert keep == (base - set(lose)) | set(gain)


def test_batch_rows_keep_equal_counts_topped_up_by_rank():
    rank, stat = _seg_inputs()
    stat2 = stat.clone()
    stat2[0, 16:24] = 5.0  # row 1: tiers T, R, R, E -> 1 + 4 + 4 + 2 = 11 decode slots against row 0's 10
    budget = PROMPT + RECENT + 20
    view = _view(N, budget, RECENT, n_protect=PROMPT, batch=2)
    ranks = torch.cat([rank, rank])
    keep = seg_keep(ranks, torch.cat([stat, stat2]), view, SEG, CAPS)
    alone = [set(seg_keep(rank, s, _view(N, budget, RECENT, n_protect=PROMPT), SEG, CAPS)[0].tolist())
             for s in (stat, stat2)]
    assert keep.shape == (2, len(alone[1])) and len(alone[0]) == len(alone[1]) - 1
    assert set(keep[1].tolist()) == alone[1]  # the longer row: exactly its set
    rest = [i for i in range(PROMPT, N - RECENT) if i not in alone[0]]
    assert set(keep[0].tolist()) == alone[0] | set(sorted(rest, key=lambda i: -rank[0, i].item())[:1])


def test_segment_statistic_is_unbiased_key_variance_over_heads_then_layers():
    torch.manual_seed(0)
    keys = [torch.randn(2, 3, 5, 4) * (l + 1) for l in range(2)]  # [batch, kv_heads, n, dim]
    got = slot_statistic(keys, "var", torch.device("cpu"))
    manual = sum(k.var(-1, unbiased=True).mean(1) for k in keys) / 2
    assert torch.allclose(got, manual)
    assert torch.allclose(slot_statistic(keys, "range", torch.device("cpu")),
                          sum((k.amax(-1) - k.amin(-1)).mean(1) for k in keys) / 2)
    assert torch.allclose(slot_statistic(keys, "norm", torch.device("cpu")), sum(k.norm(dim=-1).mean(1) for k in keys) / 2)


def test_nan_ranks_lowest_in_tier_pass_fill_swap_and_top_up():
    """A NaN rank (a slot the score could not rate) never wins a slot over a rated one, and is the first kept slot
    the swap gives up."""
    rank, stat = _seg_inputs()
    nan = [9, 12, 18, 19, 25]  # 9, 12: segment 1 (R, cap 4 of 8); 18, 19: rest of T; 25: the partial segment (all kept)
    rank[0, nan] = float("nan")
    rated = rank.clone()
    rated[0, nan] = -1.0 - torch.arange(len(nan)).float()  # below every rated slot (ranks are 0..29), distinct
    # the tier pass alone
    chosen = tier_pass(rank[0], stat[0], 0, PROMPT, N - RECENT, 20, SEG, CAPS)
    assert torch.equal(chosen, tier_pass(rated[0], stat[0], 0, PROMPT, N - RECENT, 20, SEG, CAPS))
    assert not chosen[[9, 12, 18, 19]].any() and bool(chosen[25])
    # fill: 4 more slots out of 10 rated candidates
    budget = PROMPT + RECENT + 14
    view = _view(N, budget, RECENT, n_protect=PROMPT)
    keep = set(seg_keep(rank, stat, view, SEG, CAPS, fill=True)[0].tolist())
    assert keep == set(seg_keep(rated, stat, view, SEG, CAPS, fill=True)[0].tolist())
    assert not keep & {9, 12, 18, 19}
    # swap: the NaN slot 25 (kept: its segment keeps all it has) is the lowest-ranked kept slot
    value = torch.rand(1, N, generator=torch.Generator().manual_seed(1))
    view = _view(N, PROMPT + RECENT + 20, RECENT, n_protect=PROMPT)
    base = set(seg_keep(rank, stat, view, SEG, CAPS)[0].tolist())
    swapped = set(seg_keep(rank, stat, view, SEG, CAPS, value=value, swap=1)[0].tolist())
    assert 25 in base and 25 not in swapped and len(swapped) == len(base)
    # top-up: row 0 (one short of row 1) takes its best rated slot, not a NaN one
    stat2 = stat.clone()
    stat2[0, 16:24] = 5.0
    view = _view(N, PROMPT + RECENT + 20, RECENT, n_protect=PROMPT, batch=2)
    both = seg_keep(torch.cat([rank, rank]), torch.cat([stat, stat2]), view, SEG, CAPS)
    alone = set(seg_keep(rank, stat, _view(N, PROMPT + RECENT + 20, RECENT, n_protect=PROMPT), SEG, CAPS)[0].tolist())
    extra = set(both[0].tolist()) - alone
    assert len(extra) == 1 and not extra & set(nan)
    rest = [i for i in range(PROMPT, N - RECENT) if i not in alone and i not in nan]
    assert extra == {max(rest, key=lambda i: rank[0, i].item())}


def test_seg_keep_reads_the_segment_statistic_from_the_keys():
    """EpiKVSeg: tiers come from the key variance, taken on arrival (kv_stats: the new tokens' keys, the last T slots
    of every layer), and the keep rule reads no cached key; values only feed the swap."""
    from epikv.policies import StepObservation

    g = torch.Generator().manual_seed(8)
    key_scale, value_scale = [2.0, 4.0, 1.0, 3.0], [4.0, 1.0, 3.0, 2.0]  # different tier orders

    def cached(scales):
        x = torch.randn(2, 1, 2, N, 8, generator=g)  # [layers, batch, kv_heads, n, dim]
        for s, v in enumerate(scales):
            x[..., s * SEG : (s + 1) * SEG, :] *= v
        return list(x)

    keys, values = cached(key_scale), cached(value_scale)
    rank, _ = _seg_inputs()
    pol = get_policy("epikv-seg", segment=SEG, caps=CAPS)
    assert pol.observes(2).kv_layers == ()  # no cached key read at eviction
    cpu = torch.device("cpu")
    kvar = []
    for a in range(0, N, 7):  # steps of several tokens: the newest slots of what is stored so far
        b = min(N, a + 7)
        obs = StepObservation(hidden={}, attentions={}, valid=torch.ones(1, b - a, dtype=torch.bool),
                              positions=torch.arange(a, b)[None], keys=[k[..., :b, :] for k in keys],
                              values=[v[..., :b, :] for v in values])
        kvar.append(pol.kv_stats(obs)["kvar"])
    kvar = torch.cat(kvar, -1)
    torch.testing.assert_close(kvar, slot_statistic(keys, "var", cpu))  # unbiased, over heads then layers
    view = _view(N, PROMPT + RECENT + 20, RECENT, n_protect=PROMPT, token_data={"score": rank, "kvar": kvar})
    got = pol.keep(None, view)
    by_keys = seg_keep(rank, slot_statistic(keys, "var", cpu), view, SEG, CAPS)
    by_values = seg_keep(rank, slot_statistic(values, "var", cpu), view, SEG, CAPS)
    assert torch.equal(got, by_keys) and not torch.equal(by_keys, by_values)


def test_shipped_defaults():
    seg = get_policy("epikv-seg")
    assert tuple(seg.caps) == (64, 32, 8) and seg.segment == 128 and seg.tau == 128 and seg.rule == "pruned"
    assert not seg.fill and seg.swap == 0
    q = get_policy("epikv-seg-q")
    assert q.fill is True and q.rule == "steps" and q.queries == 8 and q.mode == "replace"
    assert tuple(q.caps) == (64, 32, 8) and q.segment == 128
    for name in ("kv-key", "kv-val"):
        assert get_policy(name).window == 64
        assert get_policy(name, window=1).window == 1  # the smallest window is accepted
        with pytest.raises(EpiKVError, match="window must be at least 1"):
            get_policy(name, window=0)


# -- schedule ----------------------------------------------------------------------------------------------------------

def test_schedule_rules():
    pruned = get_policy("epikv-seg")  # tau 128
    K = 1000
    assert pruned.should_evict(1100, K, 50, 256)  # over K, decode slots a multiple of 128
    assert not pruned.should_evict(1100, K, 500, 255)
    assert not pruned.should_evict(K, K, 500, 256)  # not over K
    assert pruned.should_evict(K + 128, K, 1, 255)  # never beyond K + tau - 1
    steps = get_policy("epikv-seg-q")  # "steps", tau 128
    assert steps.should_evict(K + 1, K, 128, 301) and not steps.should_evict(K + 1, K, 127, 256)
    assert not steps.should_evict(K, K, 400, 256)
    every = get_policy("epikv-seg", rule="every", tau=4)
    assert every.should_evict(K + 4, K, 0, 1) and not every.should_evict(K + 3, K, 9, 256)
    with pytest.raises(EpiKVError, match="rule"):
        get_policy("epikv-seg", rule="sometimes")


def _decode(lm, policy, budget, n_new, seed=0, **settings):
    """Prefill a fixed prompt and feed n_new random tokens one at a time; returns the decoder and, per eviction,
    (stored length before, decode slots before, steps since the previous eviction)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (1, 6 + n_new), generator=g)
    dec = Decoder(lm.model, policy, budget, **settings)
    events = []
    orig = dec.cache.evict

    def spy():
        c = dec.cache
        n = c.layers[c._ref].length
        events.append((n, n - c._prefix, n - c._len_after_evict))
        return orig()

    dec.cache.evict = spy
    with torch.inference_mode():
        dec.prefill(ids[:, :6], [0])
        for i in range(6, ids.shape[1]):
            dec.step(ids[:, i : i + 1])
    return dec, events


def test_pruned_rule_evicts_at_multiples_of_tau_over_budget(tiny):
    dec, events = _decode(tiny, "epikv-seg", 40, 90, tau=16, segment=8, caps=(4, 2, 1))
    assert len(events) >= 2
    for n, decode, _ in events:
        assert n > 40 and decode % 16 == 0
    assert dec.cache.max_tokens <= 40 + 15


def test_steps_rule_evicts_after_tau_steps_over_budget(tiny):
    dec, events = _decode(tiny, "epikv-seg-q", 40, 90, tau=16, segment=8, caps=(4, 2, 1))
    assert len(events) >= 3 and events[0][2] >= 16  # the first: the decode steps so far
    for n, _, steps in events[1:]:
        # fill (on by default for Seg-Q): each eviction ends at exactly K, so the next one finds K + 16 after 16 steps
        # (without fill the caps leave the cache below K and the next eviction finds fewer slots)
        assert n == 40 + 16 and steps == 16
    assert dec.cache.layers[0].length <= 40 + 15


def test_seg_compacts_to_fewer_than_budget(tiny):
    """Caps bind: the cache really ends below K, every layer and the token data follow the keep set."""
    ids = torch.randint(0, 1000, (1, 60), generator=torch.Generator().manual_seed(3))
    dec = Decoder(tiny.model, "epikv-seg", 40, tau=1, segment=8, caps=(2, 1, 1))
    seen = []
    orig = dec.cache.evict

    def spy():
        before = [l.keys.clone() for l in dec.cache.layers]
        pos = dec.cache.token_data["pos"].clone()
        keep = orig()
        seen.append((before, pos, keep))
        return keep

    dec.cache.evict = spy
    with torch.inference_mode():
        dec.prefill(ids[:, :6], [0])
        for i in range(6, 60):
            dec.step(ids[:, i : i + 1])
    before, pos, keep = seen[-1]
    assert keep.shape[-1] < 40 and dec.cache.layers[1].length == keep.shape[-1]
    for l, layer in enumerate(dec.cache.layers):
        assert torch.equal(layer.keys[0], before[l][0][:, keep[0]])
    assert torch.equal(dec.cache.token_data["pos"], pos[:, keep[0]])
    assert dec.cache.token_data["score"].shape[-1] == keep.shape[-1]


# -- value reserve -----------------------------------------------------------------------------------------------------

def test_value_reserve_keeps_top_values_and_displaces_lowest_scored():
    n, prot, recent, n_res = 14, 2, 2, 3
    budget = prot + recent + 4  # 3 reserved + the best-scored other one
    g = torch.Generator().manual_seed(4)
    score = torch.randn(1, n, generator=g)
    score[0, :prot] = score[0, n - recent :] = -10.0  # protected slots rank lowest: the middle holds the top ranks
    values = [torch.randn(1, 2, n, 4, generator=g) for _ in range(3)]
    low = [prot + int(i) for i in score[0, prot : n - recent].argsort()[:n_res]]
    for v in values:  # the lowest-scored evictable slots get the largest value spread
        v[0, :, low] *= 10
    vstat = slot_statistic(values, "range", torch.device("cpu"))  # what on_tokens recorded on arrival
    view = _view(n, budget, recent, n_protect=prot, token_data={"score": score, "vstat": vstat})
    plain = set(select_keep(get_policy("epikv").scores(None, view), view)[0].tolist())
    pol = get_policy("epikv", reserve=n_res)
    obs = pol.observes(32)
    assert obs.arriving_kv and not obs.keys_values and not get_policy("epikv").observes(32).arriving_kv
    keep = select_keep(pol.scores(None, view), view)[0].tolist()
    assert len(keep) == budget  # still exactly K
    val = slot_statistic(values, "range", torch.device("cpu"))[0]
    mid = list(range(prot, n - recent))
    reserved = set(sorted(mid, key=lambda i: -val[i].item())[:n_res])
    others = [i for i in mid if i not in reserved]
    by_score = sorted(others, key=lambda i: -score[0, i].item())[: budget - prot - recent - n_res]
    assert set(keep) == set(range(prot)) | reserved | set(by_score) | set(range(n - recent, n))
    assert reserved == set(low) and not reserved & plain  # the reserve changed the keep set here
    with pytest.raises(EpiKVError, match="reserve_stat"):
        get_policy("epikv", reserve_stat="max")
    with pytest.raises(EpiKVError, match="swap"):
        get_policy("epikv-seg", reserve=4)


def _reserve_keep(score, vstat, budget, prot, recent, n_res):
    view = _view(score.shape[-1], budget, recent, n_protect=prot, token_data={"score": score, "vstat": vstat})
    pol = get_policy("epikv", reserve=n_res)
    return set(select_keep(pol.scores(None, view), view)[0].tolist())


def test_value_reserve_places_go_to_evictable_slots_only():
    """The prompt and the recency window are kept anyway: their values, however large, take no reserve place."""
    n, prot, recent, n_res = 14, 2, 2, 3
    mid = list(range(prot, n - recent))
    score = torch.zeros(1, n)
    score[0, mid] = torch.arange(len(mid)).float()  # slot 2 lowest, slot 11 highest
    vstat = torch.zeros(1, n)
    vstat[0, mid] = -torch.arange(len(mid)).float()  # the lowest-scored evictable slots hold the largest values
    vstat[0, :prot] = vstat[0, n - recent :] = 100.0  # larger still, but protected
    keep = _reserve_keep(score, vstat, prot + recent + 4, prot, recent, n_res)
    reserved = {2, 3, 4}  # the top 3 evictable by value
    assert keep == set(range(prot)) | set(range(n - recent, n)) | reserved | {11}


def test_value_reserve_larger_than_the_free_slots_keeps_the_highest_values():
    n, prot, recent, n_res = 14, 2, 2, 6
    mid = list(range(prot, n - recent))
    g = torch.Generator().manual_seed(13)
    vstat = torch.zeros(1, n)
    vstat[0, mid] = torch.randperm(len(mid), generator=g).float()
    score = torch.zeros(1, n)
    score[0, mid] = -vstat[0, mid]  # scores rank the reserved slots the other way round
    keep = _reserve_keep(score, vstat, prot + recent + 3, prot, recent, n_res)  # 3 free slots for 6 reserved
    top3 = set(sorted(mid, key=lambda i: -vstat[0, i].item())[:3])
    assert keep == set(range(prot)) | set(range(n - recent, n)) | top3


@pytest.mark.parametrize("stat", ["range", "var", "norm"])
def test_value_reserve_statistic_is_taken_on_arrival_and_follows_refilled_slots(tiny, stat):
    """The reserve reads each token's values when it is written and no cache at eviction, so the cache refills its
    holes (slots out of true order) as for plain epikv; the recorded statistic must stay that of the values each
    kept token holds, through refills and multi-token chunks."""
    from epikv.policies.kv_var import slot_statistic

    refilled = False

    def check(c):
        nonlocal refilled
        phys = c._phys if c._phys is not None else torch.arange(c.layers[0].length)[None]
        refilled |= c._phys is not None and not torch.equal(phys[0], phys[0].sort().values)
        values = [l.values[:, :, phys[0]] for l in c.layers]  # true order
        torch.testing.assert_close(c.token_data["vstat"], slot_statistic(values, stat, torch.device("cpu")))

    c = _decode_in_chunks(tiny, get_policy("epikv", reserve=3, reserve_stat=stat, tau=2, recent=4), 16, 70, 3, check)
    assert c.evictions > 10
    assert refilled, "the reserve never took the refill path"


@pytest.mark.parametrize("name, settings", [("epikv-seg", dict(tau=4, rule="steps", segment=8, swap=2)),
                                            ("epikv-seg-q", dict(tau=4, segment=8))])
def test_seg_statistics_taken_on_arrival_stay_aligned_with_the_cache(tiny, name, settings):
    """The torch engine on Seg / Seg-Q: after every step of a run with evictions and multi-token chunks, the
    recorded key variance (and, with the swap, value range) of every kept token is that of the key (value) it
    holds in the cache, in true order."""
    from epikv.policies.kv_var import slot_statistic

    pol = get_policy(name, recent=4, **settings)
    cpu = torch.device("cpu")

    def check(c):
        torch.testing.assert_close(c.token_data["kvar"], slot_statistic([l.keys for l in c.layers], "var", cpu))
        if pol.swap:
            torch.testing.assert_close(c.token_data["vstat"], slot_statistic([l.values for l in c.layers], "range", cpu))

    assert _decode_in_chunks(tiny, pol, 24, 90, 5, check).evictions >= 5


def _decode_in_chunks(tiny, pol, budget: int, n: int, seed: int, check):
    """The torch engine on n random tokens: a 6-token prompt, then chunks of 3, `check(cache)` after each chunk;
    returns the cache."""
    from epikv.engine import Decoder

    ids = torch.randint(10, 2000, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        dec = Decoder(tiny.model, pol, budget=budget)
        dec.prefill(ids[:, :6], [0])
        for s in range(6, n, 3):
            dec.step(ids[:, s : s + 3])
            check(dec.cache)
    return dec.cache


# -- Seg-Q -------------------------------------------------------------------------------------------------------------

def test_zscore_over_decode_slots_uses_sample_std():
    x = torch.tensor([[9.0, 1.0, 2.0, float("nan"), 3.0]])
    mask = torch.tensor([[False, True, True, True, True]])
    z = zscore_over(x, mask)
    assert torch.isnan(z[0, 0]) and torch.isnan(z[0, 3])
    assert torch.allclose(z[0, [1, 2, 4]], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5)  # std of 1, 2, 3 (n - 1) = 1


def test_seg_q_relevance_matches_independent_computation(tiny):
    """The ranking at the first eviction equals q.K recomputed here from a plain forward of the same tokens."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    model = tiny.model
    budget, tau, w = 24, 8, 8
    captured = {}
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(5))
    dec = Decoder(model, "epikv-seg-q", budget, tau=tau, segment=8)
    pol = dec.policy
    orig = pol.ranking

    def spy(state, view):
        r = orig(state, view)
        captured.setdefault("rank", (r.clone(), view.length, view.keys[0].shape[2]))
        return r

    object.__setattr__(pol, "ranking", spy)
    with torch.inference_mode():
        dec.prefill(ids[:, :6], [0])
        for i in range(6, ids.shape[1]):
            dec.step(ids[:, i : i + 1])
            if "rank" in captured:
                break
    rank, n, _ = captured["rank"]  # no eviction before: the cache is the full prefix of n tokens
    a = 1 + 1  # A = round(10 * 4 / 32) = 1, queries at block A + 1
    assert pol.query_layer(4) == a
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(ids[:, :n], output_hidden_states=True, use_cache=True, **{cache_kwarg(model): cache})
        h = out.hidden_states[a][:, -w:]  # block A's output = block A+1's input, last 8 tokens
        layer = model.model.layers[a]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(1, w, -1, attn.head_dim).transpose(1, 2)  # [1, heads, w, d]
        pos = torch.arange(n - w, n)[None]
        cos, sin = model.model.rotary_emb(x, pos)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k = cache.layers[a].keys if hasattr(cache, "layers") else cache.key_cache[a]
        k = repeat_kv(k, q.shape[1] // k.shape[1])
        logits = q @ k.transpose(-1, -2) / attn.head_dim**0.5  # [1, heads, w, n]
        causal = torch.arange(n)[None, :] > (n - w + torch.arange(w))[:, None]
        rel = logits.masked_fill(causal, float("-inf")).softmax(-1).mean(1).mean(1)[0]  # [n]
        dec_slots = rel[6:]
        z = (dec_slots - dec_slots.mean()) / (dec_slots.std(unbiased=True) + 1e-6)
    torch.testing.assert_close(rank[0, 6:], z, atol=1e-4, rtol=1e-4)
    assert torch.isnan(rank[0, :6]).all()  # the prompt is not ranked


def test_query_relevance_masks_future_slots_and_padding():
    q = torch.zeros(1, 2, 2, 4)  # uniform logits: softmax = 1 / (visible slots)
    k = torch.randn(1, 1, 5, 4)
    pos = torch.tensor([[0, 0, 1, 2, 3]])  # slot 0 is padding
    rel = query_relevance(q, k, torch.ones(1, 2, dtype=torch.bool), pos, torch.tensor([1]))
    # query 0 at position 2 sees slots 1..3 (1/3 each), query 1 at position 3 sees 1..4 (1/4 each)
    torch.testing.assert_close(rel[0], torch.tensor([0.0, 7 / 24, 7 / 24, 7 / 24, 1 / 8]))


def test_query_relevance_leaves_invalid_queries_out_of_the_mean():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 3, 4, generator=g)
    k = torch.randn(1, 1, 6, 4, generator=g)
    pos = torch.arange(6)[None]
    n_pad = torch.tensor([0])
    valid = torch.tensor([[False, True, True]])  # the oldest query is padding
    got = query_relevance(q, k, valid, pos, n_pad)
    # the same two valid queries, alone, at the same true positions (the newest last)
    alone = query_relevance(q[:, :, 1:], k, torch.ones(1, 2, dtype=torch.bool), pos, n_pad)
    torch.testing.assert_close(got, alone)
    everything = query_relevance(q, k, torch.ones(1, 3, dtype=torch.bool), pos, n_pad)
    assert not torch.allclose(got, everything)


def test_seg_q_add_mode_adds_the_weighted_relevance_z_score():
    g = torch.Generator().manual_seed(10)
    n, n_layers = 12, 4
    pol = get_policy("epikv-seg-q", mode="add", weight=0.5)
    qa = pol.query_layer(n_layers)
    keys = [torch.randn(1, 1, n, 4, generator=g) for _ in range(n_layers)]
    queries = [None] * n_layers
    queries[qa] = torch.randn(1, 2, 8, 4, generator=g)
    score = torch.randn(1, n, generator=g)
    pos = torch.arange(n)[None]
    view = _view(n, 8, 2, n_protect=3, keys=keys, values=keys, token_data={"score": score, "pos": pos},
                 queries=queries, query_valid=torch.ones(1, 8, dtype=torch.bool))
    got = pol.ranking(pol.init_state(1, n_layers, torch.device("cpu")), view)  # the state holds the query layer
    decode = torch.arange(n)[None] >= 3
    rel = query_relevance(queries[qa], keys[qa], view.query_valid, pos, view.n_pad)
    want = zscore_over(score, decode) + 0.5 * zscore_over(rel, decode)
    torch.testing.assert_close(got, want, equal_nan=True)
    rep = get_policy("epikv-seg-q")
    torch.testing.assert_close(rep.ranking(rep.init_state(1, n_layers, torch.device("cpu")), view),
                               zscore_over(rel, decode), equal_nan=True)  # replace: the relevance alone


def _rotated_queries(model, ids, a, w):
    """Block a's rotated queries of the last w tokens of ids, recomputed from a plain forward: [1, heads, w, dim]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n = ids.shape[1]
    out = model(ids, output_hidden_states=True)
    h = out.hidden_states[a][:, -w:]  # block a-1's output = block a's input
    layer = model.model.layers[a]
    x = layer.input_layernorm(h)
    q = layer.self_attn.q_proj(x).view(1, w, -1, layer.self_attn.head_dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(x, torch.arange(n - w, n)[None])
    return apply_rotary_pos_emb(q, q, cos, sin)[0]


def test_query_hook_rotates_a_long_forward_at_its_newest_positions(tiny):
    """A prefill (or chunk) longer than the query window keeps its newest w queries, rotated at their own positions."""
    model, w = tiny.model, 8
    ids = torch.randint(0, 1000, (1, 27), generator=torch.Generator().manual_seed(11))
    dec = Decoder(model, "epikv-seg-q", 1000)
    a = dec.policy.query_layer(len(model.model.layers))
    with torch.inference_mode():
        dec.prefill(ids[:, :20], [0])  # 20 tokens > w
        torch.testing.assert_close(dec.cache._queries[a], _rotated_queries(model, ids[:, :20], a, w),
                                   atol=1e-4, rtol=1e-4)
        dec.step(ids[:, 20:23])  # a chunk shorter than w: the window holds 5 old and 3 new queries
        dec.step(ids[:, 23:27])
        torch.testing.assert_close(dec.cache._queries[a], _rotated_queries(model, ids, a, w), atol=1e-4, rtol=1e-4)
        assert dec.cache._query_valid.shape == (1, w) and bool(dec.cache._query_valid.all())


def test_seg_q_padded_row_ranks_as_the_row_alone(tiny):
    """The query window's validity follows the newest w tokens: a left-padded row (padding longer than w) ranks its
    slots as it does decoded alone."""
    tok = tiny.tokenizer
    rows = [tok("one two three four five six seven eight nine ten eleven twelve thirteen")["input_ids"],
            tok("hi")["input_ids"]]
    cont = torch.randint(10, 2000, (1, 5), generator=torch.Generator().manual_seed(12))
    width = max(map(len, rows))
    pad = [width - len(r) for r in rows]
    assert pad[1] > 8  # every query of the prefill's first w is padding
    with torch.inference_mode():
        dec = Decoder(tiny.model, "epikv-seg-q", 1000)
        dec.prefill(torch.tensor([[0] * p + r for p, r in zip(pad, rows)]), pad)
        for t in range(5):
            dec.step(cont.expand(2, -1)[:, t : t + 1])
        both = dec.policy.ranking(dec.cache.state, dec.cache.view())
        for i, r in enumerate(rows):
            d = Decoder(tiny.model, "epikv-seg-q", 1000)
            d.prefill(torch.tensor([r]), [0])
            for t in range(5):
                d.step(cont[:, t : t + 1])
            alone = d.policy.ranking(d.cache.state, d.cache.view())[0]
            torch.testing.assert_close(both[i, pad[i]:], alone, atol=1e-4, rtol=1e-4, equal_nan=True)


def test_seg_q_is_not_attention_free_and_keeps_flash(tiny):
    from epikv.commands.policies import run

    import argparse
    import io
    import json
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert run(argparse.Namespace(json=True)) == 0
    rows = {r["name"]: r for r in json.loads(buf.getvalue())}
    for name in NEW:
        assert rows[name]["attention_free"] == (name != "epikv-seg-q"), name
    assert "query states at blocks 11" in rows["epikv-seg-q"]["observes_32_blocks"]
    assert "query states at blocks 10" in rows["epikv-seg-q"]["observes"]  # the embedded 30-block model
    model = tiny.model
    old = model.config._attn_implementation
    model.config._attn_implementation = "flash_attention_2"
    try:
        with attention_for(model, get_policy("epikv-seg-q")):
            assert model.config._attn_implementation == "flash_attention_2"
    finally:
        model.config._attn_implementation = old
    obs = get_policy("epikv-seg-q").observes(4)
    assert obs.query_layers == (2,) and not obs.attention_layers and not obs.hidden_layers
    assert get_policy("epikv-seg-q", mode="add").observes(4).hidden_layers == (1, 3)


# -- KV-key / KV-val / Lag-KV-key ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("window_over", [None, "decode", "all"])  # None: the shipped default ("decode")
@pytest.mark.parametrize("name", ["kv-key", "kv-val"])
def test_kv_variance_rolling_mean_at_arrival(tiny, name, window_over):
    """The score is the rolling mean of the arriving key (value) variance over the last `window` tokens; by default
    (the authors' code) the window holds decode tokens only and prompt tokens score 0."""
    from transformers import DynamicCache

    window = 4
    ids = torch.randint(0, 1000, (1, 14), generator=torch.Generator().manual_seed(6))
    over = {} if window_over is None else {"window_over": window_over}
    dec = Decoder(tiny.model, name, 1000, window=window, **over)
    with torch.inference_mode():
        dec.prefill(ids[:, :6], [0])  # a chunk, then single tokens: the same as token by token
        for i in range(6, 14):
            dec.step(ids[:, i : i + 1])
        cache = DynamicCache()
        tiny.model(ids, use_cache=True, **{cache_kwarg(tiny.model): cache})
    side = "keys" if name == "kv-key" else "values"
    per_layer = [getattr(l, side) for l in cache.layers]
    var = sum(x.float().var(-1, unbiased=True).mean(1) for x in per_layer)[0] / len(per_layer)  # [n]
    first = 0 if window_over == "all" else 6  # the first token a window may hold
    roll = torch.stack([var[max(first, t - window + 1) : t + 1].mean() if t >= first else var.new_zeros(())
                        for t in range(14)])
    torch.testing.assert_close(dec.cache.token_data["score"][0], roll, atol=1e-5, rtol=1e-5)


def test_lag_kv_key_scores_keys_only():
    torch.manual_seed(7)
    keys = [torch.randn(1, 2, 20, 4) for _ in range(2)]
    values = [torch.randn(1, 2, 20, 4) for _ in range(2)]
    view = _view(20, 10, 2, keys=keys, values=values)
    got = get_policy("lag-kv-key", lag=8).scores(None, view)
    torch.testing.assert_close(got, lag_normalised_spread((keys[0] + keys[1]) / 2, 8))
    both = get_policy("lag-kv", lag=8).scores(None, view)
    torch.testing.assert_close(both - got, lag_normalised_spread((values[0] + values[1]) / 2, 8))


@pytest.mark.parametrize("name, settings", [("epikv", {"reserve": 2}), ("epikv-seg", {"swap": 2, "fill": True}),
                                            ("epikv-seg-q", {"mode": "add", "swap": 1})])
def test_settings_run_on_a_padded_batch(tiny, name, settings):
    """The options run end to end on a left-padded batch at tau 1, within budget, rows of equal length."""
    from epikv.engine import generate

    r = generate(tiny.model, tiny.tokenizer, ["hi there", "one two three four five six seven"], policy=name,
                 budget=12, tau=1, max_new_tokens=20, **settings)
    assert all(len(t) == 20 for t in r.token_ids)
    assert r.stats["evictions"] >= 1 and r.stats["max_cache_tokens"] <= 12
