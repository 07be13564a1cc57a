"""Scores that age (issue 57 item 1): epikv-learned-decay's priority against a plain loop recomputation (the arrival
score and, per token, the retention rate recomputed by hand from the hidden states the policy was shown, then the
arrival score multiplied by the rate once per step of age) over runs with evictions, in the torch engine and in
llama.cpp, whose keep sets must be the ones that priority gives; the constant-beta mode the same way; the per-token
rate's calibration (the slope fit on synthetic attention, the Ridge map re-expressed in the score's
standardisation, the graft onto a file fitted before it); and the two controls' rules (a window that is a fraction
of K, a fixed age penalty)."""

from __future__ import annotations

import math

import pytest
import torch

from epikv.engine import Decoder
from epikv.errors import EpiKVError
from epikv.policies import get_policy
from epikv.policies.learned import feature_block, load_weights

from conftest import write_random_weights


def arrival_score(lw, hidden: dict, n_layers: int) -> float:
    """epikv-learned-mean's score of one token by hand: per layer and KV head a dot product of the standardised
    hidden state entering the layer with the head's weights, plus its bias; their mean (float64)."""
    total, count = 0.0, 0
    for l in range(n_layers):
        x = (hidden[feature_block(l)].double() - lw.mean[l].double()) / lw.std[l].double()
        for g in range(lw.shape[1]):
            total += float(torch.dot(x, lw.weight[l, g].double())) + float(lw.bias[l, g])
            count += 1
    return total / count


def arrival_rate(lw, hidden: dict, n_layers: int) -> float:
    """epikv-learned-decay's per-token retention rate beta_i by hand: per layer and KV head the decay map's dot
    product with the standardised hidden state plus its bias, capped at 0 (log beta <= 0); exp of their mean."""
    total, count = 0.0, 0
    for l in range(n_layers):
        x = (hidden[feature_block(l)].double() - lw.mean[l].double()) / lw.std[l].double()
        for g in range(lw.shape[1]):
            total += min(0.0, float(torch.dot(x, lw.decay_weight[l, g].double())) + float(lw.decay_bias[l, g]))
            count += 1
    return math.exp(total / count)


def decayed(score: float, age: int, beta: float) -> float:
    """exp(score) * beta^age, one multiplication per step of age, back in the score's log scale."""
    r = math.exp(score)
    for _ in range(age):
        r *= beta
    return math.log(r)


def kept_by(priority: list[float], n_prompt: int, K: int, recent: int) -> list[int]:
    """The keep rule written out: the prompt, the newest `recent`, and the top priorities of the rest (ties to the
    newer token)."""
    n = len(priority)
    middle = sorted(range(n_prompt, n - recent), key=lambda j: (priority[j], j), reverse=True)
    return sorted(list(range(n_prompt)) + middle[: K - n_prompt - recent] + list(range(n - recent, n)))


def record(policy, arrivals: dict, calls: list) -> None:
    """Wrap a policy object: every token's hidden states by true position as it arrives, and every eviction's
    (positions, priority) the policy returned."""
    on_tokens, scores = policy.on_tokens, policy.scores

    def seen(state, obs):
        for j in range(obs.positions.shape[1]):
            arrivals[int(obs.positions[0, j])] = {b: h[0, j] for b, h in obs.hidden.items()}
        return on_tokens(state, obs)

    def scored(state, view):
        out = scores(state, view)
        calls.append((view.token_data["pos"][0].tolist(), out[0].tolist()))
        return out

    policy.on_tokens, policy.scores = seen, scored


def check_against_loop(lw, n_layers, arrivals, calls, keeps, beta, n_prompt, K, recent, tol):
    """Every eviction's priority equals the loop's (the recent window aside: llama.cpp scores it later, and no keep
    rule reads it), and the keep set applied is the one the loop's priority gives. beta: the constant rate, or None
    for each token's own (arrival_rate)."""
    assert len(calls) == len(keeps) > 3
    memo: dict[int, tuple[float, float]] = {}
    for (pos, got), kept in zip(calls, keeps):
        t = max(pos)
        for p in pos[:-recent]:
            if p not in memo:
                memo[p] = (arrival_score(lw, arrivals[p], n_layers),
                           beta if beta is not None else arrival_rate(lw, arrivals[p], n_layers))
        want = [decayed(memo[p][0], t - p, memo[p][1]) for p in pos[:-recent]] + [0.0] * recent
        assert max(abs(a - b) for a, b in zip(got[:-recent], want)) < tol, (t, got, want)
        assert kept == [pos[j] for j in kept_by(want, n_prompt, K, recent)]


