"""Per-layer profile: g_l for every block over labelled sequences, Spearman rho against the labels, intervals.

g_l(t) = ||h_l(t) - h_l(t-1)||_2 comes from the engine (a no-eviction Decoder with an observation-only policy that
declares every block), smoothed with a causal trailing mean of `smooth` tokens. rho is computed per layer
(1) pooled over all labelled tokens of all traces and (2) per trace, then averaged over traces. Token-level p-values
are meaningless (tokens of one trace are not independent), so the intervals come from a seeded cluster bootstrap
that resamples whole traces; n_eff is the number of traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.stats import rankdata

from ..engine import Decoder
from ..policies.base import Observes, Policy, StepObservation
from ..signals import HiddenDelta


@dataclass
class LayerDeltas(Policy):
    """Observation only (never evicts): g_l(t) of every decoder block, stored per token as token_data["g"]."""

    name = "layer-deltas"
    paper = "-"
    evicts = False

    def observes(self, n_layers: int) -> Observes:
        return Observes(hidden_layers=tuple(range(n_layers)))

    def init_state(self, batch: int, n_layers: int, device: torch.device) -> Any:
        return {"n_layers": n_layers, "delta": HiddenDelta()}

    def on_tokens(self, state: Any, obs: StepObservation) -> dict[str, torch.Tensor]:
        dev = obs.valid.device
        h = torch.stack([obs.hidden[l].to(dev) for l in range(state["n_layers"])], dim=1)  # [batch, layers, T, dim]
        g, g_valid = state["delta"].update(h, obs.valid)  # [batch, layers, T]
        return {"g": torch.where(g_valid[:, None], g, torch.zeros_like(g))}


def layer_deltas(model, ids: list[int], chunk: int = 512) -> np.ndarray:
    """g_l(t) for every block l and token t of `ids` (t = 0 has no predecessor: 0). Returns [layers, n] float64."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        dec = Decoder(model, LayerDeltas(), budget=None)
        dec.prefill(x[:, :chunk], [0])
        for s in range(chunk, x.shape[1], chunk):
            dec.step(x[:, s : s + chunk])
        return dec.cache.token_data["g"][0].double().cpu().numpy()


def trailing_mean(x: np.ndarray, w: int) -> np.ndarray:
    """Causal mean over the last w values, newest included (fewer at the start). x: [..., n]."""
    c = np.cumsum(x, axis=-1)
    out = c.copy()
    out[..., w:] = c[..., w:] - c[..., :-w]
    return out / np.minimum(np.arange(1, x.shape[-1] + 1), w)


