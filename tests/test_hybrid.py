"""Hybrid models (Gemma-3 layout: sliding-window and full-attention layers) on random:tiny-gemma3 (window 16, layers
0 and 2 sliding, 1 and 3 full). Oracles: model.generate with its own cache when nothing is evicted; with eviction,
the full model over the whole sequence under per-layer-type 4D masks: full-attention layers see exactly what the
cache held, sliding layers their true window (Gemma-3 takes a dict of masks by layer type)."""

import json
import types
from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from epikv import EpiKVCache, EpiKVError, generate, load_model
from epikv.cache import SlidingBufferLayer, cache_kwarg
from epikv.engine import Decoder
from epikv.policies import Policy

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Once upon a time"]
W = 16  # the preset's sliding window
SLIDING, FULL = (0, 2), (1, 3)


@pytest.fixture(scope="module")
def g3():
    return load_model("random:tiny-gemma3")


def _ids(n, seed=0):
    return torch.randint(10, 2000, (1, n), generator=torch.Generator().manual_seed(seed))


def masked_oracle(model, ids, visible):
    """Logits [n, vocab] of the full model over ids [1, n]: full-attention layers see, from query q, exactly the
    positions visible[q] (what the evicting cache held, plus the new tokens up to q); sliding layers their window."""
    n = ids.shape[1]
    full = torch.zeros(n, n, dtype=torch.bool)
    for q, ks in visible.items():
        full[q, ks] = True
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    sliding = (k <= q) & (k > q - W)
    with torch.inference_mode():
        return model(ids, attention_mask={"full_attention": full[None, None],
                                          "sliding_attention": sliding[None, None]}).logits[0]


def test_preset_is_hybrid(g3):
    c = EpiKVCache(g3.model, "epikv", budget=64)
    assert c.is_sliding == [True, False, True, False] and c._ref == 1
    assert all(isinstance(c.layers[i], SlidingBufferLayer) for i in SLIDING)


# -- (1) nothing evicted: exactly model.generate's tokens ---------------------------------------------------------------
def test_large_budget_equals_plain_generate(g3):
    """Budget above the length, 40 new tokens (beyond the 16-token window), a left-padded batch: the engine's greedy
    tokens equal model.generate with its default (sliding-window) cache."""
    tok = g3.tokenizer
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ref = g3.model.generate(**enc, max_new_tokens=40, do_sample=False, eos_token_id=None,
                            pad_token_id=tok.pad_token_id)[:, enc.input_ids.shape[1]:].tolist()
    res = generate(g3.model, tok, PROMPTS, policy="epikv", budget=4096, max_new_tokens=40, eos_token_ids=[])
    assert res.token_ids == ref and res.stats["evictions"] == 0


