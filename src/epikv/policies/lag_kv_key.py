from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from ..signals import lag_normalised_spread
from .base import CacheView, Observes
from .lag_kv import LagKVVariant


@dataclass
class LagKVKey(LagKVVariant):
    """Lag-KV on keys only: `lag-kv` (METHOD.md section 3) without the value term.

    The authors' `lag_kv_key` (github stevenkolawole/epiphany-kv-cache, commit 121e62c; METHOD.md section 4). At each
    eviction: keys averaged over all layers; chunks of `lag` = 128 slots from slot 0; chunk p >= 1 min-max normalised
    per head and channel against chunk p - 1 (chunk 0 raw); score = std over head_dim, averaged over heads. Keeps
    prompt + recent window + global top-k. Reads only cached keys.
    """

    name = "lag-kv-key"

    def observes(self, n_layers):
        return Observes(keys_values=True, kv_parts="k")

    def scores(self, state, view: CacheView) -> torch.Tensor:
        dev = view.device
        k = sum(x.to(dev, dtype=torch.float32) for x in view.keys) / len(view.keys)  # [batch, kv_heads, n, dim]
        return lag_normalised_spread(k, self.lag)
