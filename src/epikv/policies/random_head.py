from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from .base import Policy


@dataclass
class RandomHeadEviction(Policy):
    """Random eviction per KV head: each layer and KV head evicts its own seeded uniform draw (prompt, recent kept).

    Keep the prompt and the recent window, and in every layer and KV head evict uniformly at random among the rest,
    each head drawing its own set (seeded).

    The null of Random Attention (arXiv:2609.03430) for per-head policies: `random` draws one set shared by every
    head, a weaker null beside policies that choose per head.
    """

    seed: int = 0

    name = "random-head"
    paper = "arXiv:2609.03430"
    granularity = "head"

    def init_state(self, batch, n_layers, device):
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return {"_gen": gen, "_layers": n_layers, "_kv_heads": 0}

    def on_tokens(self, state, obs):
        state["_kv_heads"] = obs.kv_heads
        return {}

    def scores(self, state, view):
        batch = view.n_pad.shape[0]
        return torch.rand(batch, state["_layers"], state["_kv_heads"], view.length, generator=state["_gen"],
                          device=view.device)  # [batch, layers, kv_heads, n]
