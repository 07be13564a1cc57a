"""Shared machinery of the hidden-state policies (the EPIKV family): g per layer, channel means, rolling stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..signals import HiddenDelta, RollingStats, check_layers, scale_band, scale_layer
from .base import CacheView, Observes, Policy, StepObservation

REF_A, REF_B = 10, 21  # the paper's layers for a 32-block model
REF_BAND_A, REF_BAND_B = (7, 13), (18, 25)


@dataclass
class HiddenStatePolicy(Policy):
    """A per-token score computed once from hidden-state deltas when the token enters the cache, then frozen."""

    window: int = 64  # trailing window W of the rolling statistics
    eps: float = 1e-6

    def channels(self, n_layers: int) -> list[tuple[int, ...]]:
        """Groups of decoder blocks; each channel is the mean of g over its blocks."""
        raise NotImplementedError

    def combine(self, g: torch.Tensor, stats: RollingStats, valid: torch.Tensor) -> torch.Tensor:
        """g: [batch, channels, T] -> score [batch, T]."""
        raise NotImplementedError

    def observes(self, n_layers: int) -> Observes:
        return Observes(hidden_layers=tuple(sorted({l for ch in self.channels(n_layers) for l in ch})))

    def init_state(self, batch: int, n_layers: int, device: torch.device) -> Any:
        chans = self.channels(n_layers)
        for ch in chans:
            check_layers(ch, n_layers)
        used = sorted({l for ch in chans for l in ch})
        # [channels, layers]: averaging matrix from per-layer g to per-channel g
        avg = torch.zeros(len(chans), len(used), device=device)
        for c, ch in enumerate(chans):
            for l in ch:
                avg[c, used.index(l)] = 1.0 / len(ch)
        return {"used": used, "avg": avg, "delta": HiddenDelta(), "stats": RollingStats(self.window, self.eps)}

    def on_tokens(self, state: Any, obs: StepObservation) -> dict[str, torch.Tensor]:
        dev = obs.valid.device
        h = torch.stack([obs.hidden[l].to(dev) for l in state["used"]], dim=1)  # [batch, layers, T, dim]
        g_layers, g_valid = state["delta"].update(h, obs.valid)  # [batch, layers, T]
        g = torch.einsum("cl,blt->bct", state["avg"], g_layers)  # [batch, channels, T]
        score = self.combine(g, state["stats"], g_valid)
        return {"score": torch.where(obs.valid, score, torch.zeros_like(score))}

    def scores(self, state: Any, view: CacheView) -> torch.Tensor:
        return view.token_data["score"]


def default_pair(n_layers: int) -> tuple[int, int]:
    return scale_layer(REF_A, n_layers), scale_layer(REF_B, n_layers)


def default_bands(n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return scale_band(*REF_BAND_A, n_layers), scale_band(*REF_BAND_B, n_layers)
