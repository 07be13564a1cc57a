"""Scores that age (issue 57 item 1): epikv-learned-decay's priority against a plain loop recomputation (the arrival
score recomputed by hand from the hidden states the policy was shown, then multiplied by beta once per step of age)
over runs with evictions, in the torch engine and in llama.cpp, whose keep sets must be the ones that priority
gives; and the two controls' rules (a window that is a fraction of K, a fixed age penalty)."""

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
    rule reads it), and the keep set applied is the one the loop's priority gives."""
    assert len(calls) == len(keeps) > 3
    memo: dict[int, float] = {}
    for (pos, got), kept in zip(calls, keeps):
        t = max(pos)
        for p in pos[:-recent]:
            if p not in memo:
                memo[p] = arrival_score(lw, arrivals[p], n_layers)
        want = [decayed(memo[p], t - p, beta) for p in pos[:-recent]] + [0.0] * recent
        assert max(abs(a - b) for a, b in zip(got[:-recent], want)) < tol, (t, got, want)
        assert kept == [pos[j] for j in kept_by(want, n_prompt, K, recent)]


def test_decayed_score_equals_a_loop_recomputation_in_the_torch_engine(tiny, tmp_path):
    """Mutants that fail it: the age off by one (t - i + 1), the decay applied twice (2 (t - i) ln beta)."""
    path = write_random_weights(tmp_path / "w.safetensors", 4, 2, 64, seed=3)
    K, recent, beta = 24, 4, 0.8
    dec = Decoder(tiny.model, "epikv-learned-decay", K, recent=recent, weights=path, beta=beta)
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
    check_against_loop(load_weights(path), 4, arrivals, calls, kept, beta, 4, K, recent, 1e-4)


def test_decay_reorders_what_the_arrival_score_keeps(tiny, tmp_path):
    """Not a no-op: with a strong decay the keep sets differ from epikv-learned-mean's and hold newer tokens."""
    path = write_random_weights(tmp_path / "w.safetensors", 4, 2, 64, seed=3)
    ids = torch.randint(3, 1000, (1, 80), generator=torch.Generator().manual_seed(4))
    out = {}
    for name, kw in (("epikv-learned-mean", {}), ("epikv-learned-decay", {"beta": 0.5})):
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
    got = get_policy("epikv-learned-decay", beta=0.5).scores(None, view)
    want = torch.tensor([[decayed(0.5, 10, 0.5), decayed(0.2, 7, 0.5), decayed(-1.0, 3, 0.5), 3.0]])
    assert torch.allclose(got, want, atol=1e-5)


def test_decayed_score_equals_a_loop_recomputation_in_llamacpp():
    """The same in llama.cpp on the embedded GGUF with the shipped SmolLM2 weights: the hidden states it captured,
    scored by hand and decayed by the loop, give every keep set it applied (true positions, chunked scoring)."""
    from epikv.engine import encode_prompts
    from epikv.llamacpp import LlamaDecoder, available, load_gguf
    from epikv.policies.learned import shipped_weights
    import numpy as np

    assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    gm = load_gguf("smollm2")
    ids = encode_prompts(gm.tokenizer, ["Explain step by step why the sum of two odd numbers is even."], chat=True)[0]
    K, recent, beta = 64, 8, 0.95
    dec = LlamaDecoder(gm, "epikv-learned-decay", K, max_tokens=len(ids) + 100, threads=1, recent=recent, beta=beta)
    arrivals, calls, keeps = {}, [], []
    record(dec.policy, arrivals, calls)
    dec.on_evict = lambda d, keep: keeps.append(d.positions[keep].tolist())
    logits = dec.prefill(ids)
    for _ in range(100):
        logits = dec.step(int(np.argmax(logits)))
    lw = load_weights(shipped_weights()[0])
    assert lw.shape[0] == 30
    check_against_loop(lw, 30, arrivals, calls, keeps, beta, len(ids), K, recent, 1e-3)


@pytest.mark.parametrize("name, kw", [("epikv-learned-decay", {"beta": 0.9}),
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
                   {"model": "tiny", "fingerprint": fp}).save(path)
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
