from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from ..errors import EpiKVError
from .snapkv import SnapKV, window_attention


def _newest_over(s: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of s [..., w]: (found [...] bool, index [...] of the largest column with s > threshold)."""
    rev = (s > threshold).view(torch.uint8).flip(-1)  # newest column first, one byte per entry
    last = rev.argmax(-1, keepdim=True)  # the first maximum: the newest column over the threshold, if any
    return rev.gather(-1, last).squeeze(-1).bool(), (s.shape[-1] - 1) - last.squeeze(-1)


def redundancy(k: torch.Tensor, real: torch.Tensor, threshold: float, block: int = 128) -> torch.Tensor:
    """R-KV redundancy per KV head: k [batch, kv_heads, n, dim], real [batch, n] bool -> [batch, kv_heads, n].

    The rule of `Zefan-Cai/R-KV`, `rkv/utils.py` (`cal_similarity`, retain direction "last"): keys normalised,
    cosine matrix S [n, n] with the diagonal set to 0; in each row i ONE entry is zeroed, S[i, j] for the largest
    (newest) column j with S[i, j] > threshold, or the first token's column when there is none; redundancy of
    token j = mean of column j over all rows, then a softmax over all positions. Padding rows and columns are
    left out (a padded row gives what the unpadded row would).

    Computed without the n x n matrix, which cost 1 s per layer and eviction at n = 2064: the column sums of S are
    k_j . (sum_i k_i) - k_j . k_j (in float64), and each row's newest similar column is searched newest-first in
    column blocks (`block`, then 4x wider), only for the rows not found yet: on real keys almost every row finds
    one among the newest columns. Equal to the n x n version up to float rounding."""
    b, h, n, d = k.shape
    k = k.float()
    kn = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    kn = kn.masked_fill(~real[:, None, :, None], 0.0)  # padding: cosine 0 with everything, as the masked S entries
    first = (~real).sum(-1).clamp(max=n - 1)[:, None, None]  # [batch, 1, 1] first real slot (left padding)
    rows = torch.arange(n, device=k.device)
    newest = first.expand(b, h, n).clone()  # [batch, kv_heads, n]: the fallback, the first token's column
    todo = torch.ones(b, h, n, dtype=torch.bool, device=k.device)  # rows still searching
    hi, w = n, max(1, block)
    while hi > 0:
        lo = max(0, hi - w)
        m = int(todo.sum(-1).max())
        if m == 0:
            break
        if m == n:  # every row: one batched product, no gather
            idx = rows.expand(b, h, n)
            q = kn
        else:  # the rows still searching first (stable), padded up to m with rows already done
            idx = todo.to(torch.uint8).sort(dim=-1, descending=True, stable=True).indices[..., :m]  # [batch, kv_heads, m]
            q = kn.gather(-2, idx[..., None].expand(b, h, m, d))
        s = q @ kn[:, :, lo:hi].transpose(-1, -2)  # [batch, kv_heads, m, hi - lo]
        # the diagonal is 0, as in S (a row's own column may lie in this block)
        own = idx - lo
        inside = (own >= 0) & (own < hi - lo)
        s.scatter_(-1, own.clamp(0, hi - lo - 1)[..., None], s.gather(-1, own.clamp(0, hi - lo - 1)[..., None])
                   .masked_fill(inside[..., None], 0.0))
        found, col = _newest_over(s, threshold)
        found &= todo.gather(-1, idx)  # padding rows of the gather change nothing
        # (a padded column, below `first`, is never the newest: it has cosine 0, and when 0 > threshold a real row's
        # own diagonal entry, newer, is over the threshold too)
        newest.scatter_(-1, idx, torch.where(found, col + lo, newest.gather(-1, idx)))
        todo.scatter_(-1, idx, todo.gather(-1, idx) & ~found)
        hi, w = lo, 4 * w
    # column sums of S (diagonal 0) from the sum of the normalised keys; float64 keeps them as exact as the matmul's
    kd = kn.double()
    colsum = (kd @ kd.sum(-2)[..., None]).squeeze(-1) - (kd * kd).sum(-1)  # [batch, kv_heads, n]
    # minus, in each row i, the zeroed entry S[i, newest(i)] (0 when newest(i) = i, the diagonal)
    partner = kd.gather(-2, newest[..., None].expand(b, h, n, d))
    zeroed = ((kd * partner).sum(-1)).masked_fill(newest == rows, 0.0)
    colsum.scatter_add_(-1, newest, -zeroed)
    red = (colsum / real.sum(-1).clamp(min=1)[:, None, None]).float()  # column mean over the real rows
    return red.masked_fill(~real[:, None, :], float("-inf")).softmax(-1)


@dataclass
class RKV(SnapKV):
    """R-KV, redundancy-aware KV compression for reasoning models (Cai et al., arXiv:2505.24133), per KV head.

    Every tau = 128 steps: importance = SnapKV's decode score over the keys before the 8-query window (query heads
    of a GQA group max-pooled on logits before the softmax, mean over the queries, max-pooled over positions with
    kernel 7; see `window_attention`); redundancy = per-head key cosine similarity (see `redundancy`);
    score = lam * importance - (1 - lam) * redundancy, lam = 0.1 (the paper and the authors' run scripts; the
    class default in their code, `rkv/compression/r1_kv.py`, is 0.07). Keeps the 8 newest + the top (K - 8) per
    head; the prompt is not protected. Main attention stays SDPA.
    """

    lam: float = 0.1
    threshold: float = 0.5

    name = "rkv"
    paper = "arXiv:2505.24133"

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.lam <= 1:
            raise EpiKVError(f"rkv: lam must be in [0, 1], got {self.lam}")

    def scores(self, state, view):
        imp = window_attention(view, self.kernel, self.pool, self.group)  # [batch, layers, kv_heads, n]
        real = torch.arange(view.length, device=view.device)[None, :] >= view.n_pad.to(view.device)[:, None]
        red = torch.stack([redundancy(k.to(view.device), real, self.threshold) for k in view.keys], dim=1)
        return self.lam * imp - (1 - self.lam) * red
