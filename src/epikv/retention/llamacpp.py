"""The llama.cpp engine as `epikv retention` streams a trace through it: the runner's `_stream` (prefill the
prompt, then chunks of tau tokens with every logit, evicting after each chunk) run by a LlamaDecoder, so the
retention code measures, records and reports llama.cpp runs exactly as it does the torch engine's."""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..llamacpp.engine import LlamaDecoder, check_model_policy
from ..llamacpp.model import GGUFModel


# the longest chunk retention feeds at once: a long tau (Seg-Q's 128) is fed in chunks of a divisor of it, so a
# policy's rows waiting for their statistic are those of a short step (a user decodes one token a step), while the
# evictions land where one-token steps put them (every tau tokens, on the chunks' grid)
MAX_CHUNK = 16


def feed_chunk(tau: int) -> int:
    """The chunk retention feeds for a policy of this tau: tau up to MAX_CHUNK, else the largest divisor of tau not
    above MAX_CHUNK (tau itself where that divisor is below MAX_CHUNK / 2: few, long chunks cost less time)."""
    if tau <= MAX_CHUNK:
        return max(1, tau)
    d = max(c for c in range(1, MAX_CHUNK + 1) if tau % c == 0)
    return d if 2 * d >= MAX_CHUNK else tau


class LlamaCppTraces:
    """What epikv.retention.runner reads of a model: `device`, `epikv_engine` (recorded in every record and in the
    folder's config) and `stream_trace` (its `_stream` through llama.cpp)."""

    epikv_engine = "llama.cpp"
    device = torch.device("cpu")

    def __init__(self, gm: GGUFModel, threads: int | None = None, type_kv: str = "f16", *, type_k: str | None = None,
                 type_v: str | None = None, flash_attn: bool | None = None) -> None:
        from ..llamacpp.engine import kv_types

        self.gm, self.threads, self.type_kv, self.flash_attn = gm, threads, type_kv, flash_attn
        self.type_k, self.type_v = kv_types(type_kv, type_k, type_v)
        # recorded in the folder's config: one folder holds one cell type (rows at q8_0 are not rows at f16)
        self.epikv_config = {"cache_type_k": self.type_k, "cache_type_v": self.type_v}
        self.on_decoder: Callable[[LlamaDecoder], None] | None = None  # test hook: each run's decoder, before use

    def check(self, policy) -> None:
        check_model_policy(self.gm, policy)

    def stream_trace(self, item, policy, budget: int | None, on_logits: Callable[[int, torch.Tensor], None]):
        """Returns (forward seconds, cache stats, peak KV MiB at the cache's own type) as the runner's _stream."""
        ids = item.ids
        p, n, tau = len(item.prompt_ids), len(ids), feed_chunk(policy.tau)
        # a micro-batch holds a chunk (tau, or a divisor of a long tau), and the prompt goes in micro-batches of the
        # same size: the rows a policy keeps for the prompt's tokens are flushed after each, so its peak bytes stay
        # those of a step (kvtypes' plan_peak with step_tokens = n_batch = the chunk)
        dec = LlamaDecoder(self.gm, policy, budget, max_tokens=n, threads=self.threads, type_k=self.type_k,
                           type_v=self.type_v, flash_attn=self.flash_attn, n_batch=tau)
        try:
            if self.on_decoder is not None:
                self.on_decoder(dec)
            t0 = time.perf_counter()
            last = dec.prefill(ids[:p])  # [vocab], predicts token P
            fwd = time.perf_counter() - t0
            on_logits(0, torch.from_numpy(last)[None])
            # chunks, the first one shorter where the budget needs it: chunk ends then land where the cells reach
            # K + tau (the prompt holds p <= K; tau is a multiple of the chunk), so the first eviction comes at
            # K + tau cells at the latest, as every later one does, and a sequence peaks at K + tau cells as in
            # one-token steps (kvtypes.plan_peak); on the plain grid a prompt ending off it lets the cells reach
            # K + 2 tau - 1 before the first eviction
            first = (budget - p) % tau if budget is not None and policy.evicts and p <= budget else 0
            ends = [e for e in [p + first] * bool(first) + list(range(p + first + tau, n - 1, tau)) if e < n - 1]
            ends.append(n - 1)  # the last token predicts nothing scored
            for s, e in zip([p] + ends[:-1], ends):
                t0 = time.perf_counter()
                logits = dec.feed(ids[s:e], all_logits=True)  # [T, vocab]
                fwd += time.perf_counter() - t0
                on_logits(s + 1 - p, torch.from_numpy(logits))
            # the peak KV bytes: cells as stored at their type + the policy's buffers (kvtypes), into the record
            stats = {"max_cache_tokens": dec.max_tokens, "evictions": dec.evictions, **dec.peak_report()}
            per_cell = (dec.kv_bytes() or 0) / dec.n_ctx
            return fwd, stats, dec.max_tokens * per_cell / 2**20
        finally:
            dec.close()
