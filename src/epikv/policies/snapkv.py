from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .._lazy import torch
from .._lazy import F

from ..errors import EpiKVError
from .base import CacheView, Observes, Policy

GROUP_POOLS = ("max", "mean")


def window_logits(q: torch.Tensor, k: torch.Tensor, group: str = "max") -> torch.Tensor:
    """q.K / sqrt(d) of the window's queries over the keys, query heads of a GQA group pooled BEFORE any softmax.

    q [batch, heads, w, dim], k [batch, kv_heads, m, dim] -> [batch, kv_heads, w, m]. group "max" (R-KV's
    default) or "mean" over the heads that share a KV head (the rule of `Zefan-Cai/R-KV`, `rkv/utils.py`,
    `compute_attention_scores`)."""
    b, heads, w, d = q.shape
    kv = k.shape[1]
    qg = q.float().reshape(b, kv, heads // kv, w, d)  # [batch, kv_heads, group, w, dim]
    logits = qg @ k.float()[:, :, None].transpose(-1, -2) / math.sqrt(d)  # [batch, kv_heads, group, w, m]
    return logits.amax(2) if group == "max" else logits.mean(2)


def window_attention(view: CacheView, kernel: int, pool: str = "max", group: str = "max") -> torch.Tensor:
    """Importance of every stored token outside the observation window, per layer and KV head.

    The w newest stored slots are the window (the tokens of the w cached queries, newest last, view.queries). As in
    R-KV's code (`Zefan-Cai/R-KV`, `rkv/compression/r1_kv.py`): the logits of the query heads of a GQA group are
    pooled first (`window_logits`), then each window query's softmax runs over the keys BEFORE the window only
    (the window itself is always kept, so it is not scored), padding keys masked; mean over the real queries;
    then a 1-D pool over positions (kernel, stride 1, same padding), over those keys only.
    Returns [batch, layers, kv_heads, n]; the w window entries are 0 (they are protected by the recency rule).
    """
    n, dev = view.length, view.device
    out = []
    for q, k in zip(view.queries, view.keys):
        q, k = q.to(dev), k.to(dev)  # [batch, heads, w, dim], [batch, kv_heads, n, dim]
        b, _, w, _ = q.shape
        m = max(n - w, 0)  # keys outside the window
        att = torch.zeros(b, k.shape[1], n, device=dev)
        if m:
            logits = window_logits(q, k[:, :, :m], group)  # [batch, kv_heads, w, m]
            pad = torch.arange(m, device=dev)[None, :] < view.n_pad.to(dev)[:, None]  # [batch, m]
            p = logits.masked_fill(pad[:, None, None, :], float("-inf")).softmax(-1).nan_to_num()
            qv = view.query_valid[:, -w:].to(dev).float()  # [batch, w]
            p = (p * qv[:, None, :, None]).sum(2) / qv.sum(-1).clamp(min=1)[:, None, None]  # [batch, kv_heads, m]
            if kernel > 1:
                p = (F.max_pool1d if pool == "max" else F.avg_pool1d)(p, kernel, 1, kernel // 2)[..., :m]
            att[..., :m] = p
        out.append(att)
    return torch.stack(out, dim=1)


@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al., arXiv:2404.14469), the decode variant R-KV runs: per layer and KV head.

    Every tau = 128 steps: importance = softmax attention of the last `window` = 8 queries (recomputed from cached
    queries; the main attention stays SDPA) over the keys before the window, query heads of a GQA group pooled by
    `group` = max over their logits before the softmax, mean over the queries, max-pooled over positions with
    kernel 7 (see `window_attention`; rule of `Zefan-Cai/R-KV`, `rkv/utils.py`). Keeps the window (the newest
    tokens) + the top (K - window) per head. The prompt is not protected. SnapKV's original prefill setting:
    window 32, avg pooling, kernel 5.
    """

    # it computes softmax(qK) of its window's queries: attention scores, if not the engine's own (SDPA stays)
    attention_free: ClassVar[bool] = False

    tau: int = 128
    protect_prompt: bool = False
    n_sink: int = 0
    window: int = 8
    kernel: int = 7
    pool: str = "max"  # over positions
    group: str = "max"  # over the query heads of a GQA group, on logits

    name = "snapkv"
    paper = "arXiv:2404.14469"
    granularity = "head"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.kernel < 1 or self.pool not in ("max", "avg") or self.group not in GROUP_POOLS:
            raise EpiKVError(f"{self.name}: window and kernel must be positive, pool 'max' or 'avg', "
                             f"group 'max' or 'mean'")
        if self.recent is not None and self.recent < self.window:
            raise EpiKVError(f"{self.name}: recent ({self.recent}) must be at least the query window ({self.window})")

    def recent_window(self, budget):
        return self.window if self.recent is None else self.recent

    def observes(self, n_layers):
        return Observes(keys_values=True, queries=self.window)

    def scores(self, state, view):
        return window_attention(view, self.kernel, self.pool, self.group)
