"""Baseline policies: the matrix over every registered policy, and each policy's defining rule on built inputs."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from epikv.cache import EpiKVCache
from epikv.engine import Decoder, Sampling, attention_for, generate
from epikv.errors import EpiKVError
from epikv.models import load_model
from epikv.policies import REGISTRY, CacheView, StepObservation, get_policy, select_keep
from epikv.policies.lagkv import partition_scores
from epikv.policies.rkv import redundancy

PROMPTS = {1: ["one two three four five six"], 2: ["hi there", "one two three four five six seven"]}
BUDGET, NEW = 10, 22


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("random:tiny")


_full_cache: dict = {}


def _run(lm, name, batch, tau, budget, sampling=None, **settings):
    return generate(lm.model, lm.tokenizer, PROMPTS[batch], policy=name, budget=budget, tau=tau,
                    max_new_tokens=NEW, sampling=sampling or Sampling(), **settings)


@pytest.mark.parametrize("tau", [1, 16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_matrix(tiny, tiny_settings, name, batch, tau):
    """Every policy x (batch 1, left-padded batch 2) x (tau 1, 16): runs, stays within budget + tau - 1, produces
    tokens. Determinism for a seed and equality with `full` under a large budget are checked on the padded batch
    at tau 1 (the strictest cell; tau does not matter without eviction), to keep the suite fast on 2 CPU cores."""
    pol = get_policy(name)
    st = tiny_settings(name)  # a learned score: random weights of the tiny shape
    if pol.renumbers_positions:  # context-shift: the llama.cpp engine's only (tests/test_llamacpp_quant.py)
        with pytest.raises(EpiKVError, match="true position"):
            _run(tiny, name, batch, tau, BUDGET, **st)
        return
    if pol.uncompressed_layers(4) and batch == 2:  # knorm: a padded batch is refused with a clear error
        with pytest.raises(EpiKVError, match="padded batch"):
            _run(tiny, name, batch, tau, BUDGET, **st)
        return
    samp = Sampling(temperature=1.0, seed=3)
    a = _run(tiny, name, batch, tau, BUDGET, samp, **st)
    assert all(len(t) == NEW for t in a.token_ids)  # random weights never emit EOS this early
    if pol.evicts:
        assert a.stats["max_cache_tokens"] <= BUDGET + tau - 1
        assert a.stats["final_cache_tokens"] <= BUDGET + tau - 1 and a.stats["evictions"] >= 1
    if (batch, tau) != (2, 1) and not (pol.uncompressed_layers(4) and batch == 1 and tau == 1):
        return
    b = _run(tiny, name, batch, tau, BUDGET, samp, **st)
    assert a.token_ids == b.token_ids  # deterministic for a seed
    # a budget above the final length never evicts: identical to the full cache (greedy)
    key = (batch, tau)
    if key not in _full_cache:
        _full_cache[key] = _run(tiny, "full", batch, tau, None).token_ids
    big = _run(tiny, name, batch, tau, 64, **st)
    assert big.stats.get("evictions", 0) == 0
    assert big.token_ids == _full_cache[key]


def test_policies_json_lists_attention_free(capsys):
    import json

    from epikv.cli import main

    assert main(["policies", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    needs = {"h2o", "h2o-global", "tova", "raas", "thinkv", "snapkv", "rkv"}  # snapkv, rkv: softmax(qK) recomputed
    for name in ("h2o", "h2o-global", "tova", "snapkv", "rkv", "raas", "thinkv", "lagkv", "keydiff", "knorm",
                 "streaming", "random", "epikv"):
        assert rows[name]["attention_free"] == (name not in needs), name
        assert rows[name]["paper"].startswith("arXiv:")


# -- constructed inputs ------------------------------------------------------------------------------------------------

def _view(n, budget, recent, n_protect=0, n_pad=0, batch=1, **kw):
    return CacheView(length=n, budget=budget, token_data=kw.pop("token_data", {}),
                     n_pad=torch.full((batch,), n_pad), n_protect=torch.full((batch,), n_protect), recent=recent,
                     keys=kw.pop("keys", []), values=kw.pop("values", []), device=torch.device("cpu"), **kw)


def _obs(attn_by_layer, kv_heads, stored=None, positions=None, n_protect=0):
    a = next(iter(attn_by_layer.values()))
    b, _, t, _ = a.shape
    pos = positions if positions is not None else torch.arange(t)[None].expand(b, -1)
    return StepObservation(hidden={}, attentions=attn_by_layer, valid=torch.ones(b, t, dtype=torch.bool),
                           positions=pos, stored=stored or {}, n_protect=torch.full((b,), n_protect),
                           kv_heads=kv_heads)


def test_h2o_keeps_heaviest_hitter_and_recent_half():
    pol = get_policy("h2o")
    n, budget = 12, 4
    # one layer, 2 query heads sharing 1 KV head; two steps of attention accumulate
    a1 = torch.zeros(1, 2, 1, n)
    a1[0, :, 0, 2] = 0.6  # token 2 gets attention twice
    a1[0, :, 0, 5] = 0.4
    acc = pol.on_tokens(None, _obs({0: a1}, 1))["acc"]
    a2 = torch.zeros(1, 2, 1, n)
    a2[0, :, 0, 2] = 0.3
    a2[0, :, 0, 5] = 0.5
    acc = pol.on_tokens(None, _obs({0: a2}, 1, stored={"acc": acc[..., : n - 0]}))["acc"]
    assert acc.shape == (1, 1, 1, n) and torch.allclose(acc[0, 0, 0, [2, 5]], torch.tensor([0.9, 0.9]))
    acc[0, 0, 0, 5] = 0.8
    view = _view(n, budget, pol.recent_window(budget), token_data={"acc": acc})
    keep = select_keep(pol.scores(None, view), view)
    assert pol.recent_window(budget) == 2
    assert keep[0, 0, 0].tolist() == [2, 5, 10, 11]  # 2 heavy hitters + the recent half


def test_h2o_is_per_head():
    pol = get_policy("h2o")
    a = torch.zeros(1, 4, 1, 8)  # 4 query heads, 2 KV heads
    a[0, :2, 0, 1] = 1.0  # KV head 0's group looks at token 1
    a[0, 2:, 0, 3] = 1.0  # KV head 1's group at token 3
    acc = pol.on_tokens(None, _obs({0: a}, 2))["acc"]
    view = _view(8, 3, 2, token_data={"acc": acc})
    keep = select_keep(pol.scores(None, view), view)
    assert keep[0, 0, 0].tolist() == [1, 6, 7] and keep[0, 0, 1].tolist() == [3, 6, 7]


def test_h2o_global_averages_layers_and_heads():
    pol = get_policy("h2o-global")
    n = 10
    a0, a1 = torch.zeros(1, 2, 1, n), torch.zeros(1, 2, 1, n)
    a0[0, 0, 0, 6] = 1.0  # strong in one head of one layer
    a1[0, :, 0, 5] = 0.6  # moderate everywhere: larger mean (0.3 vs 0.25)
    acc = pol.on_tokens(None, _obs({0: a0, 1: a1}, 1))["acc"]
    assert acc.shape == (1, n)
    view = _view(n, 6, 1, n_protect=4, token_data={"acc": acc})
    keep = select_keep(pol.scores(None, view), view)
    assert keep[0].tolist() == [0, 1, 2, 3, 5, 9]  # 4 sinks + top accumulated + recent


def test_streaming_keeps_sinks_and_newest():
    pol = get_policy("streaming")
    view = _view(12, 8, pol.recent_window(8), n_protect=4)
    keep = select_keep(pol.scores(None, view), view)
    assert keep[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


def test_tova_keeps_top_current_query_attention_per_layer():
    pol = get_policy("tova")
    st = pol.init_state(1, 2, torch.device("cpu"))
    n = 8
    a0 = torch.rand(1, 2, 3, n) * 0.01
    a0[0, :, -1, [1, 4, 6]] = torch.tensor([0.5, 0.3, 0.2])
    a0[0, :, 0, 0] = 5.0  # an older query of the chunk: ignored
    a1 = torch.rand(1, 2, 3, n) * 0.01
    a1[0, :, -1, [0, 2, 7]] = torch.tensor([0.5, 0.3, 0.2])
    pol.on_tokens(st, _obs({0: a0, 1: a1}, 1))
    view = _view(n, 3, pol.recent_window(3))
    keep = select_keep(pol.scores(st, view), view)
    assert keep[0, 0, 0].tolist() == [1, 4, 6] and keep[0, 1, 0].tolist() == [0, 2, 7]


def test_raas_evicts_stalest_and_never_the_prompt():
    pol = get_policy("raas")
    prompt = 3
    # prefill 3 prompt tokens, then decode tokens 3..7; at position 7 the newest query attends to 4 and 7
    attn = torch.zeros(1, 1, 3, 3)
    data = pol.on_tokens(None, _obs({0: attn}, 1, n_protect=prompt))
    data["pos"] = torch.arange(3)[None]
    for p in range(3, 8):
        a = torch.zeros(1, 1, 1, p + 1)
        a[0, 0, 0, p] = 0.1
        if p == 7:
            a[0, 0, 0, 3:8] = torch.tensor([0.01, 0.5, 0.02, 0.05, 0.4])  # median over decode tokens: 0.05
            a[0, 0, 0, 0] = 0.9  # the prompt's attention does not enter the median
        out = pol.on_tokens(None, _obs({0: a}, 1, stored=data, positions=torch.tensor([[p]]), n_protect=prompt))
        data = {"ts": out["ts"], "pos": torch.cat([data["pos"], torch.tensor([[p]])], -1)}
    ts = data["ts"][0].tolist()
    assert ts[4] == ts[6] == ts[7] == 7  # refreshed (>= median of decode tokens 3..7)
    assert ts[3] < 7 and ts[5] < 7  # below the median at the last step: stale
    view = _view(8, 6, 1, n_protect=prompt, token_data=data)
    keep = select_keep(pol.scores(None, view), view)
    assert keep[0].tolist() == [0, 1, 2, 4, 6, 7]  # stalest decode tokens 3 and 5 go; the prompt stays


def test_thinkv_keeps_64_32_8_by_entropy_tertile():
    pol = get_policy("thinkv")
    prot, seg, recent = 4, 128, 8
    n = prot + 3 * seg + recent
    ent = torch.full((1, n), 1e-3)
    # segment 0: one spike (low entropy, transition); 1: a few (execution); 2: flat (high entropy, reasoning)
    ent[0, prot + 5] = 1.0
    ent[0, prot + seg : prot + seg + 16] = 0.2
    ent[0, prot + 2 * seg : prot + 3 * seg] = 0.5
    st = {"ent": ent, "rank": torch.rand(1, n) * 0.5}
    budget = prot + recent + 64 + 32 + 8
    view = _view(n, budget, recent, n_protect=prot)
    keep = select_keep(pol.scores(st, view), view)[0]
    per_seg = [int(((keep >= prot + s * seg) & (keep < prot + (s + 1) * seg)).sum()) for s in range(3)]
    assert per_seg == [8, 32, 64]
    seg2 = torch.arange(prot + 2 * seg, prot + 3 * seg)
    top = seg2[st["rank"][0, seg2].topk(64).indices].sort().values  # inside a segment: by last-layer attention
    assert torch.equal(keep[(keep >= prot + 2 * seg) & (keep < prot + 3 * seg)], top)


def test_lagkv_normalises_against_next_partition_and_keeps_top_half():
    torch.manual_seed(0)
    lag, sink, layers, heads, dim = 8, 2, 1, 2, 4
    x = torch.randn(1, heads, 3 * lag, dim)
    s = partition_scores(x[0], lag)  # [heads, 2 * lag]
    ref = x[0, :, lag : 2 * lag]
    manual = ((x[0, :, :lag] - ref.amin(1, keepdim=True)) / (ref.amax(1, keepdim=True) - ref.amin(1, keepdim=True)
                                                                 + 1e-9)).std(-1).softmax(-1)
    assert torch.allclose(s[:, :lag], manual, atol=1e-6)
    pol = get_policy("lagkv", lag=lag, n_sink=sink)
    n = sink + 3 * lag + 3  # two scored partitions, then a full + partial tail
    k, v = torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim)
    budget = sink + lag + (3 * lag + 3 - 2 * lag)  # half of each scored partition + the whole tail
    view = _view(n, budget, 0, n_protect=sink, keys=[k], values=[v])
    keep = select_keep(pol.scores(None, view), view)[0, 0]  # [heads, budget]
    score = partition_scores(k[0, :, sink : sink + 3 * lag], lag) + partition_scores(v[0, :, sink : sink + 3 * lag], lag)
    for h in range(heads):
        kept = set(keep[h].tolist())
        assert set(range(sink)) <= kept and set(range(sink + 2 * lag, n)) <= kept  # sinks and tail
        for p in range(2):
            sp = score[h, p * lag : (p + 1) * lag]
            top = {sink + p * lag + int(i) for i in sp.topk(lag // 2).indices}
            assert top == {i for i in kept if sink + p * lag <= i < sink + (p + 1) * lag}


@pytest.mark.parametrize("budget", [256, 512])
def test_lagkv_scores_at_small_budgets(tiny, budget):
    """The paper's lag (1024) would never score at K <= 1024 (StreamingLLM under LagKV's name). The default
    L = min(1024, (K - 16) // 2) ranks by score at every eviction: the keep sets are not sinks + newest, differ
    per head, and each scored partition keeps its top half by `partition_scores`."""
    pol = get_policy("lagkv", tau=16)
    assert pol.partition_size(budget) == (budget - 16) // 2
    assert get_policy("lagkv").partition_size(4096) == 1024
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (1, budget + 120))
    seen = []
    with torch.inference_mode():
        dec = Decoder(tiny.model, pol, budget)
        orig = dec.cache.evict
        dec.cache.evict = lambda: seen.append((dec.cache.view().length, orig())) or seen[-1][1]
        dec.prefill(ids[:, :16], [0])
        for s in range(16, ids.shape[1], 16):
            dec.step(ids[:, s : s + 16])
    assert len(seen) >= 5
    for n, keep in seen:  # keep: [1, layers, kv_heads, budget]
        streaming = torch.cat([torch.arange(16), torch.arange(n - (budget - 16), n)])
        for l in range(keep.shape[1]):
            for h in range(keep.shape[2]):
                assert not torch.equal(keep[0, l, h], streaming), (n, l, h)
        assert not torch.equal(keep[0, :, 0], keep[0, :, 1])  # per head
    lag = (budget - 16) // 2
    n, keep = seen[-1]
    assert n == budget + 16 and set(range(16)) <= set(keep[0, 0, 0].tolist())
    # the oldest scored partition loses its 16 lowest-scored tokens (the cache is one chunk over budget)
    kept = set(keep[0, 0, 0].tolist())
    assert set(range(16 + lag, n)) <= kept and len(kept & set(range(16, 16 + lag))) == lag - 16


def test_lagkv_explicit_lag_that_never_scores_is_refused(tiny):
    from epikv.cache import EpiKVCache

    with pytest.raises(EpiKVError, match="lag 1024 never scores at budget 512"):
        EpiKVCache(tiny.model, "lagkv", 512, tau=16, lag=1024)
    EpiKVCache(tiny.model, "lagkv", 256, tau=16, lag=128)  # 2 * 128 <= 256 + 16 - 16: scores
    with pytest.raises(EpiKVError, match="never scores"):
        EpiKVCache(tiny.model, "lagkv", 256, tau=1, lag=128)
    with pytest.raises(EpiKVError, match="lag must be an integer"):
        get_policy("lagkv", lag=0)


def _rkv_keys(n_pad=0):
    """8 keys with hand-known cosines: 1, 3, 5 are copies (cos 1), 0 and 2 have cos 0.3 (below 0.5), the rest
    orthogonal. n_pad garbage slots in front (left padding)."""
    e = torch.eye(8)
    k = e.clone()
    k[1], k[3], k[5] = e[1], 2 * e[1], 3 * e[1]
    k[2] = 0.3 * e[0] + math.sqrt(1 - 0.09) * e[2]
    pad = torch.full((n_pad, 8), 7.0)
    return torch.cat([pad, k])[None, None]  # [1, 1, n_pad + 8, 8]


def test_rkv_redundancy_zeroes_newest_similar_entry_and_averages_columns():
    """cal_similarity's rule by hand. Row 1 zeroes S[1,5], row 3 S[3,5], row 5 S[5,3] (the largest similar column);
    rows 0, 2, 4, 6, 7 have no entry above 0.5 and zero their column-0 entry (S[2,0] = 0.3 goes). Column sums:
    col 1 = S[3,1] + S[5,1] = 2, col 3 = S[1,3] = 1, col 5 = 0, col 2 = S[0,2] = 0.3; mean over the 8 rows; softmax."""
    red = redundancy(_rkv_keys(), torch.ones(1, 8, dtype=torch.bool), 0.5)[0, 0]
    want = torch.softmax(torch.tensor([0.0, 2.0, 0.3, 1.0, 0.0, 0.0, 0.0, 0.0]) / 8, -1)
    torch.testing.assert_close(red, want)
    # left padding: the real slots score exactly as the unpadded row, padding gets nothing
    real = torch.tensor([[False] * 3 + [True] * 8])
    red_p = redundancy(_rkv_keys(3), real, 0.5)[0, 0]
    torch.testing.assert_close(red_p[3:], want)
    assert (red_p[:3] == 0).all()


def _redundancy_by_rows(k, real, threshold):
    """cal_similarity's rule one row at a time, on the real slots only (as the unpadded row)."""
    out = torch.zeros(k.shape[:3])
    for b in range(k.shape[0]):
        idx = real[b].nonzero().flatten()
        for h in range(k.shape[1]):
            kn = torch.nn.functional.normalize(k[b, h, idx].double(), dim=-1)
            s = kn @ kn.T
            s.fill_diagonal_(0.0)
            for i in range(len(idx)):
                over = (s[i] > threshold).nonzero().flatten()
                s[i, int(over.max()) if len(over) else 0] = 0.0  # the newest similar column, else the first
            out[b, h, idx] = torch.softmax(s.mean(0), -1).float()
    return out


@pytest.mark.parametrize("block", [1, 3, 128])
@pytest.mark.parametrize("threshold", [0.5, 0.0, -0.4, 0.95])
def test_rkv_redundancy_matches_the_rule_row_by_row(threshold, block):
    """Random keys with near-duplicates (many rows over the threshold), left padding of different lengths. The
    newest-first block search (block 1 and 3: many rounds, rows found in different ones; 128: one round) must find
    what a search of the whole row finds."""
    torch.manual_seed(7)
    n = 40
    k = torch.randn(3, 2, n, 8)
    k[:, :, 1::3] = k[:, :, 0::3][:, :, : k[:, :, 1::3].shape[2]] + 0.05 * torch.randn_like(k[:, :, 1::3])
    k[0, 1, 6] = 0.0  # a zero key: cosine 0 with everything, its own included
    real = torch.ones(3, n, dtype=torch.bool)
    real[1, :5] = False
    real[2, :17] = False
    got = redundancy(k, real, threshold, block=block)
    torch.testing.assert_close(got.masked_fill(~real[:, None, :], 0.0), _redundancy_by_rows(k, real, threshold))


def test_window_attention_pools_group_logits_by_max_before_softmax_and_skips_the_window():
    """2 query heads on 1 KV head, window w = 2, n = 6: keys c_j * e0 with c = [1, 2, 0, -1 | 5, 5] (the window's own
    keys are huge and must not take part). Head 0's queries are 2 e0 and -e0, head 1's -2 e0 and e0 (d = 4, so the
    logits are a * c / 2): max over the heads gives |c| for query 0 and |c| / 2 for query 1; softmax over the four
    keys before the window each; mean over the two queries."""
    from epikv.policies.snapkv import window_attention

    d, e0 = 4, torch.eye(4)[0]
    c = torch.tensor([1.0, 2.0, 0.0, -1.0, 5.0, 5.0])
    k = (c[:, None] * e0)[None, None]  # [1, 1, 6, 4]
    q = torch.stack([torch.stack([2 * e0, -e0]), torch.stack([-2 * e0, e0])])[None]  # [1, 2 heads, w = 2, 4]
    view = _view(6, 5, 2, keys=[k], values=[k], queries=[q], query_valid=torch.ones(1, 2, dtype=torch.bool))
    got = window_attention(view, kernel=1)[0, 0, 0]
    a = torch.tensor([1.0, 2.0, 0.0, 1.0])
    want = (torch.softmax(a, -1) + torch.softmax(a / 2, -1)) / 2
    torch.testing.assert_close(got[:4], want)
    assert (got[4:] == 0).all()
    # the "mean" option averages the logits (here they cancel: uniform), not the probabilities
    torch.testing.assert_close(window_attention(view, kernel=1, group="mean")[0, 0, 0, :4], torch.full((4,), 0.25))
    # position pooling (kernel 3, max): over the scored keys only, same padding
    pooled = window_attention(view, kernel=3)[0, 0, 0]
    torch.testing.assert_close(pooled[:4], torch.stack([want[:2].max(), want[:3].max(), want[1:4].max(), want[2:4].max()]))
    assert get_policy("snapkv").group == get_policy("rkv").group == "max"


def test_rkv_score_is_lambda_weighted_and_evicts_the_most_redundant():
    """score = lam * importance - (1 - lam) * redundancy with lam = 0.1 (paper and run scripts; code class default
    0.07). Zero queries give uniform importance 1/6 over the 6 keys before the window (w = 2)."""
    pol = get_policy("rkv", window=2)
    assert pol.lam == 0.1
    k = _rkv_keys()
    q = torch.zeros(1, 1, 2, 8)
    view = _view(8, 7, 2, keys=[k], values=[k], queries=[q], query_valid=torch.ones(1, 2, dtype=torch.bool))
    red = torch.softmax(torch.tensor([0.0, 2.0, 0.3, 1.0, 0.0, 0.0, 0.0, 0.0]) / 8, -1)
    score = pol.scores(None, view)[0, 0, 0]
    torch.testing.assert_close(score[:6], 0.1 / 6 - 0.9 * red[:6])
    keep = select_keep(pol.scores(None, view), view)[0, 0, 0].tolist()
    assert keep == [0, 2, 3, 4, 5, 6, 7]  # token 1, the oldest of three copies, goes
    pol3 = get_policy("rkv", window=2, lam=0.3)
    torch.testing.assert_close(pol3.scores(None, view)[0, 0, 0, :6], 0.3 / 6 - 0.7 * red[:6])


def test_snapkv_keeps_attended_tokens_with_pooling():
    torch.manual_seed(2)
    n, dim = 40, 8
    k = torch.randn(1, 1, n, dim) * 0.1
    k[0, 0, 5] = torch.ones(dim) * 3
    q = torch.ones(1, 2, 8, dim)  # 2 query heads on 1 KV head, all looking at token 5
    pol = get_policy("snapkv")
    view = _view(n, 8 + 7, 8, keys=[k], values=[k], queries=[q], query_valid=torch.ones(1, 8, dtype=torch.bool))
    keep = select_keep(pol.scores(None, view), view)[0, 0, 0].tolist()
    assert set(range(2, 9)) <= set(keep)  # token 5 and its max-pool neighbourhood (kernel 7)
    assert set(range(32, 40)) <= set(keep)  # the observation window


def test_keydiff_keeps_keys_least_similar_to_mean():
    k = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.9, -0.1], [0.0, 1.0], [-1.0, 0.2], [1.0, 0.05]])[None, None]
    pol = get_policy("keydiff")
    view = _view(6, 3, 1, keys=[k], values=[k])
    keep = select_keep(pol.scores(None, view), view)[0, 0, 0].tolist()
    assert keep == [3, 4, 5]  # the two outliers + the recent token


