from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observes, Policy, StepObservation, pool_query_heads


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


@dataclass
class H2O(Policy):
    """H2O, Heavy-Hitter Oracle (Zhang et al., arXiv:2306.14048), the original per-head rule.

    Every layer and KV head keeps a running sum of the attention each cached token has received from all queries
    (query heads of a GQA group averaged). The budget is split in half: the K/2 newest tokens (recent) and the K/2
    heavy hitters with the largest accumulated attention. The prompt is not protected. Needs eager attention.
    """

    protect_prompt: bool = False
    n_sink: int = 0

    name = "h2o"
    paper = "arXiv:2306.14048"
    attention_free = False
    granularity = "head"

    def observes(self, n_layers):
        return Observes(attention_layers=tuple(range(n_layers)))

    def recent_window(self, budget):
        return budget // 2 if self.recent is None else self.recent

    def on_tokens(self, state, obs):
        acc = attention_received(obs)  # [batch, layers, kv_heads, n_old + T]
        old = obs.stored.get("acc")
        if old is not None:
            acc[..., : old.shape[-1]] += old
        return {"acc": acc}  # replaces the stored sums (old tokens got new attention)

    def scores(self, state, view):
        return view.token_data["acc"]
