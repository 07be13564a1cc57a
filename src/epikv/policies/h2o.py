from __future__ import annotations

from dataclasses import dataclass

from .attention import AttentionPolicy, accumulate, attention_received


@dataclass
class H2O(AttentionPolicy):
    """H2O, Heavy-Hitter Oracle (Zhang et al., arXiv:2306.14048), the original per-head rule.

    Every layer and KV head keeps a running sum of the attention each cached token has received from all queries
    (query heads of a GQA group averaged). The budget is split in half: the K/2 newest tokens (recent) and the K/2
    heavy hitters with the largest accumulated attention. The prompt is not protected. Needs eager attention.
    """

    protect_prompt: bool = False
    n_sink: int = 0

    name = "h2o"
    paper = "arXiv:2306.14048"
    granularity = "head"

    def recent_window(self, budget):
        return budget // 2 if self.recent is None else self.recent

    def on_tokens(self, state, obs):
        return {"acc": accumulate(attention_received(obs), obs.stored.get("acc"))}  # [batch, layers, kv_heads, n]

    def scores(self, state, view):
        return view.token_data["acc"]