def test_knorm_keeps_lowest_norms():
    k = torch.tensor([5.0, 1.0, 4.0, 0.5, 3.0, 2.0, 9.0])[None, None, :, None] * torch.ones(1, 1, 7, 2)
    pol = get_policy("knorm")
    view = _view(7, 4, 1, keys=[k], values=[k])
    assert select_keep(pol.scores(None, view), view)[0, 0, 0].tolist() == [1, 3, 5, 6]


def test_knorm_leaves_layers_0_and_1_uncompressed(tiny):
    r = generate(tiny.model, tiny.tokenizer, PROMPTS[1], policy="knorm", budget=BUDGET, max_new_tokens=NEW)
    assert r.stats["max_cache_tokens"] == BUDGET
    with torch.inference_mode():
        dec = Decoder(tiny.model, "knorm", BUDGET)
        ids = torch.tensor([tiny.tokenizer(PROMPTS[1][0])["input_ids"]])
        logits = dec.prefill(ids, [0])
        for _ in range(NEW):
            logits = dec.step(logits.argmax(-1, keepdim=True))
        lens = [layer.length for layer in dec.cache.layers]
        assert lens[:2] == [ids.shape[1] + NEW] * 2 and lens[2:] == [BUDGET, BUDGET]
        # several tokens at once: the engine feeds them one at a time, one eviction at the end
        chunk = torch.randint(0, 100, (1, 5))
        logits = dec.step(chunk, all_logits=True)
        assert logits.shape[:2] == (1, 5) and torch.isfinite(logits).all()
        assert [layer.length for layer in dec.cache.layers] == [lens[0] + 5] * 2 + [BUDGET] * 2
        with pytest.raises(EpiKVError, match="one at a time"):  # a direct caller of the cache is told
            dec.cache.prepare(torch.ones(1, 3, dtype=torch.bool))
    ok = generate(tiny.model, tiny.tokenizer, PROMPTS[2], policy="knorm", budget=BUDGET, max_new_tokens=4,
                  skip_layers=())
    assert ok.stats["max_cache_tokens"] == BUDGET or ok.stats["evictions"] == 0


