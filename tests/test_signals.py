"""The shared math against naive reference implementations written here, on random data."""

import math

import pytest
import torch

from epikv.signals import HiddenDelta, RollingStats, lag_normalised_spread, scale_band, scale_layer


def naive_z(values, window, eps=1e-6):
    """Causal rolling z-score written from METHOD.md section 1 (also the oracle of tests/test_score_oracle.py):
    population std over the trailing `window` values (newest included), 0 while fewer than 2 values exist."""
    out = []
    for t in range(len(values)):
        w = values[max(0, t - window + 1) : t + 1]
        if len(w) < 2:
            out.append(0.0)
            continue
        mean = sum(w) / len(w)
        std = math.sqrt(sum((x - mean) ** 2 for x in w) / len(w))
        out.append((values[t] - mean) / (std + eps))
    return out


def naive_mean(values, window):
    return [sum(values[max(0, t - window + 1) : t + 1]) / len(values[max(0, t - window + 1) : t + 1])
            for t in range(len(values))]


@pytest.mark.parametrize("window", [1, 2, 5, 64])
@pytest.mark.parametrize("length", [1, 3, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_rolling_zscore_matches_naive(window, length, chunk):
    g = torch.Generator().manual_seed(length * 100 + window)
    x = torch.rand(2, 3, length, generator=g, dtype=torch.float64) * 5
    rs = RollingStats(window)
    zs, means = [], []
    for s in range(0, length, chunk):
        part = x[..., s : s + chunk]
        valid = torch.ones(2, part.shape[-1], dtype=torch.bool)
        zs.append(rs.zscore(part, valid))
    z = torch.cat(zs, dim=-1)
    rs2 = RollingStats(window)
    for s in range(0, length, chunk):
        part = x[..., s : s + chunk]
        means.append(rs2.update(part, torch.ones(2, part.shape[-1], dtype=torch.bool))[0])
    mean = torch.cat(means, dim=-1)
    for b in range(2):
        for c in range(3):
            vals = x[b, c].tolist()
            assert torch.allclose(z[b, c], torch.tensor(naive_z(vals, window), dtype=torch.float64), atol=1e-9)
            assert torch.allclose(mean[b, c], torch.tensor(naive_mean(vals, window), dtype=torch.float64), atol=1e-9)


def test_rolling_skips_invalid_prefix():
    """Left padding: invalid values never enter a window; the first valid ones start a fresh window."""
    x = torch.tensor([[[9.0, 9.0, 1.0, 2.0, 4.0, 8.0]]])
    valid = torch.tensor([[False, False, True, True, True, True]])
    z = RollingStats(3).zscore(x, valid)[0, 0].tolist()
    assert z[:3] == [0.0, 0.0, 0.0]
    assert z[3:] == pytest.approx(naive_z([1.0, 2.0, 4.0, 8.0], 3)[1:], abs=1e-5)


def test_state_is_bounded():
    rs = RollingStats(8)
    for _ in range(50):
        rs.zscore(torch.rand(1, 2, 10), torch.ones(1, 10, dtype=torch.bool))
    assert rs.hist.shape[-1] == 7  # O(window), never growing with the trace


@pytest.mark.parametrize("chunks", [[10], [1] * 10, [3, 4, 3]])
def test_hidden_delta_chunked_equals_stepwise(chunks):
    h = torch.randn(2, 3, 10, 16)
    hd = HiddenDelta()
    gs, vs, s = [], [], 0
    for c in chunks:
        g, v = hd.update(h[:, :, s : s + c], torch.ones(2, c, dtype=torch.bool))
        gs.append(g)
        vs.append(v)
        s += c
    g, v = torch.cat(gs, -1), torch.cat(vs, -1)
    ref = (h[:, :, 1:] - h[:, :, :-1]).norm(dim=-1)
    assert torch.allclose(g[..., 1:], ref, atol=1e-5)
    assert not v[:, 0].any() and v[:, 1:].all()  # the first token has no predecessor


def test_hidden_delta_padding():
    h = torch.randn(1, 1, 5, 4)
    g, v = HiddenDelta().update(h, torch.tensor([[False, False, True, True, True]]))
    assert v.tolist() == [[False, False, False, True, True]]
    assert g[0, 0, 3].item() == pytest.approx((h[0, 0, 3] - h[0, 0, 2]).norm().item(), rel=1e-5)


def test_layer_scaling():
    assert (scale_layer(10, 32), scale_layer(21, 32)) == (10, 21)
    assert (scale_layer(10, 30), scale_layer(21, 30)) == (9, 20)  # round(9.375), round(19.69)
    assert (scale_layer(10, 28), scale_layer(21, 28)) == (9, 18)  # round(8.75), round(18.375)
    assert scale_band(7, 13, 32) == tuple(range(7, 14))
    assert scale_band(18, 25, 30) == tuple(range(17, 24))  # round(16.875)..round(23.4375)
    assert scale_layer(21, 4) == 3 and scale_layer(10, 4) == 1


def naive_lag(x, lag):
    """x: [heads, n, dim] -> [n]; chunk p >= 1 normalised against chunk p - 1, std over dim, mean over heads."""
    heads, n, dim = x.shape
    out = torch.zeros(n, dtype=torch.float64)
    for t in range(n):
        p = t // lag
        vals = []
        for h in range(heads):
            v = x[h, t].double()
            if p >= 1:
                ref = x[h, (p - 1) * lag : p * lag].double()
                lo, hi = ref.min(0).values, ref.max(0).values
                v = (v - lo) / (hi - lo + 1e-9)
            vals.append(v.std().item())
        out[t] = sum(vals) / heads
    return out


@pytest.mark.parametrize("n,lag", [(1, 4), (5, 4), (8, 4), (13, 4), (30, 7), (40, 128)])
def test_lag_kv_matches_naive(n, lag):
    x = torch.randn(2, 3, n, 6)
    got = lag_normalised_spread(x, lag)
    for b in range(2):
        assert torch.allclose(got[b].double(), naive_lag(x[b], lag), atol=1e-4)