def spearman_layers(g: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman rho of every row of g [layers, m] against y [m] (average ranks for ties); NaN if constant."""
    rg = rankdata(g, axis=-1)
    ry = rankdata(y)
    rg = rg - rg.mean(-1, keepdims=True)
    ry = ry - ry.mean()
    den = np.sqrt((rg**2).sum(-1) * (ry**2).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rg * ry).sum(-1) / np.where(den > 0, den, 1), np.nan)


def partial_spearman_layers(g: np.ndarray, y: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Spearman rho of every row of g against y with position partialled out: the correlation of the rank residuals
    after a linear fit on the position's ranks (labels and g both trend with position inside a trace)."""
    rp = rankdata(pos)
    rp = rp - rp.mean()
    den_p = (rp**2).sum()

    def resid(r):
        r = r - r.mean(-1, keepdims=True)
        return r - np.outer(np.atleast_2d(r) @ rp / den_p, rp).reshape(r.shape) if den_p > 0 else r

    eg, ey = resid(rankdata(g, axis=-1)), resid(rankdata(y))
    den = np.sqrt((eg**2).sum(-1) * (ey**2).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 1e-12, (eg * ey).sum(-1) / np.where(den > 1e-12, den, 1), np.nan)


@dataclass
class TraceArrays:
    """One labelled trace: smoothed g at its labelled tokens and the labels."""

    id: str
    g: np.ndarray  # [layers, m]
    y: np.ndarray  # [m]
    rel_pos: np.ndarray  # [m] position inside the reasoning span, 0..1
    g_raw: np.ndarray  # [layers, m] unsmoothed g (for the positional trend)


def trace_arrays(rec: dict, g_all: np.ndarray, smooth: int) -> TraceArrays:
    lab = rec["labels"]
    idx = np.array([i for i, v in enumerate(lab) if v is not None])
    y = np.array([lab[i] for i in idx], dtype=float)
    sm = trailing_mean(g_all, smooth)
    rel = (idx - idx[0]) / max(1, idx[-1] - idx[0])
    return TraceArrays(rec["id"], sm[:, idx], y, rel, g_all[:, idx])


def profile_stats(traces: list[TraceArrays], n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Pooled and per-trace-mean rho per layer with cluster-bootstrap intervals over traces."""
    per_trace = np.stack([spearman_layers(t.g, t.y) for t in traces])  # [traces, layers]
    partial = np.stack([partial_spearman_layers(t.g, t.y, t.rel_pos) for t in traces])  # [traces, layers]
    pooled = spearman_layers(np.concatenate([t.g for t in traces], -1), np.concatenate([t.y for t in traces]))
    rng = np.random.default_rng(seed)
    n = len(traces)
    boot_pooled, boot_mean, boot_partial = [], [], []
    for _ in range(n_boot):
        pick = rng.integers(0, n, n)
        with np.errstate(all="ignore"):
            boot_partial.append(np.nanmean(partial[pick], axis=0))
        boot_mean.append(np.nanmean(per_trace[pick], axis=0) if np.isfinite(per_trace[pick]).any() else
                         np.full(per_trace.shape[1], np.nan))
        boot_pooled.append(spearman_layers(np.concatenate([traces[i].g for i in pick], -1),
                                           np.concatenate([traces[i].y for i in pick])))
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    ci = lambda b: np.nanpercentile(np.stack(b), q, axis=0).T if n_boot else np.full((len(pooled), 2), np.nan)  # noqa: E731
    with np.errstate(all="ignore"):
        mean, partial_mean = np.nanmean(per_trace, axis=0), np.nanmean(partial, axis=0)
    return {"pooled": pooled, "pooled_ci": ci(boot_pooled), "trace_mean": mean, "trace_mean_ci": ci(boot_mean),
            "partial_mean": partial_mean, "partial_mean_ci": ci(boot_partial),
            "per_trace": per_trace, "n_valid": np.isfinite(per_trace).sum(0)}


def positional_trend(traces: list[TraceArrays], bins: int = 10) -> dict:
    """Mean raw g_l per relative-position bin (averaged over traces); Spearman against position per trace, averaged,
    of raw g_l, of the smoothed g_l the profile correlates, and of the labels themselves."""
    n_layers = traces[0].g.shape[0]
    curves = np.full((len(traces), n_layers, bins), np.nan)
    rho = np.full((len(traces), n_layers), np.nan)
    rho_smooth = np.full((len(traces), n_layers), np.nan)
    rho_label = np.full(len(traces), np.nan)
    for k, t in enumerate(traces):
        rho_smooth[k] = spearman_layers(t.g, t.rel_pos)
        rho_label[k] = spearman_layers(t.y[None], t.rel_pos)[0]
        b = np.minimum((t.rel_pos * bins).astype(int), bins - 1)
        for j in range(bins):
            if (b == j).any():
                curves[k, :, j] = t.g_raw[:, b == j].mean(-1)
        rho[k] = spearman_layers(t.g_raw, t.rel_pos)
    with np.errstate(all="ignore"):
        return {"bins": bins, "mean_g": np.nanmean(curves, 0), "rho_position": np.nanmean(rho, 0),
                "rho_position_smoothed": np.nanmean(rho_smooth, 0), "rho_label_position": float(np.nanmean(rho_label))}