def test_split_feed_equals_one_multi_token_forward(tiny, monkeypatch):
    """The engine's token-by-token split (used once layers differ in length) with eviction held to the end gives
    the logits, evictions and cache of one multi-token forward (checked where both are possible)."""
    ids = torch.tensor([tiny.tokenizer(PROMPTS[1][0] + " and then some more words to stream")["input_ids"]])
    p, runs = 6, []
    for split in (False, True):
        if split:
            monkeypatch.setattr(EpiKVCache, "feeds_one_at_a_time", lambda self, n: n > 1)
        with torch.inference_mode():
            dec = Decoder(tiny.model, "keydiff", 8, tau=4, recent=1)
            out = [dec.prefill(ids[:, :p], [0], all_logits=True)[0]]
            out += [dec.step(ids[:, s : s + 4], all_logits=True)[0] for s in range(p, ids.shape[1], 4)]
            runs.append((torch.cat(out), dec.cache.evictions, dec.cache.max_tokens, dec.cache.layers[1].keys.clone()))
    (a, ev_a, mx_a, k_a), (b, ev_b, mx_b, k_b) = runs
    assert ev_a == ev_b > 0 and mx_a == mx_b
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_a, k_b, atol=1e-5, rtol=1e-5)


def test_per_head_eviction_keeps_the_right_keys_and_frees_memory(tiny):
    """Per-head keep sets differ per head, and each head's stored keys are exactly the full cache's at its keep."""
    ids = torch.tensor([tiny.tokenizer("alpha beta gamma delta epsilon zeta eta theta iota")["input_ids"]])
    with torch.inference_mode():
        dec = Decoder(tiny.model, "keydiff", 6, recent=1, protect_prompt=False)
        ref = Decoder(tiny.model, "full", None)
        seen = []
        orig = dec.cache.evict
        dec.cache.evict = lambda: seen.append(orig()) or seen[-1]
        dec.prefill(ids, [0])
        ref.prefill(ids, [0])
    keep = seen[0]  # [batch, layers, kv_heads, budget]
    assert keep.shape[-1] == 6 and not torch.equal(keep[0, :, 0], keep[0, :, 1])
    for l, (mine, full) in enumerate(zip(dec.cache.layers, ref.cache.layers)):
        assert mine.keys.shape[2] == 6
        for h in range(mine.keys.shape[1]):
            assert torch.equal(mine.keys[0, h], full.keys[0, h, keep[0, l, h]])


