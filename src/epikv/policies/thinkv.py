from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from ..errors import EpiKVError
from .attention import AttentionPolicy, newest_query_attention
from .base import Observes


@dataclass
class ThinKV(AttentionPolicy):
    """The EPIKV paper's simplified ThinKV: an APPROXIMATION of ThinKV (Ramachandran et al., arXiv:2510.01290).

    At each eviction the evictable cache (after the protected prefix, before the recency window) is cut into
    `segment`-token segments. Each segment's type comes from the entropy of the newest query's attention over it
    (last `n_layers_entropy` layers, heads averaged, renormalised inside the segment), by tertile over segments:
    lowest entropy = transition (keep up to 8), middle = execution (32), highest = reasoning (64). Inside a segment
    tokens rank by the last layer's attention; segments are served oldest first against the remaining budget;
    slots left over go to the highest-attention remaining tokens. The original's KDE thresholds, FP8/NVFP4/2-bit
    quantisation and {64,32,16,8,4} schedule are not implemented. Needs eager attention.
    """

    segment: int = 128
    caps: tuple[int, int, int] = (8, 32, 64)  # transition, execution, reasoning (entropy tertile low -> high)
    n_layers_entropy: int = 4

    name = "thinkv"
    paper = "arXiv:2510.01290 (approximation, per arXiv:2606.26472)"

    def __post_init__(self):
        super().__post_init__()
        if self.segment < 1 or len(self.caps) != 3 or self.n_layers_entropy < 1:
            raise EpiKVError("thinkv: segment and n_layers_entropy must be positive and caps three numbers")

    def observes(self, n_layers):
        return Observes(attention_layers=tuple(range(max(0, n_layers - self.n_layers_entropy), n_layers)))

    def init_state(self, batch, n_layers, device):
        return {}

    def on_tokens(self, state, obs):
        last = newest_query_attention(obs)  # [batch, layers, kv_len]
        state["ent"] = last.mean(1)  # entropy source: last layers averaged
        state["rank"] = last[:, -1]  # in-segment ranking: the last layer
        return {}

    def scores(self, state, view):
        rank = state["rank"]
        pri = rank.clone()  # unselected tokens compete by attention for any leftover slots
        n = view.length
        for r in range(rank.shape[0]):
            start = int(view.n_pad[r] + view.n_protect[r])
            end = n - view.recent
            slots = view.budget - int(view.n_protect[r]) - view.recent
            if end - start <= 0 or slots <= 0:
                continue
            seg_ids = torch.arange(start, end, device=rank.device).split(self.segment)
            ent = []
            for ids in seg_ids:
                p = state["ent"][r, ids]
                p = p / p.sum().clamp(min=1e-12)
                ent.append(-(p * p.clamp(min=1e-12).log()).sum())
            order = torch.stack(ent).argsort()  # ascending entropy
            tertile = torch.empty_like(order)
            tertile[order] = torch.arange(len(order), device=order.device) * 3 // len(order)
            for s, ids in enumerate(seg_ids):  # oldest first
                take = min(self.caps[int(tertile[s])], slots, len(ids))
                if take <= 0:
                    continue
                chosen = ids[rank[r, ids].topk(take).indices]
                pri[r, chosen] += 2.0  # attention <= 1: every selected token outranks every unselected one
                slots -= take
        return pri
