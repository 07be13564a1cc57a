from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .._lazy import torch

from ..calibration.query_stats import window_moments
from ..errors import EpiKVError
from .base import Policy
from .rope import FutureQueries, group_heads, mean_phase, rotate, rotation_matrix


def expected_attention_scores(q: torch.Tensor, q_valid: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              key_pad: torch.Tensor, next_pos: torch.Tensor, inv_freq: torch.Tensor,
                              rope_scaling: float, n_future: int, cov: bool, epsilon: float) -> torch.Tensor:
    """One layer's Expected Attention scores, [batch, kv_heads, n].

    q [batch, heads, w, dim] pre-RoPE queries of the window, q_valid [batch, w]; k, v [batch, kv_heads, n, dim]
    (keys as cached, rotated); key_pad [batch, n] bool; next_pos [batch] absolute position of the next token."""
    b, heads, _, d = q.shape
    mom = window_moments(q, q_valid, cov=cov)  # mean [batch, heads, dim], cov [batch, heads, dim, dim]
    fut = next_pos.to(q.device)[:, None] + torch.arange(n_future, device=q.device)  # [batch, n_future]
    c, s = mean_phase(inv_freq.to(q.device), fut)  # [batch, dim // 2]
    c, s = c * rope_scaling, s * rope_scaling
    mu = rotate(mom.mean, c[:, None], s[:, None])  # [batch, heads, dim]: mean future query, RoPE averaged
    kk = group_heads(k.float(), heads)  # [batch, heads, n, dim]
    logit = (kk @ mu[..., None]).squeeze(-1) / math.sqrt(d)  # [batch, heads, n]
    if cov:
        r = rotation_matrix(c, s)[:, None]  # [batch, 1, dim, dim]
        sig = r @ mom.cov @ r.transpose(-1, -2)  # [batch, heads, dim, dim]
        logit = logit + ((kk @ sig) * kk).sum(-1) / (2 * d)  # log E[exp(q.k / sqrt d)] for a Gaussian q
    logit = logit.masked_fill(key_pad.to(q.device)[:, None, :], float("-inf"))
    p = logit.softmax(-1).nan_to_num()  # [batch, heads, n]
    kv = k.shape[1]
    p = p.reshape(b, kv, heads // kv, -1).mean(2)  # [batch, kv_heads, n]
    return (p + epsilon) * v.float().norm(dim=-1)


@dataclass
class ExpectedAttention(FutureQueries, Policy):
    """Expected Attention (Devoto et al., arXiv:2510.00636): expected future attention x value norm, per KV head.

    Per layer and KV head, the attention future queries are expected to pay a key, times the norm of its value.

    Future queries are modelled as a Gaussian in pre-RoPE space (mean and covariance of the last `window` queries of
    each query head, recomputed from q_proj), rotated by the RoPE rotation averaged over the `n_future` next
    positions counted from the sequence's absolute position (not the stored length, which eviction shortens). For a
    key k: log E[exp(q.k / sqrt d)] = mu.k / sqrt d + k' Sigma k / (2 d); softmax over the head's keys, mean over
    the query heads of a GQA group, plus `epsilon`, times ||v||. The prompt is protected (the reference decode path
    leaves it unprotected). Reads query states (their statistics), not attention weights.
    """

    attention_free: ClassVar[bool] = False  # scores keys against recomputed queries (their moments)

    tau: int = 16
    window: int = 128  # recent queries whose moments model the future ones
    n_future: int = 512  # next positions the RoPE rotation is averaged over
    cov: bool = True  # the covariance term (False: the mean query only)
    epsilon: float = 0.0

    name = "expected-attention"
    paper = "arXiv:2510.00636"
    granularity = "head"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 2 or self.n_future < 1:
            raise EpiKVError(f"{self.name}: window must be at least 2 and n_future at least 1")

    def scores(self, state, view):
        dev = view.device
        pad = torch.arange(view.length, device=dev)[None, :] < view.n_pad.to(dev)[:, None]  # [batch, n]
        out = []
        for q, k, v in zip(view.queries, view.keys, view.values):
            w = q.shape[2]
            out.append(expected_attention_scores(
                q.to(dev), view.query_valid[:, -w:].to(dev), k.to(dev), v.to(dev), pad, state["next"],
                view.rope_inv_freq, view.rope_scaling, self.n_future, self.cov, self.epsilon))
        return torch.stack(out, dim=1)  # [batch, layers, kv_heads, n]
