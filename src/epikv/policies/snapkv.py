from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import EpiKVError
from .base import CacheView, Observes, Policy


def window_attention(view: CacheView, kernel: int, pool: str = "max") -> torch.Tensor:
    """Mean softmax attention of the last w cached queries over the cache, per layer and KV head, then pooled.

    softmax(q K^T / sqrt(d)) is recomputed from the rotated queries the cache kept (view.queries), with padding
    keys masked and causality inside the window (the w newest stored slots are those queries' own tokens, newest
    last); query heads of a GQA group and the real queries are averaged. Returns [batch, layers, kv_heads, n].
    """
    n, dev = view.length, view.device
    out = []
    for q, k in zip(view.queries, view.keys):
        q, k = q.to(dev).float(), k.to(dev).float()  # [batch, heads, w, dim], [batch, kv_heads, n, dim]
        b, heads, w, d = q.shape
        kv = k.shape[1]
        qg = q.reshape(b, kv, heads // kv * w, d)  # query heads of one KV head side by side
        logits = qg @ k.transpose(-1, -2) / d**0.5  # [batch, kv_heads, group * w, n]
        key_idx = torch.arange(n, device=dev)
        q_slot = (n - w + torch.arange(w, device=dev)).repeat(heads // kv)  # each query's own slot
        hide = (key_idx[None, None, None, :] < view.n_pad[:, None, None, None]) | (key_idx[None, :] > q_slot[:, None])
        att = logits.masked_fill(hide, float("-inf")).softmax(-1).nan_to_num()
        qv = view.query_valid[:, -w:].to(dev).float().repeat(1, heads // kv)  # [batch, group * w]
        att = (att * qv[:, None, :, None]).sum(2) / qv.sum(-1).clamp(min=1)[:, None, None]  # [batch, kv_heads, n]
        if kernel > 1:
            flat = att.reshape(b * kv, 1, n)
            pooled = (F.max_pool1d if pool == "max" else F.avg_pool1d)(flat, kernel, 1, kernel // 2)
            att = pooled.reshape(b, kv, -1)[..., :n]
        out.append(att)
    return torch.stack(out, dim=1)


@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al., arXiv:2404.14469), the decode variant used by R-KV: per layer and KV head.

    Every tau = 128 steps: importance = mean softmax attention of the last `window` = 8 queries over the cache,
    recomputed from cached queries (the main attention stays SDPA), query heads of a GQA group pooled, then
    max-pooled over positions with kernel 7; keeps the window (the newest tokens) + the top (K - window) per head.
    The prompt is not protected. SnapKV's original prefill setting: window 32, avg pooling, kernel 5.
    """

    tau: int = 128
    protect_prompt: bool = False
    n_sink: int = 0
    window: int = 8
    kernel: int = 7
    pool: str = "max"

    name = "snapkv"
    paper = "arXiv:2404.14469"
    granularity = "head"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.kernel < 1 or self.pool not in ("max", "avg"):
            raise EpiKVError("snapkv/rkv: window and kernel must be positive, pool 'max' or 'avg'")
        if self.recent is not None and self.recent < self.window:
            raise EpiKVError(f"{self.name}: recent ({self.recent}) must be at least the query window ({self.window})")

    def recent_window(self, budget):
        return self.window if self.recent is None else self.recent

    def observes(self, n_layers):
        return Observes(keys_values=True, queries=self.window)

    def scores(self, state, view):
        return window_attention(view, self.kernel, self.pool)
