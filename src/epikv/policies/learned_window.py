from __future__ import annotations

from dataclasses import dataclass

from ..errors import EpiKVError
from .learned import LearnedMean


@dataclass
class LearnedWindow(LearnedMean):
    """epikv-learned-window: epikv-learned-mean's arrival score with a recent window that is a fraction of K.

    KVzap (arXiv:2601.07891) keeps a window of the newest tokens beside its learned score; this control asks how
    much of a decayed score's gain (epikv-learned-decay) a plain larger window gives. Rule: protect the prompt and
    the newest floor(recent_frac * K) tokens, keep the top arrival scores among the rest. Reads the hidden states
    entering each layer (as epikv-learned-mean); no attention. `recent` set explicitly overrides the fraction.
    """

    recent_frac: float = 0.5  # the recent window as a fraction of the budget K

    name = "epikv-learned-window"
    paper = "arXiv:2601.07891 (KVzap), arXiv:2512.03324 (TRIM-KV)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.recent_frac <= 1:
            raise EpiKVError(f"{self.name}: recent_frac must be in (0, 1] (a fraction of the budget), "
                             f"got {self.recent_frac}")

    def recent_window(self, budget: int) -> int:
        return int(self.recent_frac * budget) if self.recent is None else self.recent
