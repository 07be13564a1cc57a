from __future__ import annotations

from dataclasses import dataclass

from .attention import AttentionPolicy, newest_query_attention


@dataclass
class TOVA(AttentionPolicy):
    """TOVA, Token Omission Via Attention (Oren et al., arXiv:2401.06104).

    At every step each layer keeps the K tokens with the highest attention from the newest query, averaged over
    that layer's heads (one keep set per layer, shared by its KV heads). No accumulation, no sinks, no recency
    window, prompt not protected (all settable). Needs eager attention.
    """

    protect_prompt: bool = False
    n_sink: int = 0
    recent: int | None = 0

    name = "tova"
    paper = "arXiv:2401.06104"
    granularity = "layer"

    def init_state(self, batch, n_layers, device):
        return {}

    def on_tokens(self, state, obs):
        # the newest query's attention of the latest forward, aligned with the cache until the next forward
        state["last"] = newest_query_attention(obs)  # [batch, layers, kv_len]
        state["kv_heads"] = obs.kv_heads
        return {}

    def scores(self, state, view):
        last = state["last"]
        b, n_lay, n = last.shape
        return last[:, :, None, :].expand(b, n_lay, state["kv_heads"], n)
