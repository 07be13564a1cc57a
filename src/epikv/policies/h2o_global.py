from __future__ import annotations

from dataclasses import dataclass

from .attention import AttentionPolicy, accumulate, attention_received


@dataclass
class H2OGlobal(AttentionPolicy):
    """The EPIKV paper's adaptation of H2O (arXiv:2606.26472; H2O is arXiv:2306.14048): one keep mask per token.

    Attention received is averaged over layers and heads and accumulated over all queries; keeps 4 sink tokens,
    the newest min(128, K/4) and the top accumulated rest; the prompt is not protected. The paper also averaged
    over the batch; here each sequence keeps its own sums (identical at batch 1, the paper's setting).
    """

    protect_prompt: bool = False

    name = "h2o-global"
    paper = "arXiv:2606.26472"

    def on_tokens(self, state, obs):
        acc = attention_received(obs, per_kv_head=False).mean(dim=(1, 2))  # [batch, n_old + T]
        return {"acc": accumulate(acc, obs.stored.get("acc"))}

    def scores(self, state, view):
        return view.token_data["acc"]
