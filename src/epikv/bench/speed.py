"""Decode throughput per policy at equal budget, interleaved round-robin in one process, reported as ratios.

Every configuration (policy, tau) gets its own `Decoder` on the same model and the same random-token prompt: a
short protected prompt, then filler tokens fed in chunks until the cache holds K tokens (full: K - gen/2, so its
cache length is K on average over the timed steps). Then the configurations take turns, `round_steps` greedy decode
steps each; a round's time / steps is one sample, and the reported figure is the median over rounds. Rounds default
to the largest tau, so every tau = 128 round contains exactly one eviction (its cost is amortised, not hidden).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine import Decoder, attention_for
from ..errors import EpiKVError
from ..measure import kv_bytes_per_token
from ..policies import REGISTRY, Policy, get_policy, policy_class

EPIKV = "epikv"
FULL = "full"


@dataclass
class SpeedConfig:
    label: str  # "epikv@tau=1"
    policy: str
    tau: int | None
    settings: dict = field(default_factory=dict)

    def make(self) -> Policy:
        return get_policy(self.policy, tau=self.tau, **self.settings)


def default_policies() -> list[str]:
    """The attention-based policies that are registered, then epikv, lag-kv, full, streaming (those that exist)."""
    attn = [n for n, cls in REGISTRY.items() if not cls.attention_free]
    return attn + [n for n in (EPIKV, "lag-kv", FULL, "streaming") if n in REGISTRY]


def build_configs(policies: list[str], taus: list[int], settings: Callable[[str], dict] = lambda n: {}) -> list[SpeedConfig]:
    """One config per (policy, tau); `full` once (it never evicts, tau means nothing to it)."""
    if not policies:
        raise EpiKVError("no policies to benchmark")
    out = []
    for name in dict.fromkeys(policies):
        policy_class(name)  # unknown, or a plugin that failed to load: one line
        if not REGISTRY[name].evicts:
            out.append(SpeedConfig(name, name, None, settings(name)))
            continue
        for tau in dict.fromkeys(taus):
            out.append(SpeedConfig(f"{name}@tau={tau}", name, tau, settings(name)))
    return out


def random_ids(model, n: int, seed: int) -> torch.Tensor:
    """[1, n] token ids drawn uniformly (no special-token region), the same for every configuration."""
    vocab = getattr(model, "n_vocab", None) or model.get_input_embeddings().num_embeddings  # another engine: its own
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 2), vocab, (1, n), generator=g)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a wall-clock interval covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class _Run:
    """One configuration's decoder, filled to its starting length, advanced a round at a time."""

    def __init__(self, model, cfg: SpeedConfig, budget: int, fill_to: int, prompt: torch.Tensor, filler: torch.Tensor,
                 chunk: int) -> None:
        self.cfg, self.model = cfg, model
        self.policy = cfg.make()
        self.times: list[float] = []  # seconds per token, one per round
        self.lengths: list[int] = []  # cache length after each round
        self.ctx = lambda: attention_for(model, self.policy)
        with self.ctx():
            self.dec = Decoder(model, self.policy, budget if self.policy.evicts else None)
            logits = self.dec.prefill(prompt, [0])
            fed = prompt.shape[1]
            while fed < fill_to:  # reasoning-like filler, evicting between chunks as the policy says
                piece = filler[:, fed : min(fill_to, fed + chunk)]
                logits = self.dec.step(piece)
                fed += piece.shape[1]
        self.next = logits.argmax(-1, keepdim=True)  # [batch, 1], stays on the device

    def round(self, steps: int) -> None:
        dev = self.dec.device
        with self.ctx():
            synchronize(dev)
            t0 = time.perf_counter()
            nxt = self.next
            for _ in range(steps):
                nxt = self.dec.step(nxt).argmax(-1, keepdim=True)
            synchronize(dev)
            dt = time.perf_counter() - t0
        self.next = nxt
        self.times.append(dt / steps)
        self.lengths.append(self.dec.cache.stored_length())

    def summary(self) -> dict:
        return config_summary(self.cfg, self.policy, self.times, self.lengths, self.dec.cache.evictions)