# -- (2) eviction: bounds and the masked oracle ------------------------------------------------------------------------
@pytest.mark.parametrize("policy,tau", [("epikv", 1), ("lag-kv", 3), ("streaming", 2)])
def test_eviction_bounds_and_oracle(g3, policy, tau):
    """A 20-token prompt (longer than the window), then chunks of 1-4 tokens: after every forward the full-attention
    layers hold at most budget + tau - 1 tokens and the sliding layers exactly min(seen, window - 1), the policy's
    true positions; every logit equals the full model's under the masks of what each layer could see."""
    m, budget = g3.model, 12
    ids = _ids(70, seed=1)
    visible, got, evictions = {}, [], 0
    with torch.inference_mode():
        dec = Decoder(m, policy, budget=budget, tau=tau, recent=3, protect_prompt=False, n_sink=2)
        c = dec.cache
        s = 20
        got.append(dec.prefill(ids[:, :s], [0], all_logits=True)[0])
        for q in range(s):
            visible[q] = list(range(q + 1))
        for size in [1, 3, 1, 1, 4, 2] * 8:
            if s + size > ids.shape[1]:
                break
            stored = c.token_data["pos"][0].tolist()
            for j in range(size):
                visible[s + j] = stored + list(range(s, s + j + 1))
            got.append(dec.step(ids[:, s : s + size], all_logits=True)[0])
            s += size
            for i in FULL:
                assert c.layers[i].length == c.stored_length() <= budget + tau - 1
            for i in SLIDING:
                assert c.layers[i].length == min(s, W - 1) and c.layers[i].get_seq_length() == s
            assert c.token_data["pos"][0, -1].item() == s - 1  # true positions
        evictions = c.evictions
    ref = masked_oracle(m, ids[:, :s], visible)
    got = torch.cat(got)
    assert evictions > 5 and got.shape[0] == s
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_oracle_has_teeth(g3):
    """The sliding layers must not see the tokens the full-attention layers kept beyond the window: an oracle that
    lets them (sliding = the full layers' mask) gives other logits."""
    m = g3.model
    ids = _ids(40, seed=2)
    with torch.inference_mode():
        dec = Decoder(m, "streaming", budget=12, tau=64)
        dec.prefill(ids[:, :39], [0])
        dec.cache.evict()  # one eviction, of tokens whose keys/values were computed with nothing evicted
        kept = dec.cache.token_data["pos"][0].tolist()
        got = dec.step(ids[:, 39:40])[0]
        n = 40
        full = torch.tril(torch.ones(n, n, dtype=torch.bool))
        full[n - 1] = False
        full[n - 1, kept + [n - 1]] = True
        wrong = m(ids, attention_mask={"full_attention": full[None, None],
                                       "sliding_attention": full[None, None]}).logits[0, -1]
        right = masked_oracle(m, ids, {q: full[q].nonzero().squeeze(-1).tolist() for q in range(n)})[-1]
    assert torch.allclose(got, right, atol=1e-4)
    assert (got - wrong).abs().max() > 1e-3


def test_padded_batch_rows_match_single_runs(g3):
    """Left padding inside the sliding window while the full-attention layers evict it first (budget 8 < window):
    per row the logits of that row decoded alone."""
    tok = g3.tokenizer
    rows = [tok(p)["input_ids"] for p in PROMPTS]
    cont = _ids(30, seed=9)
    # windows over the prompt too (window_over="all"): with the decode-only default every unprotected prompt token
    # scores exactly 0 and a two-value window gives z = +-1, exact ties in theory that float rounding, which depends
    # on the batch's shape and the transformers version, breaks either way; this test is about the padding
    kw = dict(budget=8, tau=1, recent=2, protect_prompt=False, n_sink=2, window_over="all")
    with torch.inference_mode():
        singles = []
        for r in rows:
            d = Decoder(g3.model, "epikv", **kw)
            d.prefill(torch.tensor([r]), [0])
            singles.append(torch.stack([d.step(cont[:, t : t + 1])[0] for t in range(30)]))
        w = max(map(len, rows))
        pad = [w - len(r) for r in rows]
        d = Decoder(g3.model, "epikv", **kw)
        d.prefill(torch.tensor([[0] * p + r for p, r in zip(pad, rows)]), pad)
        both = torch.stack([d.step(cont.expand(2, -1)[:, t : t + 1]) for t in range(30)], dim=1)
    assert min(pad) == 0 and max(pad) > 4 and d.cache.evictions > 0
    for i in range(2):
        assert torch.allclose(both[i], singles[i], atol=1e-4), (i, (both[i] - singles[i]).abs().max())


@dataclass
class KeepOldest(Policy):
    """Keeps the oldest slots, padding included: evicts a padded row's real tokens while keeping its padding."""

    name = "keep-oldest-test"

    def keep(self, state, view):
        return torch.arange(view.budget, device=view.device).expand(view.n_pad.shape[0], -1)


def _padded_prompt(tok):
    rows = [tok(p)["input_ids"] for p in PROMPTS]
    w = max(map(len, rows))
    pad = [w - len(r) for r in rows]
    return torch.tensor([[0] * p + r for p, r in zip(pad, rows)]), pad