@pytest.mark.parametrize("per_token", [True, False])
def test_decayed_score_equals_a_loop_recomputation_in_the_torch_engine(tiny, tmp_path, per_token):
    """Each token's own fitted rate (per_token, the default) or one constant beta. Mutants that fail it: the age off
    by one (t - i + 1), the decay applied twice (2 (t - i) log beta), a token's own rate replaced by another's
    (log_beta rolled by one token in scores; per_token only)."""
    path = write_random_weights(tmp_path / "w.safetensors", 4, 2, 64, seed=3)
    K, recent, beta = 24, 4, 0.8
    dec = Decoder(tiny.model, "epikv-learned-decay", K, tau=1, recent=recent, weights=path, beta=beta,
                  per_token=per_token)  # tau 1: an eviction every step, as the loop evicts
    arrivals, calls, keeps = {}, [], []
    record(dec.cache.policy, arrivals, calls)
    orig = dec.cache.evict
    dec.cache.evict = lambda: keeps.append(orig()) or keeps[-1]
    ids = torch.randint(3, 1000, (1, 60), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        dec.prefill(ids[:, :4], [0])
        for i in range(4, 60):
            dec.step(ids[:, i : i + 1])
    kept = [[calls[e][0][j] for j in k[0].tolist()] for e, k in enumerate(keeps)]
    lw = load_weights(path)
    check_against_loop(lw, 4, arrivals, calls, kept, None if per_token else beta, 4, K, recent, 1e-4)
    if per_token:  # the rates differ by token (else a rate swapped for another's would go unseen)
        rates = [arrival_rate(lw, h, 4) for h in arrivals.values()]
        assert max(rates) - min(rates) > 0.01 and max(rates) < 1


def test_dropin_cache_in_model_generate_keeps_what_the_loop_gives(tiny, tmp_path, monkeypatch):
    """EpiKVCache with the per-token decay inside transformers' model.generate: every eviction's priority and keep
    set are the loop's (each token's own rate, from the hidden states the policy was shown), each stored token
    carries its rate, and the tokens are epikv.generate's. Mutant: on_tokens storing the new tokens' rates in
    reverse order (log_beta flipped)."""
    from epikv import EpiKVCache, generate
    from epikv.cache import cache_kwarg

    from conftest import record_keeps

    path = write_random_weights(tmp_path / "w.safetensors", 4, 2, 64, seed=5)
    K, recent = 24, 4
    seen = record_keeps(monkeypatch, lambda keep, kw: keep[0].tolist())
    ids = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(8))
    c = EpiKVCache(tiny.model, "epikv-learned-decay", budget=K, tau=1, recent=recent, weights=path)
    arrivals, calls = {}, []
    record(c.policy, arrivals, calls)
    out = tiny.model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0,
                              **{cache_kwarg(tiny.model): c})
    assert c.token_data["log_beta"].shape == c.token_data["pos"].shape and float(c.token_data["log_beta"].max()) < 0
    [keeps] = seen.values()
    kept = [[calls[e][0][j] for j in k] for e, k in enumerate(keeps)]
    check_against_loop(load_weights(path), 4, arrivals, calls, kept, None, 12, K, recent, 1e-4)
    ref = generate(tiny.model, tiny.tokenizer, [ids[0].tolist()], policy="epikv-learned-decay", budget=K,
                   tau=1, recent=recent, max_new_tokens=40, weights=path)
    assert ref.token_ids[0] == out[0, 12:].tolist()


def test_decay_reorders_what_the_arrival_score_keeps(tiny, tmp_path):
    """Not a no-op: with a strong decay the keep sets differ from epikv-learned-mean's and hold newer tokens."""
    path = write_random_weights(tmp_path / "w.safetensors", 4, 2, 64, seed=3)
    ids = torch.randint(3, 1000, (1, 80), generator=torch.Generator().manual_seed(4))
    out = {}
    for name, kw in (("epikv-learned-mean", {}), ("epikv-learned-decay", {"beta": 0.5, "per_token": False})):
        dec = Decoder(tiny.model, name, 24, recent=4, weights=path, **kw)
        with torch.inference_mode():
            dec.prefill(ids[:, :4], [0])
            for i in range(4, 80):
                dec.step(ids[:, i : i + 1])
        out[name] = dec.cache.token_data["pos"][0].tolist()
    assert out["epikv-learned-decay"] != out["epikv-learned-mean"]
    assert sum(out["epikv-learned-decay"]) > sum(out["epikv-learned-mean"])


