"""The llama.cpp engine as `epikv bench speed` times it: each configuration a LlamaDecoder on the same prompt and
filler as the torch engine's (epikv.bench.speed), taking turns in rounds of greedy decode steps; and long
generations with their speed and KV bytes at checkpoints. Rows carry the context's cells and KV bytes."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..policies import get_policy
from ..llamacpp.engine import LlamaDecoder, check_model_policy
from ..llamacpp.model import GGUFModel


class LlamaCppSpeed:
    """What epikv.bench.speed.run_budget reads of a model: `n_vocab` (its random prompt) and `speed_run`."""

    epikv_engine = "llama.cpp"

    def __init__(self, gm: GGUFModel, threads: int | None = None, *, type_k: str = "f16", type_v: str = "f16",
                 flash_attn: bool | None = None) -> None:
        self.gm, self.threads, self.n_vocab = gm, threads, gm.tokenizer.n_vocab
        self.cells = dict(type_k=type_k, type_v=type_v, flash_attn=flash_attn)  # every decoder's cell types

    def speed_run(self, cfg, budget, fill_to, prompt, filler, chunk, total) -> "SpeedRun":
        return SpeedRun(self, cfg, budget, fill_to, prompt, filler, chunk, total)


class SpeedRun:
    """One configuration's decoder, filled to its starting length (prompt, then filler in micro-batches, evicting
    between them as the policy says), advanced a round at a time."""

    def __init__(self, eng: LlamaCppSpeed, cfg, budget: int, fill_to: int, prompt, filler, chunk: int,
                 total: int) -> None:
        self.cfg = cfg
        self.policy = cfg.make()
        check_model_policy(eng.gm, self.policy)
        ids = [int(t) for t in filler[0, :fill_to]]  # [fill_to]; the prompt is its first tokens
        p = prompt.shape[1]
        self.dec = LlamaDecoder(eng.gm, self.policy, budget if self.policy.evicts else None, max_tokens=total,
                                threads=eng.threads, n_batch=min(512, p), **eng.cells)
        self.times: list[float] = []
        self.lengths: list[int] = []
        self.logits = self.dec.prefill(ids[:p])
        n = self.dec.n_batch
        for s in range(p, fill_to, n):
            self.logits = self.dec.feed(ids[s : min(fill_to, s + n)])

    def round(self, steps: int) -> None:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.logits = self.dec.step(int(np.argmax(self.logits)))
        self.times.append((time.perf_counter() - t0) / steps)
        self.lengths.append(self.dec.stored())

    def summary(self) -> dict:
        from .speed import config_summary

        return {**config_summary(self.cfg, self.policy, self.times, self.lengths, self.dec.evictions),
                "kv_cells": self.dec.n_ctx, "kv_bytes": self.dec.kv_bytes(), "kv_mirror_bytes": self.dec.mirror_bytes(),
                "cache_type_k": self.dec.type_k, "cache_type_v": self.dec.type_v, **self.dec.peak_report()}


def long_generation(eng: LlamaCppSpeed, policy: str, budget: int, lengths: list[int], tau: int | None = None,
                    prompt_tokens: int = 64, seed: int = 0, on_point: Callable[[dict], None] | None = None,
                    settings: dict | None = None) -> list[dict]:
    """Greedy decode up to max(lengths) new tokens in this process; at each checkpoint the tokens/s of the last
    segment and overall, the cache length, the context's KV bytes (allocated) and the run's KV peak (peak cached
    tokens x bytes per cell): the points of epikv.bench.speed.long_generation, without a process's memory."""
    from .speed import random_ids

    pol = get_policy(policy, tau=tau, **(settings or {}))
    lengths = sorted(set(lengths))
    prompt = [int(t) for t in random_ids(eng, prompt_tokens, seed)[0]]
    dec = LlamaDecoder(eng.gm, pol, budget if pol.evicts else None, max_tokens=prompt_tokens + lengths[-1],
                       threads=eng.threads, n_batch=min(512, prompt_tokens), **eng.cells)
    try:
        logits = dec.prefill(prompt)
        per_cell = (dec.kv_bytes() or 0) / dec.n_ctx
        points, done = [], 0
        t_start = t_prev = time.perf_counter()
        for target in lengths:
            for _ in range(target - done):
                logits = dec.step(int(np.argmax(logits)))
            now = time.perf_counter()
            p = {"policy": policy, "budget": budget if pol.evicts else None, "tau": pol.tau if pol.evicts else None,
                 "generated": target, "segment_tokens_per_s": (target - done) / (now - t_prev),
                 "tokens_per_s": target / (now - t_start), "cache_length": dec.stored(),
                 "kv_buffer_mib": (dec.kv_bytes() or 0) / 2**20, "kv_cache_peak_mib": dec.max_tokens * per_cell / 2**20,
                 "kv_cells": dec.n_ctx, "kv_mirror_mib": dec.mirror_bytes() / 2**20,
                 "kv_peak_bytes": dec.peak["bytes"]}
            points.append(p)
            if on_point:
                on_point(p)
            done, t_prev = target, now
        return points
    finally:
        dec.close()
