from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from .base import Observes, Policy


@dataclass
class KeyDiff(Policy):
    """KeyDiff (Park et al., arXiv:2504.15364): key similarity based eviction, per layer and KV head.

    score(i) = -cos(k_i, anchor), anchor = mean of the L2-normalised cached keys of that head: the keys least
    similar to the mean direction are kept. Same prompt protection and recency window as EPIKV. Attention-free.
    """

    name = "keydiff"
    paper = "arXiv:2504.15364"
    granularity = "head"

    def observes(self, n_layers):
        return Observes(keys_values=True)

    def scores(self, state, view):
        dev = view.device
        real = (torch.arange(view.length, device=dev)[None, :] >= view.n_pad[:, None]).float()  # [batch, n]
        out = []
        for k in view.keys:
            kn = torch.nn.functional.normalize(k.to(dev).float(), dim=-1)  # [batch, kv_heads, n, dim]
            anchor = (kn * real[:, None, :, None]).sum(2) / real.sum(-1).clamp(min=1)[:, None, None]
            anchor = torch.nn.functional.normalize(anchor, dim=-1)  # [batch, kv_heads, dim]
            out.append(-(kn @ anchor.unsqueeze(-1)).squeeze(-1))  # [batch, kv_heads, n]
        return torch.stack(out, dim=1)
