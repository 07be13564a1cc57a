"""Per-position comparison of a compressed cache's predictions with the full cache's.

Prediction j (0-based) is the distribution over token P + j, P = prompt length. Positions 0 .. R-1 predict the
reasoning span (ending with `</think>`), R .. R+A-1 the answer. The full cache's log-probabilities are kept for
every predicted position, so each policy run is compared chunk by chunk without storing its own logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    """The full cache's predictions over one trace."""

    logp: torch.Tensor  # [R + A, vocab] float32 log-probabilities
    top1: torch.Tensor  # [R + A] argmax
    targets: torch.Tensor  # [R + A] the trace's actual next tokens
    n_reasoning: int  # R
    seconds: float = 0.0
    peak_cache_tokens: int = 0
    peak_kv_mib: float = 0.0
    peak_mem_mib: float | None = None
    n_body: int | None = None  # reasoning positions before `</think>`'s tokens (None: n_reasoning)


TAIL = 256  # the last reasoning tokens before `</think>`: where the answer is prepared


class Accumulator:
    """One run's per-position losses against the reference, fed one chunk of logits at a time.

    Per-position values are kept (R + A floats) and summed once at the end, so identical predictions give
    bit-identical results however they were chunked."""

    def __init__(self, ref: Reference) -> None:
        self.ref = ref
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (kl, agree, nll), each [T]

    def add(self, start: int, logits: torch.Tensor) -> None:
        """logits [T, vocab] are predictions start .. start + T - 1."""
        end = min(start + logits.shape[0], self.ref.targets.shape[0])
        if end > start:
            self.add_logp(start, torch.log_softmax(logits[: end - start].float(), dim=-1))

    def add_logp(self, start: int, logp: torch.Tensor) -> None:
        """logp [T, vocab] log-probabilities of predictions start .. start + T - 1."""
        end = start + logp.shape[0]
        ref_logp = self.ref.logp[start:end].to(logp.device)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [T] KL(full || compressed)
        agree = logp.argmax(-1) == self.ref.top1[start:end].to(logp.device)
        nll = -logp.gather(-1, self.ref.targets[start:end, None].to(logp.device)).squeeze(-1)
        self.parts.append((kl.cpu(), agree.cpu(), nll.cpu()))

    def result(self) -> dict:
        kl, agree, nll = (torch.cat([p[i] for p in self.parts]).double() for i in range(3))
        r, n = self.ref.n_reasoning, self.ref.targets.shape[0]
        if kl.shape[0] != n:
            raise RuntimeError(f"scored {kl.shape[0]} of {n} positions")

        def mean(x, lo, hi):
            return float(x[lo:hi].mean()) if hi > lo else None

        body = r if self.ref.n_body is None else self.ref.n_body
        tail = max(0, body - TAIL)
        return {
            "tail_nll": mean(nll, tail, body), "tail_kl": mean(kl, tail, body),
            "top1_agreement": mean(agree, 0, r), "kl": mean(kl, 0, r), "reasoning_nll": mean(nll, 0, r),
            "answer_nll": mean(nll, r, n), "answer_top1_agreement": mean(agree, r, n), "answer_kl": mean(kl, r, n),
        }
