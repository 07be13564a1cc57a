"""KV-key / KV-val variance (the EPIKV authors' later key/value signals), and the per-slot statistics of cached keys
and values that EpiKV-Seg, its value swap and the hidden-state policies' value reserve share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._lazy import torch

from ..errors import EpiKVError
from ..signals import RollingStats
from .base import CacheView, Observes, Policy, StepObservation, check_window_over, window_tokens

SLOT_STATS = ("range", "var", "norm")


def check_stat(policy: str, setting: str, stat: str) -> None:
    if stat not in SLOT_STATS:
        raise EpiKVError(f"{policy}: {setting} must be one of {', '.join(SLOT_STATS)}, got {stat!r}")


_STACK = 1 << 22  # float32 elements reduced per call: a step's few tokens of every layer in one, bounded at eviction


def _reduce(x: torch.Tensor, stat: str) -> torch.Tensor:
    """x [..., head_dim] float32 -> the statistic over head_dim [...]."""
    if stat == "var":
        return x.var(dim=-1)  # unbiased
    if stat == "range":
        return x.amax(dim=-1) - x.amin(dim=-1)
    if stat == "norm":
        return x.norm(dim=-1)
    raise EpiKVError(f"unknown slot statistic {stat!r}; known: {', '.join(SLOT_STATS)}")


def slot_statistic(tensors: list[torch.Tensor], stat: str, device: torch.device) -> torch.Tensor:
    """Per slot: a statistic of the cached vector over head_dim, in float32, averaged over KV heads, then over layers.

    tensors: per layer [batch, kv_heads, n, head_dim] (keys or values). stat: "var" (unbiased variance), "range"
    (max - min) or "norm" (L2). Returns [batch, n] on `device`. Layers of one shape are reduced together, up to
    _STACK float32 elements at a time (one call for the tokens of a step, never a float32 copy of a whole cache)."""
    total, i = None, 0
    while i < len(tensors):
        shape = tensors[i].shape
        j = i + 1
        while j < len(tensors) and tensors[j].shape == shape and (j - i + 1) * tensors[i].numel() <= _STACK:
            j += 1
        x = torch.stack(tensors[i:j]).to(device, dtype=torch.float32)  # [layers, batch, kv_heads, n, head_dim]
        s = _reduce(x, stat).mean(dim=2).sum(dim=0)  # [batch, n]: mean over KV heads, summed over these layers
        total = s if total is None else total + s
        i = j
    return total / len(tensors)


def arrival_statistic(tensors: list[torch.Tensor], t: int, stat: str, valid: torch.Tensor) -> torch.Tensor:
    """slot_statistic of the t newest slots of every layer (the tokens a step just stored: their keys / values never
    change, so this is the statistic an eviction would read), 0 where not valid. tensors: per layer [batch,
    kv_heads, >= t, head_dim], the new tokens last; valid: [batch, t]. Returns [batch, t] on valid's device."""
    s = slot_statistic([x[:, :, -t:] for x in tensors], stat, valid.device)
    return s.masked_fill(~valid, 0.0)


@dataclass
class KVKeyVariance(Policy):
    """KV-key variance: score(t) = rolling mean over the trailing `window` = 64 tokens of the per-token key variance.

    From the EPIKV authors' later code (github stevenkolawole/epiphany-kv-cache, commit 121e62c, their `kv_key`;
    METHOD.md section 4). Per token: the unbiased variance over head_dim of its cached key (float32), averaged over KV
    heads, then layers, computed when the token enters the cache; the causal rolling mean over the trailing window of
    those values (newest included, padding excluded) is its score, frozen. Keeps prompt + recent + top-scored rest.
    Reads the new tokens' keys at arrival: no hidden states, no attention.
    """

    window: int = 64
    window_over: str = "decode"  # "decode": the window buffers decode tokens only (the authors' code); "all"

    name = "kv-key"
    paper = "arXiv:2606.26472 (authors' later code)"
    source: ClassVar[str] = "keys"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise EpiKVError(f"{self.name}: window must be at least 1, got {self.window}")
        check_window_over(self.name, self.window_over)

    def observes(self, n_layers):
        # the new tokens' keys (or values) only: the cache may refill its holes
        return Observes(arriving_kv=True, kv_parts="k" if self.source == "keys" else "v")

    def init_state(self, batch, n_layers, device):
        return {"stats": RollingStats(self.window)}

    def on_tokens(self, state, obs: StepObservation) -> dict[str, torch.Tensor]:
        t = obs.valid.shape[1]
        stored = obs.keys if self.source == "keys" else obs.values
        var = slot_statistic([x[:, :, -t:] for x in stored], "var", obs.valid.device)  # [batch, T]: the new tokens
        counted = window_tokens(obs, self.window_over)  # [batch, T]
        mean, _, _ = state["stats"].update(var[:, None], counted)  # [batch, 1, T]
        return {"score": torch.where(counted, mean[:, 0], torch.zeros_like(var))}

    def scores(self, state, view: CacheView) -> torch.Tensor:
        return view.token_data["score"]


@dataclass
class KVValueVariance(KVKeyVariance):
    """KV-val variance: as `kv-key` on the cached values (the authors' `kv_val`, commit 121e62c; METHOD.md section 4).

    score(t) = rolling mean over the trailing 64 tokens of the per-token value variance over head_dim (unbiased,
    float32), averaged over KV heads then layers, computed at arrival and frozen.
    """

    name = "kv-val"
    source = "values"
