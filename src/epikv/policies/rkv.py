from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import EpiKVError
from .snapkv import SnapKV, window_attention


def redundancy(k: torch.Tensor, real: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV redundancy per KV head: k [batch, kv_heads, n, dim], real [batch, n] bool -> [batch, kv_heads, n].

    The rule of `Zefan-Cai/R-KV`, `rkv/utils.py` (`cal_similarity`, retain direction "last"): keys normalised,
    cosine matrix S [n, n] with the diagonal set to 0; in each row i ONE entry is zeroed, S[i, j] for the largest
    (newest) column j with S[i, j] > threshold, or the first token's column when there is none; redundancy of
    token j = mean of column j over all rows, then a softmax over all positions. Padding rows and columns are
    left out (a padded row gives what the unpadded row would)."""
    b, _, n, _ = k.shape
    k = k.float()
    kn = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    # n x n per head on every eviction: edited in place, one byte per entry for the threshold test (the first,
    # out-of-place version spent 2x the time in copies and an int64 candidate matrix)
    sim = kn @ kn.transpose(-1, -2)  # [batch, kv_heads, n, n]
    if not bool(real.all()):
        sim.masked_fill_(~(real[:, None, :, None] & real[:, None, None, :]), 0.0)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    first = (~real).sum(-1).clamp(max=n - 1)[:, None, None]  # [batch, 1, 1] first real slot (left padding)
    rev = (sim > threshold).view(torch.uint8).flip(-1)  # [batch, kv_heads, n, n], newest column first
    last = rev.argmax(-1, keepdim=True)  # the first maximum: the newest column over the threshold, if any
    found = rev.gather(-1, last).bool()
    newest = torch.where(found, torch.maximum((n - 1) - last, first[..., None]), first[..., None])
    sim.scatter_(-1, newest, 0.0)  # the newest similar copy is not counted against i
    red = sim.sum(-2) / real.sum(-1).clamp(min=1)[:, None, None]  # column mean over the real rows
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