def test_controls_window_and_age_penalty(tiny, tmp_path):
    """epikv-learned-window protects floor(window * K) newest tokens (mutant: the default min(128, K/4));
    epikv-learned-age is the arrival score minus penalty x age (mutant: plus)."""
    from epikv.policies import CacheView

    assert get_policy("epikv-learned-window").recent_window(1024) == 512
    assert get_policy("epikv-learned-window", recent_frac=0.25).recent_window(100) == 25
    assert get_policy("epikv-learned-window", recent_frac=0.25, recent=7).recent_window(100) == 7
    for name, kw in (("epikv-learned-window", {"recent_frac": 1.5}), ("epikv-learned-window", {"recent_frac": 0.0}),
                     ("epikv-learned-decay", {"beta": 1.5}), ("epikv-learned-decay", {"beta": 0.0}),
                     ("epikv-learned-age", {"penalty": -1.0})):
        with pytest.raises(EpiKVError, match=f"{name}: "):
            get_policy(name, **kw)
    score = torch.tensor([[0.5, 0.2, -1.0, 3.0]])
    view = CacheView(length=4, budget=2, token_data={"score": score, "pos": torch.tensor([[0, 3, 7, 10]])},
                     n_pad=torch.zeros(1, dtype=torch.long), n_protect=torch.zeros(1, dtype=torch.long), recent=1,
                     keys=[], values=[], device=torch.device("cpu"))
    got = get_policy("epikv-learned-age", penalty=0.1).scores(None, view)
    assert torch.allclose(got, torch.tensor([[0.5 - 1.0, 0.2 - 0.7, -1.0 - 0.3, 3.0]]))
    got = get_policy("epikv-learned-decay", beta=0.5, per_token=False).scores(None, view)
    want = torch.tensor([[decayed(0.5, 10, 0.5), decayed(0.2, 7, 0.5), decayed(-1.0, 3, 0.5), 3.0]])
    assert torch.allclose(got, want, atol=1e-5)
    view.token_data["log_beta"] = torch.tensor([[-0.1, -0.5, 0.0, -0.2]])  # each token's own rate
    got = get_policy("epikv-learned-decay", beta=0.5).scores(None, view)
    want = torch.tensor([[decayed(0.5, 10, math.exp(-0.1)), decayed(0.2, 7, math.exp(-0.5)), -1.0, 3.0]])
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("per_token", [True, False])
def test_decayed_score_equals_a_loop_recomputation_in_llamacpp(per_token):
    """The same in llama.cpp on the embedded GGUF with the shipped SmolLM2 weights (their fitted decay map, or the
    constant beta): the hidden states it captured, scored by hand and decayed by the loop, give every keep set it
    applied (true positions, chunked scoring)."""
    from epikv.engine import encode_prompts
    from epikv.llamacpp import LlamaDecoder, available, load_gguf
    from epikv.policies.learned import shipped_weights
    import numpy as np

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    gm = load_gguf("smollm2")
    ids = encode_prompts(gm.tokenizer, ["Explain step by step why the sum of two odd numbers is even."], chat=True)[0]
    K, recent, beta = 64, 8, 0.95
    dec = LlamaDecoder(gm, "epikv-learned-decay", K, max_tokens=len(ids) + 100, threads=1, recent=recent, beta=beta,
                       per_token=per_token)
    arrivals, calls, keeps = {}, [], []
    record(dec.policy, arrivals, calls)
    dec.on_evict = lambda d, keep: keeps.append(d.positions[keep].tolist())
    logits = dec.prefill(ids)
    for _ in range(100):
        logits = dec.step(int(np.argmax(logits)))
    lw = load_weights(shipped_weights()[0])
    assert lw.shape[0] == 30 and lw.has_decay
    check_against_loop(lw, 30, arrivals, calls, keeps, None if per_token else beta, len(ids), K, recent, 1e-3)


@pytest.mark.parametrize("name, kw", [("epikv-learned-decay", {}),
                                      ("epikv-learned-decay", {"beta": 0.9, "per_token": False}),
                                      ("epikv-learned-window", {"recent_frac": 0.25}),
                                      ("epikv-learned-age", {"penalty": 0.1})])