def test_recomputed_queries_match_eager_attention(tiny):
    """softmax(qK) from the recomputed rotated queries equals the eager attention weights of the newest token."""
    from epikv.policies.snapkv import window_attention

    model = tiny.model
    got = {}

    def grab(module, args, kwargs, out):
        got["w"] = out[1]

    ids = torch.tensor([tiny.tokenizer("the quick brown fox jumps over the lazy dog again")["input_ids"]])
    with torch.inference_mode(), attention_for(model, get_policy("h2o")):
        h = model.model.layers[1].self_attn.register_forward_hook(grab, with_kwargs=True)
        try:
            dec = Decoder(model, "snapkv", 1000, window=1, kernel=1)
            dec.prefill(ids, [0])
            dec.step(torch.tensor([[42]]))
        finally:
            h.remove()
        imp = window_attention(dec.cache.view(), kernel=1, group="mean")  # [1, layers, kv_heads, n]
    # log of the eager weights = logits - a per-head constant; group-mean logits over the keys before the newest
    # (the window of 1), renormalised by the softmax, cancel that constant
    logw = got["w"][0, :, -1, :-1].float().log()  # [heads, n - 1]
    want = logw.reshape(2, 2, -1).mean(1).softmax(-1)
    assert torch.allclose(imp[0, 1, :, :-1], want, atol=1e-5) and (imp[0, 1, :, -1] == 0).all()


def test_attention_policies_refuse_flash(tiny):
    model = tiny.model
    old = model.config._attn_implementation
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(EpiKVError, match="attention weights"):
            with attention_for(model, get_policy("h2o")):
                pass
        with attention_for(model, get_policy("rkv")):  # recomputes q.K: no eager needed
            assert model.config._attn_implementation == "flash_attention_2"
    finally:
        model.config._attn_implementation = old


def test_bad_settings_are_clear_errors():
    with pytest.raises(EpiKVError, match="recent"):
        get_policy("rkv", recent=4)
    with pytest.raises(EpiKVError, match="ratio"):
        get_policy("lagkv", ratio=1.5)
    with pytest.raises(EpiKVError, match="lam"):
        get_policy("rkv", lam=2.0)