@pytest.mark.parametrize("policy", [KeepOldest(protect_prompt=False, n_sink=2, recent=0), "epikv-page"])
def test_padded_batch_with_own_keep_rule_refused(g3, policy):
    """The shared 2D mask needs a padded row's stored padding at its true columns (sliding layers read those), so a
    padded row must lose its padding before any real token: keep rules that do not promise it (a policy's own, whole
    pages) are refused up front on padded hybrid batches, in one line."""
    ids, pad = _padded_prompt(g3.tokenizer)
    kw = dict(page=4, protect_prompt=False, n_sink=2, recent=0) if policy == "epikv-page" else {}
    d = Decoder(g3.model, "epikv" if policy == "epikv-page" else policy, budget=ids.shape[1] - 1, **kw)
    with torch.inference_mode(), pytest.raises(EpiKVError, match="run its prompts unpadded") as e:
        d.prefill(ids, pad)
    assert "\n" not in str(e.value)


def test_padded_row_losing_real_tokens_first_is_caught(g3, monkeypatch):
    """The safety net behind that refusal: a default-rule policy whose keep set still drops real tokens of a padded
    row while keeping its padding is stopped at that eviction, not decoded with a wrong mask."""
    monkeypatch.setattr(Policy, "keep", KeepOldest.keep)
    ids, pad = _padded_prompt(g3.tokenizer)
    d = Decoder(g3.model, "streaming", budget=ids.shape[1] - 1, n_sink=2, recent=0)
    with torch.inference_mode(), pytest.raises(EpiKVError, match="evicted real tokens of a padded row") as e:
        d.prefill(ids, pad)
    assert "\n" not in str(e.value)


def test_fork_prefix(g3):
    """Decoder.fork on a hybrid model: the sliding layers take the window before the prefix's end; a prefix the
    window has moved past is refused."""
    ids = _ids(30, seed=4)
    with torch.inference_mode():
        ref = g3.model(ids[:, :24]).logits[0]
        dec = Decoder(g3.model, "full", budget=None)
        dec.prefill(ids[:, :12], [0])
        got = dec.fork(10).step(ids[:, 10:14], all_logits=True)[0]
        assert torch.allclose(got, ref[10:14], atol=1e-4)
        dec.step(ids[:, 12:20])  # 20 seen: the sliding layers hold columns 5 ... 19
        fork = dec.fork(20)
        assert [layer.get_seq_length() for layer in fork.cache.layers] == [20] * 4  # generate() reads layer 0
        got = fork.step(ids[:, 20:24], all_logits=True)[0]
        assert torch.allclose(got, ref[20:24], atol=1e-4)
        with pytest.raises(EpiKVError, match="moved past"):
            dec.fork(18)  # needs columns 3 ... 17


# -- (3) the drop-in cache inside model.generate -----------------------------------------------------------------------
def test_dropin_generate_two_turns_oracle(g3):
    """EpiKVCache in model.generate on the hybrid model, two turns (the second feeds 12 tokens in one forward): every
    step's logits equal the masked oracle; bounds hold; the tokens equal epikv.generate's for the first turn."""
    m, tok = g3.model, g3.tokenizer
    enc = tok(PROMPTS[0], return_tensors="pt")
    c = EpiKVCache(m, "epikv", budget=14, tau=2)
    visible, last = {}, []

    def hook(module, args, kwargs):
        stored = c.token_data["pos"][0].tolist() if "pos" in c.token_data else []
        start = c.seen[0].item() if c.seen is not None else 0
        t = kwargs["input_ids"].shape[1]
        for j in range(t):
            visible[start + j] = stored + list(range(start, start + j + 1))
        last.append(start + t - 1)

    handle = m.model.register_forward_pre_hook(hook, with_kwargs=True)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
              **{cache_kwarg(m): c})
    try:
        out = m.generate(**enc, max_new_tokens=20, **kw)
        first_evictions = c.evictions
        ids2 = torch.cat([out.sequences, torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])], 1)
        out2 = m.generate(ids2, max_new_tokens=15, **kw)
    finally:
        handle.remove()
    got = torch.cat([torch.cat(out.logits), torch.cat(out2.logits)])
    ref = masked_oracle(m, out2.sequences[:, : max(visible) + 1], visible)[last]
    assert first_evictions > 0 and c.evictions > first_evictions
    assert c.stored_length() <= 15 and all(c.layers[i].length == W - 1 for i in SLIDING)
    assert c.get_seq_length() == out2.sequences.shape[1] - 1
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    res = generate(m, tok, PROMPTS[0], policy="epikv", budget=14, tau=2, max_new_tokens=20, eos_token_ids=[])
    assert out.sequences[0, -20:].tolist() == res.token_ids[0]