def test_llamacpp_server_keeps_what_generate_keeps(name, kw, request, monkeypatch):
    """The ageing policies in the llama.cpp server (two requests, served one at a time as in test_llamacpp_serving:
    batched decodes differ in the last bits): every request's keep sets, by true position, are those llama.cpp's
    generate applies to it, and so are its tokens."""
    from epikv.engine import encode_prompts
    from epikv.llamacpp import generate, load_gguf
    from epikv.llamacpp.sequence import SequenceCache
    from epikv.serving.llamacpp import LlamaBackend

    gm = load_gguf("smollm2")
    seen: list = []
    orig = SequenceCache.remove

    def remove(self, keep):
        seen.append((self.seen, tuple(self.positions[keep].tolist())))
        return orig(self, keep)

    monkeypatch.setattr(SequenceCache, "remove", remove)
    prompts = [encode_prompts(gm.tokenizer, [f"Question {i}: what is {i} plus {2 * i + 1}? Think step by step."],
                              chat=True)[0] for i in range(2)]
    args = dict(policy=name, budget=80, tau=4, flash_attn=False, threads=1, **kw)
    be = LlamaBackend(gm, ctx=320, sequences=1, max_batch_tokens=64, kv="unified", **args)
    request.addfinalizer(be.stop)
    for k, ids in enumerate(prompts):
        be.submit(str(k), ids, 80, sampling=None, seed=k, ignore_eos=False)
    done = {}
    while len(done) < 2:
        o = be.next_output(60)
        assert o is not None and o.error is None
        if o.finished:
            done[o.request_id] = o.tokens
    served = sorted(seen)
    seen.clear()
    refs = [generate(gm, ids, max_new_tokens=80, **args) for ids in prompts]
    assert [done[str(k)] for k in range(2)] == [r.token_ids[0] for r in refs]
    assert served == sorted(seen) and len(served) > 6


def test_weights_of_another_model_of_the_same_shape_are_refused_in_one_line(tiny, tmp_path):
    """Issue 57 item 2: weights carry the fingerprint of the model they were fitted on (architecture, shapes and a
    checksum of some weights); a model of the same shape with other weights (a fine-tune) is refused in one line by
    the torch engine and the paged server, the model itself is accepted (in another dtype too). Mutant: comparing
    the shapes only (the signature part of the fingerprint) lets the fine-tune through."""
    import copy

    from epikv.fingerprint import model_fingerprint
    from epikv.policies.learned import LearnedWeights
    from epikv.serving import ServeSpec, check_serving

    fp = model_fingerprint(tiny.model, tiny.model.model.layers)
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "w.safetensors"
    LearnedWeights(torch.randn(4, 2, 64, generator=g), torch.zeros(4, 2), torch.zeros(4, 64), torch.ones(4, 64),
                   {"model": "tiny", "fingerprint": fp}, torch.zeros(4, 2, 64), torch.full((4, 2), -0.01)).save(path)
    Decoder(tiny.model, "epikv-learned-decay", 24, weights=str(path))  # its own model: accepted
    half = copy.deepcopy(tiny.model).to(torch.bfloat16)
    assert model_fingerprint(half, half.model.layers) == fp  # the dtype does not change it
    tuned = copy.deepcopy(tiny.model)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    other = model_fingerprint(tuned, tuned.model.layers)
    assert other.split("|")[0] == fp.split("|")[0] and other != fp  # same architecture and shapes, other weights
    for name in ("epikv-learned", "epikv-learned-mean", "epikv-learned-decay"):
        with pytest.raises(EpiKVError) as e:
            Decoder(tuned, name, 24, weights=str(path))
        msg = str(e.value)
        assert "\n" not in msg and "other weights" in msg and "epikv calibrate" in msg, msg
    spec = ServeSpec(policy="epikv-learned-age", budget=64, page=8, num_blocks=32, max_batch_tokens=32,
                     settings={"weights": str(path)})
    with pytest.raises(EpiKVError, match="other weights"):
        check_serving(tuned, spec)
    assert check_serving(tiny.model, spec).name == "epikv-learned-age"


