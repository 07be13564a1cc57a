from __future__ import annotations

import math
from dataclasses import dataclass

from .._lazy import torch

from ..errors import EpiKVError
from .learned import LearnedMean


def token_age(view) -> torch.Tensor:
    """[batch, n] each stored token's age t - i: the newest stored token's true position minus its own (0 for the
    newest; true positions, so evictions do not shorten it)."""
    pos = view.token_data["pos"]
    return (pos.amax(dim=-1, keepdim=True) - pos).float()


@dataclass
class LearnedDecay(LearnedMean):
    """epikv-learned-decay: epikv-learned-mean's arrival score decayed by a retention rate raised to the token's age.

    TRIM-KV (arXiv:2512.03324): a token's importance at step t is its retention gate beta_i raised to its age t - i,
    so an old token stays only while it was important enough on arrival. Rule: priority_i(t) = exp(s_i) *
    beta^(t - i), kept in the arrival score's log scale as s_i + (t - i) * ln(beta), s_i epikv-learned-mean's score
    (the mean over layers and KV heads of the fitted log-attention score, fixed on arrival), t the newest stored
    token's true position. Reads the hidden states entering each layer (as epikv-learned-mean) and the tokens' true
    positions; no attention. `beta` is ONE constant for every token, a field, not fitted: `epikv calibrate` does not
    fit a per-token rate yet, and with one beta the order is epikv-learned-age's with penalty = -ln(beta).
    """

    beta: float = 0.999  # per-token retention rate per step of age (half-life ln 2 / -ln beta, about 693 tokens)

    name = "epikv-learned-decay"
    paper = "arXiv:2512.03324 (TRIM-KV), arXiv:2601.07891 (KVzap)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.beta <= 1:
            raise EpiKVError(f"{self.name}: beta must be in (0, 1], got {self.beta}")

    def scores(self, state, view):
        return view.token_data["score"] + token_age(view) * math.log(self.beta)
