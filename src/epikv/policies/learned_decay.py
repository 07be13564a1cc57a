from __future__ import annotations

import math
from dataclasses import dataclass

from .._lazy import torch

from ..errors import EpiKVError
from .learned import LearnedMean, LearnedWeights


def token_age(view) -> torch.Tensor:
    """[batch, n] each stored token's age t - i: the newest stored token's true position minus its own (0 for the
    newest; true positions, so evictions do not shorten it)."""
    pos = view.token_data["pos"]
    return (pos.amax(dim=-1, keepdim=True) - pos).float()


@dataclass
class LearnedDecay(LearnedMean):
    """epikv-learned-decay: epikv-learned-mean's arrival score decayed by each token's own rate raised to its age.

    TRIM-KV (arXiv:2512.03324): a token's importance at step t is its retention rate beta_i raised to its age t - i,
    beta_i a function of the token's hidden state, fitted against the attention the token receives over a horizon
    of later queries, so an old token stays only while it was important enough on arrival and decays slowly.
    Rule: priority_i(t) = exp(s_i) * beta_i^(t - i), kept in the arrival score's log scale as s_i + (t - i) *
    log_beta_i, t the newest stored token's true position. s_i is epikv-learned-mean's score (the mean over layers
    and KV heads of the fitted log-attention score, fixed on arrival); log_beta_i the mean over the same layers and
    KV heads of the weights' decay map min(0, x . decay_weight + decay_bias) (calibrate.decay_targets: a linear map
    of the same hidden state, Ridge-fitted to the per-token slope of log attention received against lag), also
    computed once on arrival and stored per token ("log_beta"). Averaging both in the log scale makes the priority
    the mean over layers and KV heads of each head's own decayed log score. Reads the hidden states entering each
    layer (as epikv-learned-mean) and the tokens' true positions; no attention.

    per_token=False: ONE constant rate `beta` for every token instead (a setting, not fitted; the order is then
    epikv-learned-age's with penalty = -ln(beta)). per_token=True (default) with weights that carry no decay map
    (files fitted before it) is refused in one line rather than silently run as the constant rule: the name would
    then stand for two rules in measurements.
    """

    beta: float = 0.999  # the constant rate per step of age, read only with per_token=False (half-life ~693 tokens)
    per_token: bool = True  # the fitted per-token rate of the weights' decay map (TRIM-KV); False: the constant beta

    name = "epikv-learned-decay"
    ages = True
    paper = "arXiv:2512.03324 (TRIM-KV), arXiv:2601.07891 (KVzap)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.beta <= 1:
            raise EpiKVError(f"{self.name}: beta must be in (0, 1], got {self.beta}")

    def _need_decay(self, lw: LearnedWeights) -> None:
        if self.per_token and not lw.has_decay:
            raise EpiKVError(f"{self.name}: the weights {lw.describe()} carry no decay map (fitted before per-token "
                             f"retention rates): refit them with `epikv calibrate`, or set {self.name}.per_token="
                             "false to decay every token by the constant beta")

    def check_model(self, fingerprint: str, n_layers: int) -> None:
        super().check_model(fingerprint, n_layers)
        self._need_decay(self._checked[1])

    def init_state(self, batch, n_layers, device):
        state = super().init_state(batch, n_layers, device)
        self._need_decay(state["_lw"])
        return state

    def on_tokens(self, state, obs):
        if not self.per_token:
            return super().on_tokens(state, obs)
        score, log_beta = self.raw_scores(state, obs, decay=True)  # [batch, layers, kv_heads, T] each
        return {"score": score.mean(dim=(1, 2)), "log_beta": log_beta.mean(dim=(1, 2))}

    def scores(self, state, view):
        age = token_age(view)
        rate = view.token_data["log_beta"] if self.per_token else math.log(self.beta)
        return view.token_data["score"] + age * rate
