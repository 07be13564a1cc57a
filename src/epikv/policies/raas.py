from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from .attention import AttentionPolicy, newest_query_attention


@dataclass
class RaaS(AttentionPolicy):
    """RaaS, Reasoning-aware attention sparsity (Hu et al., arXiv:2502.11147).

    The prompt is always kept. Every decode token carries a timestamp, first its own position; at each step the
    newest query's attention (averaged over layers and heads) refreshes to the current step the timestamp of every
    decode token receiving at least the median attention over decode tokens. Eviction drops the stalest
    timestamps. Needs eager attention.
    """

    name = "raas"
    paper = "arXiv:2502.11147"

    def on_tokens(self, state, obs):
        att = newest_query_attention(obs).mean(1)  # [batch, n_old + T], layers averaged
        pos = obs.positions
        old_ts, old_pos = obs.stored.get("ts"), obs.stored.get("pos")
        ts = pos.float() if old_ts is None else torch.cat([old_ts, pos.float()], dim=-1)
        all_pos = pos if old_pos is None else torch.cat([old_pos, pos], dim=-1)
        decode = all_pos >= obs.n_protect[:, None]  # padding sits at position 0, inside the prompt
        med = torch.where(decode, att, torch.nan).nanmedian(dim=-1, keepdim=True).values  # nan: no decode token
        fresh = decode & (att >= med)
        now = pos[:, -1:].float()
        return {"ts": torch.where(fresh, now, ts)}

    def scores(self, state, view):
        return view.token_data["ts"]
