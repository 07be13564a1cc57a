from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .._lazy import torch

from ..calibration.query_stats import pair_magnitude, window_moments
from ..errors import EpiKVError
from .base import Policy
from .rope import FutureQueries, group_heads, mean_phase, rotate


def triattention_scores(q: torch.Tensor, q_valid: torch.Tensor, k: torch.Tensor, next_pos: torch.Tensor,
                        inv_freq: torch.Tensor, rope_scaling: float, offsets: torch.Tensor) -> torch.Tensor:
    """One layer's TriAttention scores, [batch, kv_heads, n].

    q [batch, heads, w, dim] pre-RoPE queries, q_valid [batch, w]; k [batch, kv_heads, n, dim] cached (rotated)
    keys; next_pos [batch]; offsets [m] future distances from the newest token. Per RoPE pair f, with the query
    centre c_f = E[q_f] (a complex number), a key's expected logit at distance D is Re(c_f e^{i w_f (t + D)}
    conj(k_f)) summed over f (k is stored rotated by its own position, so the distance is exact per frequency),
    averaged over the offsets; plus the norm term sum_f (E|q_f| - |c_f|) |k_f|, what the centre misses of the
    query's length. Both over sqrt(dim); mean over the query heads of a GQA group."""
    b, heads, _, d = q.shape
    mom = window_moments(q, q_valid, cov=False)
    fut = (next_pos.to(q.device) - 1)[:, None] + offsets.to(q.device)[None, :]  # [batch, m] query positions
    c, s = mean_phase(inv_freq.to(q.device), fut)  # [batch, dim // 2]
    centre = rotate(mom.mean, c[:, None], s[:, None]) * rope_scaling  # [batch, heads, dim]
    kk = group_heads(k.float(), heads)  # [batch, heads, n, dim]
    trig = (kk @ centre[..., None]).squeeze(-1)  # [batch, heads, n]
    spread = (mom.pair_abs - pair_magnitude(mom.mean)) * rope_scaling  # [batch, heads, dim // 2]
    norm = (pair_magnitude(kk) * spread[:, :, None]).sum(-1)  # [batch, heads, n]
    score = (trig + norm) / math.sqrt(d)
    kv = k.shape[1]
    return score.reshape(b, kv, heads // kv, -1).mean(2)


@dataclass
class TriAttention(FutureQueries, Policy):
    """TriAttention (Mao et al., arXiv:2604.04921): the query centre's expected logit plus a norm term, per KV head.

    Per layer and KV head, a key's expected pre-softmax logit under the query centre at geometric future distances,
    exact per RoPE frequency, plus a norm term.

    Pre-RoPE queries concentrate around a fixed centre per head, so their logit with a key depends on the distance
    through a trigonometric series. The centre and the mean |q_f| per RoPE pair are estimated online from the last
    `window` queries (the paper calibrates them offline); distances 1, 2, 4, ..., max_offset after the newest token,
    from the absolute position (see `triattention_scores`). Prompt kept; compresses every tau = 128 steps (at
    budget + 128 tokens, as the paper). Reads query states (their moments), not attention weights.
    """

    attention_free: ClassVar[bool] = False  # scores keys against recomputed queries (their moments)

    tau: int = 128
    window: int = 128
    max_offset: int = 65536  # the largest future distance (powers of 2 up to it)

    name = "triattention"
    paper = "arXiv:2604.04921"
    granularity = "head"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.max_offset < 1:
            raise EpiKVError(f"{self.name}: window and max_offset must be positive")

    def offsets(self) -> torch.Tensor:
        return 2.0 ** torch.arange(int(math.log2(self.max_offset)) + 1)  # [m]: 1, 2, 4, ...

    def scores(self, state, view):
        dev = view.device
        offs = self.offsets()
        out = []
        for q, k in zip(view.queries, view.keys):
            w = q.shape[2]
            out.append(triattention_scores(q.to(dev), view.query_valid[:, -w:].to(dev), k.to(dev), state["next"],
                                           view.rope_inv_freq, view.rope_scaling, offs))
        return torch.stack(out, dim=1)  # [batch, layers, kv_heads, n]
