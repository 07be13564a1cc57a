"""Failure-mode detectors shared by every entry point: empty output, no final answer, token cap, repetition.

The EPIKV paper reports attention-based policies "collapsing" at tight budgets (empty or unstructured output);
these detectors let every run record such collapses per generation instead of assuming them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from .eval.grading import last_boxed  # one answer extractor for grading and failure flags


def repeated_tail(token_ids: Sequence[int], max_ngram: int = 64) -> tuple[int, int]:
    """The shortest period p <= max_ngram that repeats through the longest suffix of token_ids.

    Returns (period, span): the last `span` tokens are an n-gram of length `period` repeated (span >= 2 * period),
    or (0, 0) when no n-gram repeats even twice at the end.
    """
    ids = list(token_ids)
    best = (0, 0)
    for p in range(1, min(max_ngram, len(ids) // 2) + 1):
        k = 0
        while k + p < len(ids) and ids[-1 - k] == ids[-1 - k - p]:
            k += 1
        span = k + p
        if span >= 2 * p and span > best[1]:
            best = (p, span)
    return best


def is_degenerate(token_ids: Sequence[int], min_span: int = 32, min_repeats: int = 4, max_ngram: int = 64) -> bool:
    """An n-gram repeated at least `min_repeats` times covering at least `min_span` final tokens."""
    period, span = repeated_tail(token_ids, max_ngram)
    return period > 0 and span >= max(min_span, min_repeats * period)


@dataclass
class Failures:
    empty: bool  # nothing but whitespace / special tokens
    no_answer: bool  # no complete \boxed{...}
    hit_cap: bool  # stopped by max new tokens, not by EOS or a stop string
    repetition: bool  # a degenerate n-gram loop running into the token cap

    @property
    def any(self) -> bool:
        return self.empty or self.no_answer or self.hit_cap or self.repetition

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


def detect(text: str, token_ids: Sequence[int], finish_reason: str, min_span: int = 32) -> Failures:
    """Failure modes of one generation (text without special tokens, generated ids, finish reason from
    `epikv.generate`: "eos" | "stop" | "length")."""
    hit_cap = finish_reason == "length"
    return Failures(
        empty=not text.strip(),
        no_answer=last_boxed(text) is None,
        hit_cap=hit_cap,
        repetition=hit_cap and is_degenerate(token_ids, min_span=min_span),
    )


def detect_all(result, min_span: int = 32) -> list[Failures]:
    """Failure modes of every sequence of a GenerationResult."""
    return [detect(t, ids, r, min_span) for t, ids, r in zip(result.texts, result.token_ids, result.finish_reasons)]


def summarise(failures: Sequence[Failures]) -> dict[str, float]:
    """Rates over many generations: fraction with each failure mode."""
    n = max(len(failures), 1)
    keys = ("empty", "no_answer", "hit_cap", "repetition")
    return {k: sum(getattr(f, k) for f in failures) / n for k in keys}
