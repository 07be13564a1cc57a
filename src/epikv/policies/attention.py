"""What the attention-based baselines (H2O, TOVA, RaaS, ThinKV ...) read from the captured attention weights.

Not a policy: the base class they share (eager attention, every layer observed) and the reductions of
`StepObservation.attentions` they have in common. Results live on the device of `obs.valid` (the scoring device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._lazy import torch

from .base import Observes, Policy, StepObservation, pool_query_heads


@dataclass
class AttentionPolicy(Policy):
    """A policy scored from attention weights: the engine switches to eager attention to capture them."""

    attention_free: ClassVar[bool] = False

    def observes(self, n_layers):
        return Observes(attention_layers=tuple(range(n_layers)))


def attention_received(obs: StepObservation, per_kv_head: bool = True) -> torch.Tensor:
    """Attention each stored token received from this forward's real queries, summed over queries.

    Returns [batch, layers, kv_heads, kv_len] (query heads of a GQA group averaged), or [batch, layers, heads,
    kv_len] with per_kv_head=False. Layers are those in obs.attentions, in increasing order.
    """
    out = []
    for l in sorted(obs.attentions):
        a = obs.attentions[l].to(obs.valid.device).float()  # [batch, heads, T, kv_len]
        a = torch.nan_to_num(a) * obs.valid[:, None, :, None]  # padding queries give nothing
        a = a.sum(2)  # [batch, heads, kv_len]
        out.append(pool_query_heads(a, obs.kv_heads) if per_kv_head else a)
    return torch.stack(out, dim=1)


def newest_query_attention(obs: StepObservation) -> torch.Tensor:
    """The newest query's attention over the stored tokens, averaged over heads: [batch, layers, kv_len].

    Layers are those in obs.attentions, in increasing order."""
    last = [obs.attentions[l][:, :, -1].float().mean(1) for l in sorted(obs.attentions)]  # [batch, kv_len] each
    return torch.stack(last, dim=1).to(obs.valid.device)


def accumulate(new: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """Add the stored running sums `old` (over the tokens held before this forward) onto `new` [..., kv_len].

    The result replaces the stored sums: old tokens received new attention too, so they are not append-only."""
    if old is not None:
        new[..., : old.shape[-1]] += old
    return new
