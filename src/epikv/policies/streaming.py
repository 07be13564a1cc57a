from __future__ import annotations

from dataclasses import dataclass

from .._lazy import torch

from .base import Policy


@dataclass
class StreamingLLM(Policy):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453).

    Keeps the first n_sink = 4 tokens (attention sinks) and the most recent K - 4; the prompt is not protected.
    """

    protect_prompt: bool = False

    name = "streaming"
    paper = "arXiv:2309.17453"

    def scores(self, state, view):
        # chronological order: the newest slot has the highest index
        n_batch = view.n_pad.shape[0]
        return torch.arange(view.length, device=view.device, dtype=torch.float32).expand(n_batch, -1)
