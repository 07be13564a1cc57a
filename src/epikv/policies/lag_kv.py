from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from ..signals import lag_normalised_spread
from .base import CacheView, Observes, Policy


@dataclass
class LagKVVariant(Policy):
    """EPIKV's lag-normalised KV variant (the AIME-24 37% of arXiv:2606.26472); not the original LagKV.

    At each eviction: keys (and values) averaged over all layers; the cache cut into chunks of `lag` tokens from
    position 0; chunk p >= 1 min-max normalised per head and channel against chunk p - 1 (chunk 0 raw); token score
    = std over head_dim averaged over heads, on K plus on V. Keeps prompt + recent window + global top-k.
    Reads only cached keys and values: no hidden states, no attention.
    """

    lag: int = 128

    name = "lag-kv"
    paper = "arXiv:2606.26472"

    def __post_init__(self):
        super().__post_init__()
        if self.lag < 1:
            from ..errors import EpiKVError

            raise EpiKVError(f"lag must be at least 1, got {self.lag}")

    def observes(self, n_layers):
        return Observes(keys_values=True)

    def scores(self, state, view: CacheView) -> torch.Tensor:
        dev = view.device
        k = sum(x.to(dev, dtype=torch.float32) for x in view.keys) / len(view.keys)  # [batch, kv_heads, n, dim]
        v = sum(x.to(dev, dtype=torch.float32) for x in view.values) / len(view.values)
        return lag_normalised_spread(k, self.lag) + lag_normalised_spread(v, self.lag)