def test_dropin_padded_batch_equals_dynamic_cache(g3):
    tok = g3.tokenizer
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = g3.model.generate(**enc, **kw, **{cache_kwarg(g3.model): DynamicCache(config=g3.model.config)})
    got = g3.model.generate(**enc, **kw, **{cache_kwarg(g3.model): EpiKVCache(g3.model, "epikv", budget=4096)})
    assert got.tolist() == ref.tolist()


# -- (4) refusals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,why", [("h2o", "per head"), ("tova", "per layer"), ("knorm", "per head"),
                                        ("h2o-global", "attention weights"), ("epikv-seg-q", "query states")])
def test_layer_wise_policies_refused(g3, policy, why):
    with pytest.raises(EpiKVError, match=why) as e:
        EpiKVCache(g3.model, policy, budget=64)
    assert "\n" not in str(e.value) and "sliding-window" in str(e.value)


def _fake(layer_types, sliding_window=16, n=4):
    cfg = types.SimpleNamespace(layer_types=layer_types, sliding_window=sliding_window)
    return types.SimpleNamespace(config=cfg, model=types.SimpleNamespace(
        layers=torch.nn.ModuleList(torch.nn.Identity() for _ in range(n))))


def test_linear_attention_refused():
    with pytest.raises(EpiKVError, match="linear_attention layers are not supported") as e:
        EpiKVCache(_fake(["linear_attention", "linear_attention", "linear_attention", "full_attention"]), "epikv")
    assert "\n" not in str(e.value)
    with pytest.raises(EpiKVError, match="cannot tell which layers slide"):
        EpiKVCache(_fake(["sliding_attention", "full_attention"] * 2, sliding_window=None), "epikv")


def test_all_sliding_model():
    """Mistral v0.1 style (a sliding_window, no layer_types: every layer slides): nothing to evict from, so an
    evicting policy is refused; `full` runs exactly."""
    cfg = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=300, sliding_window=8)
    torch.manual_seed(0)
    m = MistralForCausalLM(cfg).eval()
    with pytest.raises(EpiKVError, match="every attention layer .* sliding-window"):
        EpiKVCache(m, "epikv", budget=16)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        dec = Decoder(m, "full", budget=None)
        got = torch.cat([dec.prefill(ids[:, :5], [0], all_logits=True)[0]]
                        + [dec.step(ids[:, t : t + 1]) for t in range(5, 20)])
        ref = m(ids).logits[0]
    assert torch.allclose(got, ref, atol=1e-4)


def test_qwen2_use_sliding_window_false_means_no_sliding_layers():
    """Qwen2 / Qwen3 configs keep `sliding_window` (4096, 131072 ...) with `use_sliding_window: false`: every layer
    is full attention. transformers 5.25 nulls the window itself; a config that keeps it and has no layer_types
    (as loaded elsewhere) must read the same, not as Mistral v0.1's every-layer window."""
    from transformers import Qwen2Config

    from epikv.cache import attention_layout

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=300, use_sliding_window=False, sliding_window=16)
    fake = types.SimpleNamespace(config=cfg)
    assert attention_layout(fake, 4) == (frozenset(), None)
    cfg.sliding_window, cfg.layer_types = 16, None  # the window kept, no per-layer types
    assert attention_layout(fake, 4) == (frozenset(), None)
    cfg.use_sliding_window = True  # switched on and no layer types: every layer slides
    assert attention_layout(fake, 4) == (frozenset(range(4)), 16)
    cfg.use_sliding_window = False
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=300)).eval()
    m.config.sliding_window, m.config.layer_types = 16, None
    assert EpiKVCache(m, "epikv", budget=32).is_sliding == [False] * 4  # an evicting cache, no sliding layer


# -- the CLI on a hybrid model (issue 55, item 13) ---------------------------------------------------------------------
def _cli(capsys, *argv):
    from test_cli import run_cli

    code, out, err = run_cli(capsys, *argv)
    return code, out, [l for l in err.splitlines() if l.strip()]


GEN = ["generate", "--model", "random:tiny-gemma3", "--prompt", "Hello there", "--raw", "--max-new-tokens", "20",
       "--budget", "12", "--json"]