def test_shipped_weights_refuse_a_same_shape_fine_tune_of_smollm2(smollm2):
    """The shipped SmolLM2 weights carry its fingerprint: SmolLM2 itself runs them, the same model with one sampled
    tensor nudged (as a fine-tune would) is refused in one line when no weights are named (the issue's case: a
    fine-tune of SmolLM2's shape silently got SmolLM2's weights)."""
    from epikv.policies.learned import load_weights, shipped_weights

    assert load_weights(shipped_weights()[0]).meta["fingerprint"].endswith("|ddd329c734b5459a")
    Decoder(smollm2.model, "epikv-learned-mean", 64)
    w = smollm2.model.model.layers[0].self_attn.q_proj.weight
    keep = w.detach().clone()
    try:
        with torch.no_grad():
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 1e-3)
        with pytest.raises(EpiKVError) as e:
            Decoder(smollm2.model, "epikv-learned-decay", 64)
        assert "\n" not in str(e.value) and "other weights" in str(e.value), str(e.value)
    finally:
        with torch.no_grad():
            w.copy_(keep)
    Decoder(smollm2.model, "epikv-learned-decay", 64)


def _synthetic_attention(c: torch.Tensor, a: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads, T, T] attention whose query j gives key i (j > i) exp(a_i - c_i (j - i)) / (j + 1): a known rate
    c_i per token and KV head (c [kv_heads, T]), under the 1 / (j + 1) share every key's attention falls by as the
    context grows."""
    kv, t = c.shape
    j, i = torch.arange(t)[:, None], torch.arange(t)[None, :]
    out = torch.zeros(heads, t, t)
    for q in range(heads):
        g = q // (heads // kv)
        out[q] = torch.where(j > i, torch.exp(a[g][None, :] - c[g][None, :] * (j - i)) / (j + 1), torch.zeros(()))
    return out


def test_slope_fit_recovers_known_rates_on_synthetic_attention():
    """decay_targets gives -c_i for attention at lag d = exp(a_i - c_i d) (relative to uniform), every token with
    MIN_LAGS later queries (those near the end over fewer than `horizon` lags), and lag_slopes equals a least-squares
    line fitted by hand over a token's valid lags. A rate that grows with age is capped at 0. Mutant: the slope's
    sign flipped in lag_slopes ((sd sy - n sdy) / den: every target then capped to 0)."""
    from epikv.calibrate import MIN_LAGS, decay_targets, lag_attention, lag_slopes

    g = torch.Generator().manual_seed(0)
    kv, t, horizon = 2, 90, 40
    c = 0.01 + 0.2 * torch.rand(kv, t, generator=g)
    a = torch.randn(kv, t, generator=g)
    c[1, 5] = -0.05  # attention that grows with lag
    log_beta, ok = decay_targets(_synthetic_attention(c, a, heads=4), kv, horizon)
    assert ok.tolist() == [t - 1 - i >= MIN_LAGS for i in range(t)]
    assert torch.allclose(log_beta[:, ok], -c[:, ok].clamp(min=0), atol=1e-5)
    assert float(log_beta[1, 5]) == 0.0
    # the line by hand on noisy data, near the end (fewer lags than the horizon)
    y = torch.randn(kv, t, horizon, generator=g)
    _, valid = lag_attention(torch.zeros(4, t, t), kv, horizon)
    got = lag_slopes(y, valid)
    for i in (0, 60, t - 3):
        d = [k + 1 for k in range(horizon) if valid[i, k]]
        for gi in range(kv):
            ys = [float(y[gi, i, k - 1]) for k in d]
            md, my = sum(d) / len(d), sum(ys) / len(ys)
            want = sum((x - md) * (v - my) for x, v in zip(d, ys)) / sum((x - md) ** 2 for x in d)
            assert abs(float(got[gi, i]) - want) < 1e-9, (gi, i)
    assert got[:, t - 1].abs().max() == 0  # no later query: no slope


def test_decay_map_is_re_expressed_in_the_scores_standardisation(tiny):
    """A decay target linear in the features (w*, b* known), summed over other rows than the score's (fewer tokens:
    other means and stds): fit_decay's map, applied to the score's standardised features as the policy does, gives
    the target back. Mutant: the weight left in its own standardisation (not rescaled by std / sd_d)."""
    from epikv.calibrate import DECAY, RidgeSums, fit_decay

    g = torch.Generator().manual_seed(1)
    L, kv, d = 4, 2, 64
    w_true, b_true = torch.randn(L, kv, d, generator=g) * 0.01, -0.05 * torch.rand(L, kv, generator=g)
    score, decay = RidgeSums(L, d, kv, targets=("lin",)), RidgeSums(L, d, kv, targets=(DECAY,))
    feats = []
    for n in range(6):
        ids = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(n))
        for l, (x, _, _, _) in enumerate(layer_run_tiny(tiny, ids)):
            score.add(l, x, {"lin": x[:, :kv].float()})
            decay.add(l, x[:15], {DECAY: x[:15].float() @ w_true[l].T + b_true[l]})
            feats.append((l, x.float()))
    _, _, mu, sd, _ = score.solve("lin", 1e-3)
    dw, db, meta, report = fit_decay(decay, mu, sd, 1e-9, 64)
    assert report["decay_tokens"] == 6 * 15 and meta["decay_horizon"] == 64
    for l, x in feats[-L:]:
        got = ((x - mu[l]) / sd[l]) @ dw[l].T + db[l]
        want = x @ w_true[l].T + b_true[l]
        assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()) + 1e-5), l


def layer_run_tiny(tiny, ids):
    from epikv.calibrate import layer_run

    return layer_run(tiny.model, ids)


def test_weights_without_a_decay_map_load_and_are_refused_per_token_in_one_line(tiny, tmp_path, capsys):
    """A file written before the decay map still loads (epikv-learned-mean runs it, and epikv-learned-decay with
    per_token=false); the per-token mode refuses it in one line (torch engine, paged server, the CLI with exit 2)
    rather than running the constant rule under its name. Mutant: _need_decay's condition False (a TypeError from
    the missing map)."""
    from epikv.policies.learned import LearnedWeights
    from epikv.serving import ServeSpec, check_serving
    from test_cli import run_bad, run_cli

    g = torch.Generator().manual_seed(3)
    old = tmp_path / "old.safetensors"
    LearnedWeights(torch.randn(4, 2, 64, generator=g), torch.zeros(4, 2), torch.zeros(4, 64), torch.ones(4, 64),
                   {"model": "tiny"}).save(old)
    from safetensors import safe_open

    with safe_open(str(old), framework="pt") as f:
        assert set(f.keys()) == {"weight", "bias", "mean", "std"}
    assert not load_weights(old).has_decay
    Decoder(tiny.model, "epikv-learned-mean", 24, weights=str(old))
    Decoder(tiny.model, "epikv-learned-decay", 24, weights=str(old), per_token=False)
    with pytest.raises(EpiKVError) as e:
        Decoder(tiny.model, "epikv-learned-decay", 24, weights=str(old))
    assert "\n" not in str(e.value) and "no decay map" in str(e.value) and "per_token=false" in str(e.value)
    spec = dict(budget=64, page=8, num_blocks=32, max_batch_tokens=32)
    with pytest.raises(EpiKVError, match="no decay map"):
        check_serving(tiny.model, ServeSpec(policy="epikv-learned-decay", settings={"weights": str(old)}, **spec))
    gen = ["generate", "--model", "random:tiny", "--prompt", "Hello there", "--raw", "--max-new-tokens", "6",
           "--budget", "16", "--recent", "4", "--policy", "epikv-learned-decay", "--weights", str(old)]
    assert "no decay map" in run_bad(capsys, *gen)
    code, _, err = run_cli(capsys, *gen, "--set", "epikv-learned-decay.per_token=false")
    assert code == 0, err


def test_graft_adds_a_decay_map_leaving_the_scores_bytes(tmp_path):
    """graft_decay (how the shipped file got its map): the target file's tensor bytes stay as they were, at their
    offsets, its header keeps its fingerprints and gains the decay fields, and the grafted map, applied to the
    target's standardisation, gives the source's per-head log rates (the two files' means and stds differ here).
    A source without a map, or fitted on another model, is refused in one line. Mutant: the weight copied without
    rescaling it to the target's std (scale = 1.0)."""
    import struct

    from epikv.policies.learned import LearnedWeights, graft_decay

    g = torch.Generator().manual_seed(4)
    fp = "{}|00000000000000aa"
    w, b = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, generator=g)
    dst = tmp_path / "dst.safetensors"
    LearnedWeights(w, b, torch.randn(3, 8, generator=g), torch.rand(3, 8, generator=g) + 0.5,
                   {"model": "m", "fingerprint": fp, "also_fits": "{}|gguf:bb"}).save(dst)
    src = tmp_path / "src.safetensors"
    LearnedWeights(w, b, torch.randn(3, 8, generator=g), torch.rand(3, 8, generator=g) + 0.5,
                   {"model": "m", "fingerprint": fp, "decay_horizon": 256}, torch.randn(3, 2, 8, generator=g),
                   torch.randn(3, 2, generator=g)).save(src)

    def data(p):
        raw = p.read_bytes()
        return raw[8 + struct.unpack("<Q", raw[:8])[0]:]

    before = data(dst)
    got = graft_decay(dst, src)
    assert data(dst)[:len(before)] == before
    assert got.meta["also_fits"] == "{}|gguf:bb" and got.meta["decay_horizon"] == "256" and got.has_decay
    s = load_weights(src)
    h = torch.randn(5, 8, generator=g)
    for l in range(3):
        mine = ((h - got.mean[l]) / got.std[l]) @ got.decay_weight[l].T + got.decay_bias[l]
        theirs = ((h - s.mean[l]) / s.std[l]) @ s.decay_weight[l].T + s.decay_bias[l]
        assert torch.allclose(mine, theirs, atol=1e-4), l
    with pytest.raises(EpiKVError, match="carry a decay map already"):
        graft_decay(dst, src)
    other = tmp_path / "other.safetensors"
    LearnedWeights(w, b, torch.zeros(3, 8), torch.ones(3, 8), {"model": "o", "fingerprint": "{}|cc"}).save(other)
    with pytest.raises(EpiKVError, match="carry no decay map"):
        graft_decay(other, other)
    with pytest.raises(EpiKVError, match="fitted on another model"):
        graft_decay(other, src)


