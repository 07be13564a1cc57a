"""Issue 47: the per-head random null, TriAttention and Expected Attention.

Each score against a re-computation of its formula written here from the papers' definitions, on small random
tensors: RoPE as transformers applies it (apply_rotary_pos_emb on basis vectors), moments by torch.mean / torch.cov,
distances and future positions enumerated one by one."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from epikv.engine import Decoder
from epikv.errors import EpiKVError
from epikv.models import load_model
from epikv.policies import CacheView, StepObservation, get_policy


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("random:tiny")


# -- the per-head random null ------------------------------------------------------------------------------------------

def _keeps(tiny, name, seed, budget=8):
    ids = torch.tensor([tiny.tokenizer("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu")
                        ["input_ids"]])
    with torch.inference_mode():
        dec = Decoder(tiny.model, name, budget, recent=1, protect_prompt=False, n_sink=0, seed=seed)
        seen = []
        orig = dec.cache.evict
        dec.cache.evict = lambda: seen.append(orig()) or seen[-1]
        dec.prefill(ids, [0])
    assert len(seen) == 1
    return seen[0]


def test_random_head_draws_a_seeded_set_per_head_and_random_one_shared_set(tiny):
    per_head = _keeps(tiny, "random-head", 0)  # [batch, layers, kv_heads, K]
    assert per_head.dim() == 4 and per_head.shape[1:3] == (4, 2) and per_head.shape[-1] == 8
    sets = {tuple(per_head[0, l, h].tolist()) for l in range(4) for h in range(2)}
    assert len(sets) > 1  # the heads differ
    assert torch.equal(per_head, _keeps(tiny, "random-head", 0))  # seeded
    assert not torch.equal(per_head, _keeps(tiny, "random-head", 1))
    shared = _keeps(tiny, "random", 0)  # [batch, K]: one set, applied to every layer and head
    assert shared.dim() == 2 and shared.shape[-1] == 8
    assert torch.equal(shared, _keeps(tiny, "random", 0)) and not torch.equal(shared, _keeps(tiny, "random", 1))
    assert get_policy("random-head").granularity == "head" and get_policy("random").granularity == "token"


# -- oracles -----------------------------------------------------------------------------------------------------------

D, H, KV, N, W = 8, 4, 2, 12, 5
INV = 1.0 / (10.0 ** (torch.arange(0, D, 2).float() / D))  # base 10: every pair turns visibly


def _rope_matrix(p: float, scale: float) -> torch.Tensor:
    """R with R @ x = transformers' apply_rotary_pos_emb(x) at position p (cos / sin scaled as the model does)."""
    f = p * INV.double()
    emb = torch.cat([f, f])
    eye = torch.eye(D, dtype=torch.float64)[None, None]  # rows: basis vectors
    out, _ = apply_rotary_pos_emb(eye, eye, (emb.cos() * scale)[None], (emb.sin() * scale)[None])
    return out[0, 0].T  # column i = image of e_i


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, W, D, generator=g) + 1.5 * torch.randn(1, H, 1, D, generator=g)  # concentrated queries
    k = torch.randn(2, KV, N, D, generator=g)
    v = torch.randn(2, KV, N, D, generator=g)
    qv = torch.ones(2, W, dtype=torch.bool)
    qv[1, :2] = False  # row 1: its two oldest window slots are padding
    n_pad = torch.tensor([0, 3])
    nxt = torch.tensor([40, 301])  # absolute next positions, far from the stored length N
    return q, qv, k, v, n_pad, nxt


def _policy_scores(name, q, qv, k, v, n_pad, nxt, scale, **settings):
    pol = get_policy(name, **settings)
    state = pol.init_state(2, 2, torch.device("cpu"))
    pos = (nxt - 1)[:, None] - torch.arange(3).flip(0)[None]  # the last forward fed 3 tokens ending at next - 1
    pol.on_tokens(state, StepObservation(hidden={}, attentions={}, valid=torch.ones(2, 3, dtype=torch.bool),
                                         positions=pos, kv_heads=KV))
    # two layers: the second sees the keys reversed, so a layer mix-up shows
    view = CacheView(length=N, budget=6, token_data={}, n_pad=n_pad, n_protect=torch.zeros(2, dtype=torch.long),
                     recent=1, keys=[k, k.flip(2)], values=[v, v.flip(2)], device=torch.device("cpu"),
                     queries=[q, q], query_valid=qv, rope_inv_freq=INV, rope_scaling=scale)
    return pol.scores(state, view)  # [batch, layers, kv_heads, n]