def test_cli_default_policy_falls_back_on_a_hybrid_model(capsys):
    """No --policy on a sliding-window model: the default (epikv-seg-q, refused there: it reads recomputed queries)
    gives way to streaming with one warning line saying so, and the run evicts. Pre-fix: exit 2, a refusal with no
    hint. Mutant: hybrid_policy refusing whether or not --policy was given fails here."""
    from epikv.commands.common import HYBRID_FALLBACK
    from epikv.policies import DEFAULT_POLICY

    code, out, err = _cli(capsys, *GEN)
    assert code == 0, err
    assert len(err) == 1 and "warning" in err[0] and DEFAULT_POLICY in err[0] and HYBRID_FALLBACK in err[0], err
    d = json.loads(out)
    assert d["policy"] == HYBRID_FALLBACK and d["evictions"] > 0


def test_cli_named_policy_refused_on_a_hybrid_model_lists_what_runs(capsys):
    """A policy the user named that cannot run there is refused (exit 2, one line) with the policies that do; the
    list holds exactly those the cache accepts on this model. Mutant: falling back for a named policy too exits 0."""
    from epikv.policies import REGISTRY

    code, out, err = _cli(capsys, *GEN, "--policy", "epikv-seg-q")
    assert code == 2 and not out and len(err) == 1 and "Traceback" not in err[0], err
    listed = err[0].split("on this model run one of: ")[1].split(", ")
    m = load_model("random:tiny-gemma3").model
    runs = []
    for name in REGISTRY:
        try:
            EpiKVCache(m, name, budget=12)
            runs.append(name)
        except EpiKVError:
            pass
    assert listed == runs and "streaming" in listed and "epikv-seg-q" not in listed


def test_cli_default_policy_unchanged_on_a_full_attention_model(capsys):
    """No fallback and no warning where the default runs (the embedded SmolLM2: its learned weights ship). Mutant:
    falling back on every model fails here."""
    from epikv.policies import DEFAULT_POLICY

    code, out, err = _cli(capsys, *GEN[:2], "smollm2", *GEN[3:])
    assert code == 0 and not err, err
    assert json.loads(out)["policy"] == DEFAULT_POLICY


def test_cli_default_policy_falls_back_where_no_weights_fit(capsys, tmp_path, monkeypatch):
    """A full-attention model no learned weights were fitted on (random:tiny): the default gives way to the fallback
    with one warning line that names both; the run evicts. Mutant: the fallback taken for a named policy too (then
    `--policy epikv-learned-decay` exits 0 here)."""
    from epikv.policies import DEFAULT_POLICY, FALLBACK_POLICY

    monkeypatch.setenv("EPIKV_WEIGHTS_DIR", str(tmp_path))  # none fitted on random:tiny (conftest's left out)
    code, out, err = _cli(capsys, *GEN[:2], "random:tiny", *GEN[3:])
    assert code == 0 and len(err) == 1 and DEFAULT_POLICY in err[0] and FALLBACK_POLICY in err[0], err
    d = json.loads(out)
    assert d["policy"] == FALLBACK_POLICY and d["evictions"] > 0
    code, out, err = _cli(capsys, *GEN[:2], "random:tiny", *GEN[3:], "--policy", str(DEFAULT_POLICY))
    assert code == 2 and not out and len(err) == 1 and "no weights fit" in err[0], err


def test_cli_trace_falls_back_on_a_hybrid_model(capsys):
    code, out, err = _cli(capsys, "trace", "--model", "random:tiny-gemma3", "--prompt", "Q: what", "--completion",
                          " a b c d e f g h i j k l m n o p" * 2, "--budget", "12")
    assert code == 0 and len(err) == 1 and "streaming" in err[0] and "streaming at K=12" in out, (out, err)


def test_cli_named_policy_that_runs_on_a_hybrid_model_runs_as_named(capsys):
    """Mutant: dropping `if why is None: return` in hybrid_policy refuses even a policy that runs there."""
    code, out, err = _cli(capsys, *GEN, "--policy", "epikv")
    assert code == 0 and not err and json.loads(out)["policy"] == "epikv", err
