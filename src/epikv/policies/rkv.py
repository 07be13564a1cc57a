from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import EpiKVError
from .snapkv import SnapKV, window_attention


def redundancy(k: torch.Tensor, real: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV redundancy per head: k [batch, kv_heads, n, dim], real [batch, n] bool -> [batch, kv_heads, n].

    Cosine similarity of normalised keys, diagonal zeroed; where a pair is above `threshold` only the newest copy
    is spared (its similarity to older copies is zeroed); row mean; softmax over real tokens."""
    kn = torch.nn.functional.normalize(k.float(), dim=-1)
    sim = kn @ kn.transpose(-1, -2)  # [batch, kv_heads, n, n]
    pair = real[:, None, :, None] & real[:, None, None, :]
    sim = sim * pair * (1 - torch.eye(k.shape[2], device=k.device))
    close = sim > threshold
    has_newer = close.triu(diagonal=1).any(-1)  # a newer near-copy exists
    sim = sim.masked_fill(close & ~has_newer[..., None], 0.0)  # the newest copy is not redundant
    red = sim.sum(-1) / real.sum(-1).clamp(min=1)[:, None, None]
    return red.masked_fill(~real[:, None, :], float("-inf")).softmax(-1)


@dataclass
class RKV(SnapKV):
    """R-KV, redundancy-aware KV compression for reasoning models (Cai et al., arXiv:2505.24133), per KV head.

    Every tau = 128 steps: importance = SnapKV's decode score (mean softmax attention of the last 8 cached queries,
    recomputed, max-pooled with kernel 7); redundancy = per-head key cosine similarity (see `redundancy`);
    score = lam * importance - (1 - lam) * redundancy with lam = 0.1 (the paper; the authors' code uses 0.07).
    Keeps the 8 newest + the top (K - 8) per head; the prompt is not protected. Main attention stays SDPA.
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
        imp = window_attention(view, self.kernel, self.pool)  # [batch, layers, kv_heads, n]
        real = torch.arange(view.length, device=view.device)[None, :] >= view.n_pad[:, None]
        red = torch.stack([redundancy(k.to(view.device), real, self.threshold) for k in view.keys], dim=1)
        return self.lam * imp - (1 - self.lam) * red