def _ea_oracle(q, qv, k, v, n_pad, nxt, scale, n_future, eps):
    out = torch.zeros(2, KV, N, dtype=torch.float64)
    for b in range(2):
        rbar = sum(_rope_matrix(float(nxt[b]) + j, scale) for j in range(n_future)) / n_future
        for h in range(H):
            x = q[b, h][qv[b]].double()  # [real queries, D]
            mu, sig = x.mean(0), torch.cov(x.T)
            mu_f, sig_f = rbar @ mu, rbar @ sig @ rbar.T
            kk = k[b, h // (H // KV)].double()  # its KV head: heads 0, 1 -> 0; 2, 3 -> 1
            logit = torch.stack([kk[i] @ mu_f / math.sqrt(D) + kk[i] @ sig_f @ kk[i] / (2 * D) for i in range(N)])
            logit[: int(n_pad[b])] = -float("inf")
            out[b, h // (H // KV)] += logit.softmax(0) / (H // KV)
        out[b] = (out[b] + eps) * v[b].double().norm(dim=-1)
    return out


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_expected_attention_equals_its_formula(scale):
    q, qv, k, v, n_pad, nxt = _inputs()
    got = _policy_scores("expected-attention", q, qv, k, v, n_pad, nxt, scale, n_future=7, epsilon=0.01)
    want = _ea_oracle(q, qv, k, v, n_pad, nxt, scale, 7, 0.01)
    torch.testing.assert_close(got[:, 0].double(), want, atol=1e-5, rtol=1e-4)
    want1 = _ea_oracle(q, qv, k.flip(2), v.flip(2), n_pad, nxt, scale, 7, 0.01)
    torch.testing.assert_close(got[:, 1].double(), want1, atol=1e-5, rtol=1e-4)


def _tri_oracle(q, qv, k, nxt, scale, offsets):
    h2 = D // 2
    out = torch.zeros(2, KV, N, dtype=torch.float64)
    for b in range(2):
        for h in range(H):
            x = q[b, h][qv[b]].double()
            c = x.mean(0)
            kk = k[b, h // (H // KV)].double()
            trig = torch.zeros(N, dtype=torch.float64)
            for dist in offsets:  # the query dist tokens after the newest one (position next - 1)
                trig += (kk @ (_rope_matrix(float(nxt[b]) - 1 + dist, scale) @ c)) / len(offsets)
            norm = torch.zeros(N, dtype=torch.float64)
            for f in range(h2):
                e_abs = torch.sqrt(x[:, f] ** 2 + x[:, f + h2] ** 2).mean()
                c_abs = math.sqrt(c[f] ** 2 + c[f + h2] ** 2)
                norm += scale * (e_abs - c_abs) * torch.sqrt(kk[:, f] ** 2 + kk[:, f + h2] ** 2)
            out[b, h // (H // KV)] += (trig + norm) / math.sqrt(D) / (H // KV)
    return out


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_triattention_equals_its_formula(scale):
    q, qv, k, v, n_pad, nxt = _inputs(1)
    got = _policy_scores("triattention", q, qv, k, v, n_pad, nxt, scale, max_offset=64)
    offsets = [1, 2, 4, 8, 16, 32, 64]
    torch.testing.assert_close(got[:, 0].double(), _tri_oracle(q, qv, k, nxt, scale, offsets), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[:, 1].double(), _tri_oracle(q, qv, k.flip(2), nxt, scale, offsets),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["triattention", "expected-attention"])
def test_prompt_is_protected_and_keep_is_per_head(name):
    """The prompt (n_protect slots) stays whatever its scores; keep sets are per layer and KV head."""
    q, qv, k, v, n_pad, nxt = _inputs(2)
    pol = get_policy(name)
    assert pol.protect_prompt and pol.granularity == "head"
    state = pol.init_state(2, 2, torch.device("cpu"))
    state["next"] = nxt.clone()
    view = CacheView(length=N, budget=6, token_data={}, n_pad=torch.zeros(2, dtype=torch.long),
                     n_protect=torch.tensor([4, 4]), recent=1, keys=[k, k.flip(2)], values=[v, v.flip(2)],
                     device=torch.device("cpu"), queries=[q, q], query_valid=qv, rope_inv_freq=INV)
    keep = pol.keep(state, view)  # [batch, layers, kv_heads, 6]
    assert keep.shape == (2, 2, KV, 6)
    assert (keep[..., :4] == torch.arange(4)).all() and (keep[..., -1] == N - 1).all()


# -- the engine: pre-RoPE queries and the absolute position ------------------------------------------------------------

def test_engine_hands_pre_rope_queries_rope_frequencies_and_the_absolute_position(tiny):
    """The window the cache holds for these policies is q_proj(input_layernorm(h)) of the last tokens, unrotated,
    as a plain forward computes it (every layer without eviction, layer 0 also after evictions); the view carries
    the model's inverse frequencies; the next position counts every token seen, not the stored length."""
    model = tiny.model
    ids = torch.tensor([tiny.tokenizer("one two three four five six seven eight nine ten eleven twelve")
                        ["input_ids"]])
    n = ids.shape[1]

    def want(layer, h):
        a = layer.self_attn
        x = layer.input_layernorm(h[:, -4:])
        return a.q_proj(x).view(1, 4, -1, a.head_dim).transpose(1, 2)  # [1, heads, 4, dim]

    with torch.inference_mode():
        hs = model(ids, output_hidden_states=True, use_cache=False).hidden_states
        for budget in (64, 6):  # no eviction; evicting every step
            dec = Decoder(model, "expected-attention", budget, tau=1, window=4, recent=1, protect_prompt=False,
                          n_sink=0)
            dec.prefill(ids[:, :8], [0])
            for s in range(8, n):
                dec.step(ids[:, s : s + 1])
            view = dec.cache.view()
            layers = model.model.layers if budget == 64 else model.model.layers[:1]
            for l, layer in enumerate(layers):
                torch.testing.assert_close(view.queries[l], want(layer, hs[l]), atol=1e-5, rtol=1e-5)
            assert torch.equal(view.rope_inv_freq, model.model.rotary_emb.inv_freq)
            assert int(dec.cache.state["next"][0]) == n
    assert dec.cache.evictions > 0 and dec.cache.layers[0].keys.shape[2] == 6


# -- where one keep set serves every head: refused in one line ---------------------------------------------------------

@pytest.mark.parametrize("name", ["random-head", "triattention", "expected-attention"])
def test_llamacpp_and_paged_server_refuse_per_head_policies(name):
    from epikv.llamacpp.engine import check_policy
    from epikv.serving.checks import ServeSpec, build_policy

    with pytest.raises(EpiKVError, match=r"^policy .* not supported by --engine llama.cpp: it keeps a separate "
                                         r"token set per head; a llama.cpp cell holds a token of every layer"):
        check_policy(get_policy(name), 30)
    why = ("reads recomputed query states" if name != "random-head"
           else "keeps a different token set per head, which a paged engine cannot free page by page")
    with pytest.raises(EpiKVError, match=f"^policy {name} cannot serve with eviction: it {why}"):
        build_policy(ServeSpec(policy=name, budget=64, page=8, num_blocks=16))


def test_bad_settings_are_refused():
    for name, bad in (("expected-attention", {"window": 1}), ("expected-attention", {"n_future": 0}),
                      ("triattention", {"max_offset": 0}), ("triattention", {"window": 0})):
        with pytest.raises(EpiKVError, match=name):
            get_policy(name, **bad)
