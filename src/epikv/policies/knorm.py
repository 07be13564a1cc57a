from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from .base import Observes, Policy


@dataclass
class KNorm(Policy):
    """K-norm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
    arXiv:2406.11430), per layer and KV head.

    Keeps the keys with the LOWEST L2 norm (they draw the most attention). Layers `skip_layers` = 0 and 1 are not
    compressed, as in the paper: they keep every token, so layers differ in length. That needs SDPA without a
    padding mask, so padded batches are refused, and once lengths differ the engine feeds a chunk token by token
    with one eviction at its end (the same result, slower). Set skip_layers to () to compress every layer, allow
    padded batches and chunked feeds. Same prompt protection and recency window as EPIKV. Attention-free.
    """

    skip_layers: tuple[int, ...] = (0, 1)

    name = "knorm"
    paper = "arXiv:2406.11430"
    granularity = "head"

    def observes(self, n_layers):
        return Observes(keys_values=True)

    def uncompressed_layers(self, n_layers):
        return tuple(l for l in self.skip_layers if l < n_layers - 1)  # always compress at least the last layer

    def scores(self, state, view):
        n, dev = view.length, view.device
        out = []
        for k in view.keys:
            if k.shape[2] != n:  # an uncompressed layer (longer); never compacted, any priority will do
                out.append(torch.zeros(k.shape[0], k.shape[1], n, device=dev))
            else:
                out.append(-k.to(dev).float().norm(dim=-1))  # [batch, kv_heads, n]
        return torch.stack(out, dim=1)
