from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from .base import Policy


@dataclass
class RandomEviction(Policy):
    """Random eviction: keep the prompt and the recent window, evict uniformly at random among the rest (seeded).

    A strong baseline for recent-window-protected eviction (arXiv:2609.03430).
    """

    seed: int = 0

    name = "random"
    paper = "arXiv:2609.03430"

    def init_state(self, batch, n_layers, device):
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return {"gen": gen}

    def scores(self, state, view):
        batch = view.n_pad.shape[0]
        return torch.rand(batch, view.length, generator=state["gen"], device=view.device)
