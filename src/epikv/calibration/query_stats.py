"""Per-head statistics of pre-RoPE query states: what TriAttention and Expected Attention score keys against.

Both papers model the queries a head will issue as a distribution in the space before the rotary embedding, where
they stay put as the position moves (TriAttention's Q concentration, arXiv:2604.04921; Expected Attention's Gaussian,
arXiv:2510.00636). `window_moments` takes them over the last w queries of the sequence being generated.
Channel f pairs with channel f + head_dim / 2 (transformers' rotate_half layout): `pair_magnitude` is the length of
that 2-D component, the "frequency" a RoPE angle acts on.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch


def pair_magnitude(q: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] -> [..., head_dim // 2]: |q_f| of each RoPE pair (f, f + head_dim / 2)."""
    h = q.shape[-1] // 2
    return torch.hypot(q[..., :h], q[..., h:])


@dataclass
class QueryMoments:
    """Moments of a head's pre-RoPE queries. mean [..., heads, dim]; cov [..., heads, dim, dim] (None when not
    asked); pair_abs [..., heads, dim // 2]: the mean of |q_f| (not |mean q_f|: their gap is how spread a pair is)."""

    mean: torch.Tensor
    cov: torch.Tensor | None
    pair_abs: torch.Tensor


def window_moments(q: torch.Tensor, valid: torch.Tensor, cov: bool = True) -> QueryMoments:
    """Moments over the real queries of a window. q [batch, heads, w, dim] (pre-RoPE), valid [batch, w] bool.
    The covariance is the unbiased sample covariance (zero for a single query)."""
    q = q.float()
    m = valid.to(q.device, torch.float32)[:, None, :, None]  # [batch, 1, w, 1]
    n = m.sum(2).clamp(min=1)  # [batch, 1, 1]
    mean = (q * m).sum(2) / n  # [batch, heads, dim]
    pair_abs = (pair_magnitude(q) * m).sum(2) / n  # [batch, heads, dim // 2]
    c = None
    if cov:
        x = (q - mean[:, :, None]) * m  # [batch, heads, w, dim], padding rows zeroed
        c = x.transpose(-1, -2) @ x / (n[..., None] - 1).clamp(min=1)  # [batch, heads, dim, dim]
    return QueryMoments(mean, c, pair_abs)

