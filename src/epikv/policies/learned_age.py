from __future__ import annotations

from dataclasses import dataclass

from .learned import LearnedMean
from .learned_decay import token_age


@dataclass
class LearnedAge(LearnedMean):
    """epikv-learned-age: epikv-learned-mean's arrival score minus a fixed penalty per step of age.

    The control of TRIM-KV's decay (arXiv:2512.03324) that ages every token alike: priority_i(t) = s_i - penalty *
    (t - i), s_i epikv-learned-mean's score (log scale, fixed on arrival), t the newest stored token's true position.
    Reads the hidden states entering each layer (as epikv-learned-mean) and the tokens' true positions; no attention.
    """

    penalty: float = 0.002  # nats of the arrival score lost per token of age

    name = "epikv-learned-age"
    ages = True
    paper = "arXiv:2512.03324 (TRIM-KV), arXiv:2601.07891 (KVzap)"

    def scores(self, state, view):
        return view.token_data["score"] - self.penalty * token_age(view)
