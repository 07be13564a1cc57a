"""The EPIKV family's scores against oracles written here, independent of `epikv.signals`.

(a) On the real embedded model: the scores the `epikv` policy stored for every cached token equal z_A - z_B computed
from `output_hidden_states` of one plain forward (no cache, no hooks). (c) eps on a zero-variance band, (d)
`epikv-band`'s weight multiplies band A, on constructed hidden states fed to the policy directly."""

from __future__ import annotations


import pytest
import torch

from epikv.engine import Decoder
from epikv.policies import StepObservation, get_policy
from epikv.signals import scale_layer
from test_signals import naive_z  # tests/ is on sys.path (pytest's default import mode)


def oracle_z(g: list[float]) -> list[float]:
    """METHOD.md's causal rolling z-score over W = 64, written independently of epikv.signals."""
    return naive_z(g, window=64)


@pytest.mark.parametrize("window_over", [None, "all"])
def test_epikv_scores_equal_an_oracle_from_output_hidden_states(smollm2, window_over):
    """A few hundred tokens through the engine (a chunked prefill, then single decode steps, no eviction); the
    stored per-token scores equal z_A - z_B from hidden_states[A + 1], [B + 1] of one forward over all tokens.
    "decode" (the default, the authors' code): the rolling window holds decode tokens only, so prompt tokens score
    0, the first decode token (one g value) too, and its g is taken against the last prompt token's state; "all":
    the window runs over the prompt's tokens as well."""
    model, tok = smollm2.model, smollm2.tokenizer
    text = " ".join(f"Step {i}: we add {i} and {3 * i + 1}, which gives {4 * i + 1}; then we check it." for i in range(20))
    ids = torch.tensor([tok(text)["input_ids"][:260]])  # [1, 260]
    n_blocks = model.config.num_hidden_layers
    a, b = scale_layer(10, n_blocks), scale_layer(21, n_blocks)  # blocks 9 and 20 of 30
    assert (a, b) == (9, 20)
    p = 200
    with torch.inference_mode():
        # None: the shipped default, which must be the authors' "decode"; never evicts: every score stays stored
        dec = Decoder(model, "epikv", 4096, **({} if window_over is None else {"window_over": window_over}))
        dec.prefill(ids[:, :p], [0], chunk=64)
        for s in range(p, ids.shape[1]):
            dec.step(ids[:, s : s + 1])
        stored = dec.cache.token_data["score"][0].double()  # [260]
        hs = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    assert dec.cache.evictions == 0 and stored.shape == (ids.shape[1],)

    def g_of(block):  # g(t) = ||h(t) - h(t - 1)|| for t >= 1; the first token has no predecessor
        h = hs[block + 1][0].double()  # output of decoder block `block`
        return (h[1:] - h[:-1]).norm(dim=-1).tolist()

    if window_over == "all":
        za, zb = oracle_z(g_of(a)), oracle_z(g_of(b))
        want = torch.tensor([0.0] + [x - y for x, y in zip(za, zb)], dtype=torch.float64)
        assert stored[:2].tolist() == [0.0, 0.0]  # no g for token 0; a single g value for token 1: z = 0
    else:  # g of tokens p.. (token t's g is entry t - 1), z-scored among themselves
        za, zb = oracle_z(g_of(a)[p - 1:]), oracle_z(g_of(b)[p - 1:])
        want = torch.tensor([0.0] * p + [x - y for x, y in zip(za, zb)], dtype=torch.float64)
        assert stored[: p + 1].abs().max().item() == 0.0  # the prompt, and the first decode token (one g value)
    torch.testing.assert_close(stored, want, atol=2e-3, rtol=2e-3)
    big = want.abs() > 0.1
    assert big.sum() > (150 if window_over == "all" else 40) and (stored[big].sign() == want[big].sign()).all()
    assert (want > 0.1).any() and (want < -0.1).any()  # both signs occur: a flipped A - B could not pass


def _obs(hidden: dict[int, torch.Tensor]) -> StepObservation:
    t = next(iter(hidden.values())).shape[1]
    return StepObservation(hidden=hidden, attentions={}, valid=torch.ones(1, t, dtype=torch.bool),
                           positions=torch.arange(t)[None])


def _walk(steps: list[float], dim: int = 8) -> torch.Tensor:
    """Hidden states [1, T, dim] along e0 whose consecutive distances are `steps` (h(0) = 0)."""
    pos = torch.tensor([0.0] + list(steps)).cumsum(0)
    return (pos[:, None] * torch.eye(dim)[0])[None]


def test_eps_is_one_in_a_million_on_a_zero_variance_band():
    """Band B never moves (g_B = 0: std 0, z_B = 0 / eps = 0); band A's two g values 1e-6 and 3e-6 have mean 2e-6
    and population std 1e-6, so z_A = 1e-6 / (1e-6 + eps) = 0.5 exactly when eps = 1e-6 (1.0 with eps -> 0)."""
    pol = get_policy("epikv", layers=(1, 3))
    assert pol.eps == 1e-6 and pol.window == 64
    st = pol.init_state(1, 4, torch.device("cpu"))
    h_a = _walk([1e-6, 3e-6])
    score = pol.on_tokens(st, _obs({1: h_a, 3: torch.ones(1, 3, 8)}))["score"][0]
    assert score[:2].tolist() == [0.0, 0.0]
    assert score[2].item() == pytest.approx(0.5, abs=1e-4)
    # the same through the raw statistics class with its default eps
    from epikv.signals import RollingStats

    z = RollingStats(64).zscore(torch.tensor([[[1e-6, 3e-6]]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool))
    assert z[0, 0, 1].item() == pytest.approx(0.5, abs=1e-9)


def test_band_weight_multiplies_band_a():
    """Bands A = blocks (0, 1), B = (2, 3). g per block: 0 -> [1, 3], 1 -> [1, 5] (band mean [1, 4], z_A = 1);
    2 -> [2, 2], 3 -> [2, 6] (band mean [2, 4], z_B = 1). With w_a = 3: 3 * 1 - 1 = 2 (a weight on B gives -2)."""
    pol = get_policy("epikv-band", bands=((0, 1), (2, 3)), w_a=3.0)
    assert get_policy("epikv-band").w_a == 1.0
    st = pol.init_state(1, 4, torch.device("cpu"))
    hidden = {0: _walk([1, 3]), 1: _walk([1, 5]), 2: _walk([2, 2]), 3: _walk([2, 6])}
    score = pol.on_tokens(st, _obs(hidden))["score"][0]
    assert score[2].item() == pytest.approx(2.0, abs=1e-4)
    flat = get_policy("epikv", layers=(0, 3))  # z(g_0) - z(g_3) = 1 - 1 = 0 on the same states
    assert flat.on_tokens(flat.init_state(1, 4, torch.device("cpu")), _obs(hidden))["score"][0, 2].item() == \
        pytest.approx(0.0, abs=1e-4)
