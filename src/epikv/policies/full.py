from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass
class FullCache(Policy):
    """No eviction: the whole KV cache is kept (the accuracy ceiling and the speed reference)."""

    name = "full"
    paper = "-"
    evicts = False
