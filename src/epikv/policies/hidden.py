"""Shared machinery of the hidden-state policies (the EPIKV family): g per layer, channel means, rolling stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._lazy import torch

from ..signals import HiddenDelta, RollingStats, check_layers, published_pair, scale_band, scale_layer
from .base import CacheView, Observes, Policy, StepObservation, check_window_over, window_tokens
from .kv_var import arrival_statistic, check_stat

REF_A, REF_B = 10, 21  # the paper's layers for a 32-block model
REF_BAND_A, REF_BAND_B = (7, 13), (18, 25)


@dataclass
class HiddenStatePolicy(Policy):
    """A per-token score computed once from hidden-state deltas when the token enters the cache, then frozen.

    Value reserve (`reserve` = N > 0; the authors' `hs_variance_detrend_v<stat><N>`, commit 121e62c, METHOD.md
    section 4): at each eviction, among the evictable slots (after the protected prefix, before the recency window)
    the top N by a value statistic (`reserve_stat`: range = max - min over head_dim, var, or L2 norm, averaged over
    KV heads then layers) are always kept; they displace the lowest-scored survivors, so the cache is still exactly
    K. If N exceeds the free slots, the highest-value reserved slots win. The statistic is taken from each token's
    values when it enters the cache (they never change), so the policy reads no cache at eviction and the cache may
    refill its holes as for the plain policy.
    """

    window: int = 64  # trailing window W of the rolling statistics
    eps: float = 1e-6
    reserve: int = 0  # value reserve N (0: off; the authors ran 8, 16, 32, 64)
    reserve_stat: str = "range"
    # what the rolling window buffers: "decode" = tokens after the prompt only (the authors' code: the first decode
    # token gets z = 0, prompt tokens score 0), "all" = the prompt's tokens too (epikv before issue 26)
    window_over: str = "decode"

    def __post_init__(self):
        super().__post_init__()
        check_stat(self.name, "reserve_stat", self.reserve_stat)
        check_window_over(self.name, self.window_over)

    def channels(self, n_layers: int) -> list[tuple[int, ...]]:
        """Groups of decoder blocks; each channel is the mean of g over its blocks."""
        raise NotImplementedError

    def combine(self, g: torch.Tensor, stats: RollingStats, valid: torch.Tensor) -> torch.Tensor:
        """g: [batch, channels, T] -> score [batch, T]."""
        raise NotImplementedError

    def observes(self, n_layers: int) -> Observes:
        return Observes(hidden_layers=tuple(sorted({l for ch in self.channels(n_layers) for l in ch})),
                        arriving_kv=self.reserve > 0, kv_parts="v" if self.reserve else "kv")  # reserve: values

    def init_state(self, batch: int, n_layers: int, device: torch.device) -> Any:
        chans = self.channels(n_layers)
        for ch in chans:
            check_layers(ch, n_layers)
        used = sorted({l for ch in chans for l in ch})
        # [channels, layers]: averaging matrix from per-layer g to per-channel g ("_": shared by rows, never reordered)
        avg = torch.zeros(len(chans), len(used), device=device)
        for c, ch in enumerate(chans):
            for l in ch:
                avg[c, used.index(l)] = 1.0 / len(ch)
        return {"used": used, "_avg": avg, "delta": HiddenDelta(), "stats": RollingStats(self.window, self.eps)}

    def on_tokens(self, state: Any, obs: StepObservation) -> dict[str, torch.Tensor]:
        dev = obs.valid.device
        h = torch.stack([obs.hidden[l].to(dev) for l in state["used"]], dim=1)  # [batch, layers, T, dim]
        g_layers, g_valid = state["delta"].update(h, obs.valid)  # [batch, layers, T]
        g = torch.einsum("cl,blt->bct", state["_avg"], g_layers)  # [batch, channels, T]
        counted = window_tokens(obs, self.window_over)  # [batch, T]: what enters the rolling window
        score = self.combine(g, state["stats"], g_valid & counted)
        out = {"score": torch.where(obs.valid & counted, score, torch.zeros_like(score))}
        if self.reserve:  # the value statistic of the T new tokens, the last T slots of each layer
            out["vstat"] = arrival_statistic(obs.values, obs.valid.shape[1], self.reserve_stat, obs.valid)  # [batch, T]
        return out

    def scores(self, state: Any, view: CacheView) -> torch.Tensor:
        if self.reserve:
            return reserve_priority(view.token_data["score"], view.token_data["vstat"], view, self.reserve)
        return view.token_data["score"]


def reserve_priority(score: torch.Tensor, value_stat: torch.Tensor, view: CacheView, n_reserve: int) -> torch.Tensor:
    """score, value_stat [batch, n] -> a priority for `select_keep` in which the top `n_reserve` evictable slots by
    the value statistic outrank every other evictable slot (ranks instead of scores: exact whatever the scores'
    scale)."""
    dev = view.device
    n = view.length
    pr = torch.nan_to_num(score.to(dev).float(), nan=-3e38)
    ar = torch.arange(n, device=dev, dtype=torch.float32).expand_as(pr)
    rank = torch.empty_like(pr).scatter_(-1, pr.argsort(-1), ar)  # 0 = lowest score
    idx = torch.arange(n, device=dev)
    evictable = (idx >= (view.n_pad + view.n_protect).to(dev)[:, None]) & (idx < n - view.recent)  # [batch, n]
    val = value_stat.to(dev).float().masked_fill(~evictable, float("-inf"))
    top = val.topk(min(n_reserve, n), dim=-1)
    reserved = torch.zeros_like(evictable).scatter_(-1, top.indices, torch.isfinite(top.values))
    vrank = torch.empty_like(pr).scatter_(-1, val.argsort(-1), ar)
    return torch.where(reserved, n + vrank, rank)


def default_pair(n_layers: int) -> tuple[int, int]:
    """(A, B): the authors' published layers for this model when they gave them, else 10, 21 of 32 scaled."""
    pub = published_pair(n_layers)
    if pub is not None:
        return pub[0]
    return scale_layer(REF_A, n_layers), scale_layer(REF_B, n_layers)


def layer_note(layers, n_layers: int, blocks) -> str:
    """Says which blocks a policy reads on this model (`blocks`, from its observes()) and why its `layers` setting
    resolves to them (printed by the CLI)."""
    where = ", ".join(map(str, blocks))
    if layers is not None:
        return f"blocks {where} (set)"
    pub = published_pair(n_layers)
    if pub is not None:
        return f"blocks {where} (from {pub[1]}: {pub[0][0]}, {pub[0][1]})"
    a, b = default_pair(n_layers)
    return f"blocks {where} (from the paper's {REF_A}, {REF_B} of 32, scaled to {a}, {b} for {int(n_layers)} blocks)"


def default_bands(n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return scale_band(*REF_BAND_A, n_layers), scale_band(*REF_BAND_B, n_layers)
