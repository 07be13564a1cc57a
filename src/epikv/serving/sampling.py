"""Per-request sampling inside continuous batching, with the library's own sampler (`epikv.engine.Sampler`).

transformers' engine samples with the global torch generator (`torch.multinomial`), so a request's tokens would
depend on its batch-mates. Here the engine decodes greedily and each sampled request's row of the logits is
replaced, in a forward hook, by a one-hot row of the token the library's `Sampler` draws for it: transformers'
logits processors (temperature, top-k, top-p, min-p, in model.generate's order), then one inverse-CDF draw from the
request's own stream of uniforms, seeded by its seed. The engine's argmax then picks exactly that token. A request's
tokens therefore depend only on its prompt, its sampling settings and its seed, and equal those of
`epikv.generate(..., sampling=Sampling(...), seeds=[seed], max_new_tokens=max_tokens)` on the same cache policy.
"""

from __future__ import annotations

import torch

from ..engine import Sampler, Sampling


class RequestSampler:
    """One request's sampler: a batch-of-one `Sampler` (its uniforms drawn up front from `seed`, as generate does
    for the same max_new_tokens) and the tokens it has chosen, which the repetition penalty would read."""

    def __init__(self, sampling: Sampling, seed: int, prompt_ids: list[int], max_tokens: int, device) -> None:
        self.max_tokens = max_tokens
        self.sampler = Sampler(sampling, [int(seed)], torch.tensor([list(prompt_ids)]), [0], max_tokens, device)

    def choose(self, logits: torch.Tensor, step: int) -> int:
        """logits [vocab] of the request's token number `step` (0 = the first generated) -> the token id."""
        step = min(step, self.max_tokens - 1)  # (a soft-reset request may count its tokens again)
        tok = self.sampler(logits[None], step)  # [1]
        self.sampler.out[0, step] = tok.to(self.sampler.out.device)
        return int(tok[0])


def force(logits_row: torch.Tensor, token: int) -> None:
    """Make the engine's argmax pick `token`: every other entry of the row -inf, in place."""
    logits_row.fill_(float("-inf"))
    logits_row[token] = 0.0