def test_shipped_weights_carry_a_decay_map_fitted_over_256_later_queries():
    """The shipped SmolLM2 file's decay map (its header says how it was fitted: benchmarks/results/learned/README.md),
    with rates below 1 on average over real hidden states' standardised scale (mean bias < 0)."""
    from epikv.policies.learned import shipped_weights

    lw = load_weights(shipped_weights()[0])
    assert lw.has_decay and lw.meta["decay_horizon"] == "256" and lw.meta["decay_min_lags"] == "16"
    assert float(lw.decay_bias.mean()) < 0


def test_batched_scores_equal_the_formula_from_a_stack_or_one_buffer():
    """linear_scores (the standardisation folded into the weights, every layer in one batched product) equals the
    by-hand formula per token, layer and KV head, from a dict of blocks (the torch engine) and from one
    [batch, blocks, T, dim] buffer (HiddenStack: llama.cpp's capture) alike, batch > 1 and T > 1 included, and the
    two inputs give the same numbers. Mutants: the fold's mean term with the wrong sign; HiddenStack.layers taking
    the block after the one asked for."""
    from epikv.policies.learned import LearnedWeights, linear_scores
    from epikv.policies.view import HiddenStack

    n_layers, dim = 4, 16
    torch.manual_seed(0)  # a mean and std far from 0 and 1, biases of both signs: every term of the fold counts
    lw = LearnedWeights(torch.randn(n_layers, 2, dim), torch.randn(n_layers, 2), 3 * torch.randn(n_layers, dim),
                        0.5 + torch.rand(n_layers, dim), {"model": "tiny"}, 0.1 * torch.randn(n_layers, 2, dim),
                        0.2 * torch.randn(n_layers, 2))
    blocks = list(range(n_layers))
    stacked = torch.randn(2, n_layers, 3, dim)  # [batch, blocks, T, dim]
    hidden = {b: stacked[:, j].clone() for j, b in enumerate(blocks)}
    a_score, a_beta = linear_scores(lw, hidden, n_layers, decay=True)
    b_score, b_beta = linear_scores(lw, HiddenStack(blocks, stacked), n_layers, decay=True)
    assert torch.equal(a_score, b_score) and torch.equal(a_beta, b_beta)
    for bi in range(2):
        for t in range(3):
            for l in range(n_layers):
                x = (hidden[feature_block(l)][bi, t].double() - lw.mean[l].double()) / lw.std[l].double()
                for g in range(2):
                    s = float(x @ lw.weight[l, g].double()) + float(lw.bias[l, g])
                    r = min(0.0, float(x @ lw.decay_weight[l, g].double()) + float(lw.decay_bias[l, g]))
                    assert a_score[bi, l, g, t].item() == pytest.approx(s, rel=1e-5, abs=1e-5)
                    assert a_beta[bi, l, g, t].item() == pytest.approx(r, rel=1e-5, abs=1e-5)
