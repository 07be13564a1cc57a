from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._lazy import torch

from .base import Policy


@dataclass
class ContextShift(Policy):
    """llama.cpp's context shift (`llama-server --context-shift`): when full, keep n_keep, drop half the rest, renumber.

    When a sequence's cells are full (K = its cells; before the next token when n + 1 >= K; with tau > 1, before
    the next tau tokens when n + tau >= K, as `retention` feeds them), keep the first n_keep
    tokens, discard half of the rest, oldest first (n_discard = (n - n_keep) / 2, at most n - n_keep - 1), and
    renumber the survivors' positions down by n_discard (`llama_memory_seq_add`, which re-rotates their cached
    keys). Reads nothing but the token count.

    n_keep counts tokens from the start of the sequence, BOS included: llama-server's request `n_keep` plus one where
    its vocabulary adds BOS; capped at K - 4 as llama-server caps it. n_keep = -1 keeps the whole prompt (llama-server's
    `n_keep: -1`). The prompt is not protected beyond n_keep.
    Only the llama.cpp engine runs it: the torch engine keeps every token at its true position (see
    docs/llamacpp.md)."""

    n_keep: int = 0
    protect_prompt: bool = False
    n_sink: int = 0

    name = "context-shift"
    paper = "llama.cpp tools/server (--context-shift)"
    renumbers_positions: ClassVar[bool] = True
    signed: ClassVar[dict[str, int]] = {"n_keep": -1}

    def should_evict(self, length, budget, steps, decode_slots):
        # llama-server shifts before a decode when n_tokens + 1 >= the slot's n_ctx; epikv shifts after the step
        # when the next tau tokens (one a step; `retention` feeds chunks of tau) would not fit in K - 1 cells
        return length + self.tau >= budget

    def peak_cells(self, budget: int) -> int:
        return budget - 1  # the sequence never holds more than K - 1 cells (a shift makes room for the next step)

    def recent_window(self, budget: int) -> int:
        return 1  # the newest token always stays (n_discard <= n_left - 1)

    def protected(self, prompt_len: int) -> int:
        return prompt_len if self.n_keep < 0 else min(self.n_keep, prompt_len)

    def protected_overflow(self, budget, recent, prompt_len):
        if budget is not None and prompt_len + 1 >= budget:
            return (f"context-shift: a prompt of {prompt_len} tokens fills the sequence's {budget} cells (K) before "
                    "its first token; raise the budget or shorten the prompt")
        return None

    def shift(self, length: int, budget: int, prompt_len: int = 0) -> tuple[int, int]:
        """(n_keep, n_discard) of a shift of `length` tokens in `budget` cells, as llama-server computes them (n_keep
        -1: the prompt's `prompt_len` tokens)."""
        n_keep = max(0, min(budget - 4, prompt_len if self.n_keep < 0 else self.n_keep))
        n_left = length - n_keep
        return n_keep, min(max(n_left // 2, 0), max(0, n_left - 1))

    def scores(self, state, view):
        batch = view.n_pad.shape[0]
        return torch.arange(view.length, device=view.device, dtype=torch.float32).expand(batch, -1)

    def keep(self, state, view):
        n = view.length
        # n_protect is protected(prompt_len): the whole prompt where n_keep is -1 (rows of a batch share it)
        n_keep, n_discard = self.shift(n, view.budget, int(view.n_protect.max()))
        idx = torch.cat([torch.arange(n_keep), torch.arange(n_keep + n_discard, n)]).to(view.device)
        return idx[None].expand(view.n_pad.shape[0], -1)