def config_summary(cfg: SpeedConfig, policy: Policy, times: list[float], lengths: list[int], evictions: int) -> dict:
    """One configuration's row: the median over rounds of seconds per token, and each round's figures."""
    med = statistics.median(times)
    return {"label": cfg.label, "policy": cfg.policy, "tau": cfg.tau, "attention_free": policy.attention_free,
            "evicts": policy.evicts, "ms_per_token": med * 1e3, "tokens_per_s": 1.0 / med,
            "round_ms_per_token": [t * 1e3 for t in times], "cache_length_after_round": lengths,
            "evictions": evictions}


HF = "transformers"  # the label of the second reference: transformers' model.generate with its DynamicCache


class _HFRun:
    """transformers' own decoding as users run it: `model.generate` (greedy, `round_steps` new tokens per call)
    continuing one `DynamicCache`, filled to the same length as the `full` policy's cache."""

    def __init__(self, model, fill_to: int, ids: torch.Tensor) -> None:
        from transformers import DynamicCache

        from ..cache import cache_kwarg

        self.cfg = SpeedConfig(HF, HF, None)
        self.model = model
        self.kw = {cache_kwarg(model): DynamicCache()}
        self.times: list[float] = []
        self.lengths: list[int] = []
        dev = model.get_input_embeddings().weight.device
        self.dev = torch.device(dev)
        x = ids[:, :fill_to].to(dev)
        with torch.inference_mode():
            logits = model(input_ids=x, use_cache=True, **self.kw).logits[:, -1]
        self.seq = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)  # the cache holds all but the last

    def round(self, steps: int) -> None:
        synchronize(self.dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.seq = self.model.generate(input_ids=self.seq, attention_mask=torch.ones_like(self.seq),
                                           max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                           pad_token_id=0, **self.kw)
        synchronize(self.dev)
        self.times.append((time.perf_counter() - t0) / steps)
        self.lengths.append(self.seq.shape[1] - 1)

    def summary(self) -> dict:
        med = statistics.median(self.times)
        return {"label": HF, "policy": HF, "tau": None, "attention_free": True, "evicts": False,
                "ms_per_token": med * 1e3, "tokens_per_s": 1.0 / med,
                "round_ms_per_token": [t * 1e3 for t in self.times], "cache_length_after_round": self.lengths,
                "evictions": 0}


def run_budget(model, configs: list[SpeedConfig], budget: int, gen_tokens: int, round_steps: int | None = None,
               prompt_tokens: int = 64, fill_chunk: int = 256, seed: int = 0,
               on_round: Callable[[int, int], None] | None = None, transformers_reference: bool = False) -> dict:
    """Time every config at cache budget K = `budget`; returns per-config medians and the ratios."""
    taus = [c.tau for c in configs if c.tau]
    round_steps = round_steps or (max(taus) if taus else 32)
    if gen_tokens < round_steps:
        raise EpiKVError(f"--gen-tokens {gen_tokens} is shorter than one round of {round_steps} steps")
    if prompt_tokens >= budget:
        raise EpiKVError(f"budget {budget} must exceed the {prompt_tokens}-token prompt")
    rounds = gen_tokens // round_steps
    ids = random_ids(model, budget + gen_tokens, seed)
    prompt = ids[:, :prompt_tokens]
    runs = []
    # another engine (epikv.bench.llamacpp) brings its own run of a configuration, with _Run's interface
    make = getattr(model, "speed_run", None)
    with torch.inference_mode():
        for cfg in configs:
            evicts = REGISTRY[cfg.policy].evicts
            fill_to = budget if evicts else max(prompt_tokens, budget - gen_tokens // 2)
            runs.append(_Run(model, cfg, budget, fill_to, prompt, ids, fill_chunk) if make is None else
                        make(cfg, budget, fill_to, prompt, ids, fill_chunk, fill_to + gen_tokens + round_steps))
        if transformers_reference:  # at full's cache length
            runs.append(_HFRun(model, max(prompt_tokens, budget - gen_tokens // 2), ids))
        # warm-up round (not recorded): first-call allocations, kernel selection, caches
        for r in runs:
            r.round(min(4, round_steps))
            r.times.clear(), r.lengths.clear()
        for i in range(rounds):
            for r in runs:  # round-robin: machine-load drift hits every config alike
                r.round(round_steps)
            if on_round:
                on_round(i + 1, rounds)
    rows = [r.summary() for r in runs]
    return {"budget": budget, "gen_tokens": rounds * round_steps, "round_steps": round_steps, "rounds": rounds,
            "prompt_tokens": prompt_tokens, "configs": rows, "ratios": ratios(rows)}


def ratios(rows: list[dict]) -> dict:
    """Ratios of median seconds per token. speedup > 1: the first is faster; overhead: extra time as a fraction."""
    ms = {r["label"]: r["ms_per_token"] for r in rows}
    by = {(r["policy"], r["tau"]): r["ms_per_token"] for r in rows}
    out: dict = {}
    if FULL in ms:
        out["speedup_vs_full"] = {k: ms[FULL] / v for k, v in ms.items() if k not in (FULL, HF)}
        out["epikv_overhead_vs_sdpa_step"] = {f"tau={t}": v / ms[FULL] - 1 for (p, t), v in by.items() if p == EPIKV}
        out["overhead_vs_full"] = {k: v / ms[FULL] - 1 for k, v in ms.items() if k not in (FULL, HF)}
    if HF in ms:  # > 0: slower than transformers' own generate with a DynamicCache at the same length
        out["overhead_vs_transformers"] = {k: v / ms[HF] - 1 for k, v in ms.items() if k != HF}
    epi = {t: v for (p, t), v in by.items() if p == EPIKV}
    attn = [r for r in rows if not r["attention_free"]]
    if epi and attn:  # each attention-based config against epikv at the same tau (else epikv's smallest tau)
        out["epikv_speedup_vs_attention"] = {
            r["label"]: r["ms_per_token"] / epi.get(r["tau"], epi[min(epi)]) for r in attn}
    taus = sorted({t for (_, t) in by if t})
    if len(taus) >= 2:
        lo, hi = taus[0], taus[-1]
        out[f"tau{lo}_vs_tau{hi}_time"] = {p: by[(p, lo)] / by[(p, hi)] for (p, t) in by if t == lo and (p, hi) in by}
    return {k: v for k, v in out.items() if v}  # a ratio without its two sides is left out


def kv_bytes(layer) -> int:
    """Bytes allocated for one cache layer's key and value buffers (capacity, not just the used slots)."""
    if layer.keys is None:
        return 0
    k, v = layer.keys, layer.values  # [batch, kv_heads, length, head_dim] views of the buffers
    per_slot = k.shape[0] * k.shape[1] * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())
    return per_slot * layer.capacity


# -- long generations: speed and memory as the generated length grows ------------------------------------------------
def long_generation(model, policy: str, budget: int, lengths: list[int], tau: int | None = None,
                    prompt_tokens: int = 64, seed: int = 0, memory: Callable[[], dict] | None = None,
                    on_point: Callable[[dict], None] | None = None, settings: dict | None = None) -> list[dict]:
    """Greedy decode up to max(lengths) new tokens; at each checkpoint report tokens/s of the last segment,
    cumulative tokens/s, cache length and (through `memory()`) peak memory so far."""
    pol = get_policy(policy, tau=tau, **(settings or {}))
    lengths = sorted(set(lengths))
    prompt = random_ids(model, prompt_tokens, seed)
    points = []
    with torch.inference_mode(), attention_for(model, pol):
        dec = Decoder(model, pol, budget if pol.evicts else None)
        nxt = dec.prefill(prompt, [0]).argmax(-1, keepdim=True)
        synchronize(dec.device)
        t_start = t_prev = time.perf_counter()
        done = 0
        for target in lengths:
            for _ in range(target - done):
                nxt = dec.step(nxt).argmax(-1, keepdim=True)
            synchronize(dec.device)
            now = time.perf_counter()
            kv = sum(kv_bytes(l) for l in dec.cache.layers)
            p = {"policy": policy, "budget": budget if pol.evicts else None, "tau": pol.tau if pol.evicts else None,
                 "generated": target, "segment_tokens_per_s": (target - done) / (now - t_prev),
                 "tokens_per_s": target / (now - t_start), "cache_length": dec.cache.stored_length(),
                 "kv_buffer_mib": kv / 2**20,
                 # this run's own KV peak (peak stored tokens x bytes per token), unlike a process's RSS high water
                 "kv_cache_peak_mib": dec.cache.stats()["max_cache_tokens"] * kv_bytes_per_token(model) / 2**20,
                 **(memory() if memory else {})}
            points.append(p)
            if on_point:
                on_point(p)
            done, t_prev = target, now
    return points
