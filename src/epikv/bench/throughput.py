"""Throughput under a KV-memory cap: per policy, the largest static batch whose cache fits the cap, and what it buys.

Memory is counted from the buffers the cache really allocates, so a cap means the same on the CPU and on a GPU:
- bytes per slot and sequence from the model config: layers x kv_heads x head_dim x 2 (K and V) x dtype bytes;
- slots per layer from BufferLayer's capacity rule, replayed step by step (`simulate`): the EpiKVCache capacity
  hint (read from a real cache, not copied), at least the prefill width, doubling when a step does not fit, shrunk
  back to the hint by a compaction that leaves it more than twice too large. An evicting policy thus holds
  K + tau + slack slots from the start; `full` grows 256 -> 512 -> ... (or width -> 2 x width ...);
- what an observing policy holds until the eviction hook consumes it, in the model dtype: the attention weights
  [batch, heads, q, kv] of every observed layer (eager policies: q = kv = prompt width at the prefill), the hidden
  states [batch, q, hidden] of the observed blocks, the rolling query window of query-based policies.
Every run measures the real buffers after the prefill and after every step and records whether they match the
prediction (`kv_accounting_exact`). Not counted: per-token policy data (scores, positions: reported as measured,
well under 1 % of the KV buffers) and one layer's transient copy while a buffer is reallocated or compacted.

Static batches: requests are taken in dataset order, `batch` at a time, left-padded to the batch's longest prompt;
a request keeps its slot until its batch ends. Every request generates exactly `new_tokens` tokens (EOS ignored),
so every policy does the same work; where a request's greedy output first hits EOS is recorded, and the slot-steps
after it (plus the empty slots of a last, partial batch) are reported as what static batching wastes.
Runs of different (policy, batch) configurations are interleaved one batch at a time, so machine-load drift hits
every configuration alike.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine import Decoder, attention_for, left_pad
from ..errors import EpiKVError
from ..policies import Policy, get_policy
from .speed import kv_bytes, synchronize

MIB = 2**20
FULL = "full"


# -- the accounting ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What the cache's size depends on, from the model config and dtype."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype_bytes: int
    context: int | None  # max_position_embeddings

    @classmethod
    def of(cls, model) -> "Shape":
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype = next(model.parameters()).dtype
        return cls(layers=cfg.num_hidden_layers, heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, hidden=cfg.hidden_size, dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                   context=getattr(cfg, "max_position_embeddings", None))

    @property
    def slot_bytes(self) -> int:
        """K and V of one token of one sequence, all layers."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


@dataclass
class Plan:
    """One policy's cache under the cap: the capacity rule and what it observes."""

    label: str
    policy: Policy
    budget: int | None  # None: never evicts
    hint: int  # BufferLayer capacity hint of this cache (slots)
    shape: Shape

    @classmethod
    def make(cls, model, name: str, budget: int, tau: int | None = None, settings: dict | None = None) -> "Plan":
        pol = get_policy(name, tau=tau, **(settings or {}))
        shape = Shape.of(model)
        if pol.evicts and pol.uncompressed_layers(shape.layers):
            raise EpiKVError(f"{name} leaves layers {list(pol.uncompressed_layers(shape.layers))} uncompressed, which "
                             "padded static batches cannot hold: not supported by bench throughput")
        with attention_for(model, pol):
            probe = Decoder(model, pol, budget if pol.evicts else None)  # allocates nothing until the first update
        hint = probe.cache.layers[0].capacity_hint
        label = f"{name}@K={budget}" if pol.evicts else name
        return cls(label, pol, budget if pol.evicts else None, hint, shape)

    def check_prompt(self, width: int, longest: int, new_tokens: int) -> None:
        """What the engine would refuse mid-run, refused up front in one line."""
        p = self.policy
        if self.budget is not None:
            prot = p.protected(longest)
            recent = p.recent_window(self.budget)
            if prot + recent > self.budget:
                raise EpiKVError(f"budget {self.budget} is smaller than what {p.name} protects: a {longest}-token "
                                 f"prompt + {recent} recent tokens; raise --budgets or lower --max-prompt-tokens")
        if self.shape.context and width + new_tokens > self.shape.context:
            raise EpiKVError(f"a {width}-token prompt + {new_tokens} new tokens exceeds the model's context limit of "
                             f"{self.shape.context} positions; lower --max-new-tokens or --max-prompt-tokens")

    def observed_bytes(self, q: int, kv: int, width: int) -> int:
        """Per sequence: what the policy's observations hold during a forward of q queries over kv keys."""
        obs = self.policy.observes(self.shape.layers)
        s, b = self.shape, self.shape.dtype_bytes
        n = len(obs.attention_layers) * s.heads * q * kv * b  # [batch, heads, q, kv] per observed layer
        n += len(obs.hidden_layers) * q * s.hidden * b  # [batch, q, hidden] per observed block
        if obs.queries:  # rolling window [batch, heads, <= w, head_dim], kept across steps
            n_q = len(getattr(obs, "query_layers", ()) or ()) or s.layers
            n += n_q * s.heads * min(obs.queries, max(width, q)) * s.head_dim * b
        return n

    def simulate(self, width: int, new_tokens: int) -> dict:
        """Replay the capacity rule for one sequence: prefill of `width` slots, then new_tokens - 1 single-token
        steps (the last token is sampled, never fed). Returns peak slots, peak bytes (KV + observations) and the
        largest stored length, all per sequence."""
        p, budget, hint = self.policy, self.budget, self.hint
        cap, length = max(hint, width), width
        peak_slots = cap
        peak = cap * self.shape.slot_bytes + self.observed_bytes(width, width, width)

        def end_step(length: int, cap: int) -> tuple[int, int]:
            if budget is not None and length > budget + p.tau - 1:
                length = budget  # evict back to exactly K
                if cap > 2 * hint:  # compaction releases what the budget no longer needs
                    cap = hint
            return length, cap

        longest = length
        length, cap = end_step(length, cap)
        for _ in range(new_tokens - 1):
            need = length + 1
            if need > cap:
                cap = max(need, 2 * cap)  # geometric growth
            peak_slots = max(peak_slots, cap)
            peak = max(peak, cap * self.shape.slot_bytes + self.observed_bytes(1, need, width))
            longest = max(longest, need)
            length, cap = end_step(need, cap)
        return {"peak_slots": peak_slots, "kv_bytes": peak_slots * self.shape.slot_bytes, "peak_bytes": peak,
                "max_stored": longest}


def chunks(n: int, batch: int) -> list[range]:
    """Request indices of each static batch, in dataset order."""
    return [range(i, min(n, i + batch)) for i in range(0, n, batch)]


def batch_bytes(plan: Plan, widths: list[int], batch: int, new_tokens: int) -> list[dict]:
    """Predicted bytes of every static batch of `batch` requests (each padded to its own longest prompt)."""
    out = []
    for idx in chunks(len(widths), batch):
        w = max(widths[i] for i in idx)
        sim = plan.simulate(w, new_tokens)
        out.append({"rows": len(idx), "width": w, "kv_bytes": len(idx) * sim["kv_bytes"],
                    "peak_bytes": len(idx) * sim["peak_bytes"], "max_stored": sim["max_stored"]})
    return out


def fits(plan: Plan, widths: list[int], batch: int, new_tokens: int, cap_bytes: int) -> bool:
    return all(b["peak_bytes"] <= cap_bytes for b in batch_bytes(plan, widths, batch, new_tokens))


def max_batch(plan: Plan, widths: list[int], new_tokens: int, cap_bytes: int) -> int:
    """The largest batch (at most the number of requests) whose every static batch fits the cap; 0 if none.
    Scanned, not bisected: full's doubling makes bytes non-monotonic in the prompt width."""
    return max((b for b in range(1, len(widths) + 1) if fits(plan, widths, b, new_tokens, cap_bytes)), default=0)


def concurrency(plan: Plan, width: int, new_tokens: int, cap_bytes: int) -> int:
    """How many sequences of prompt width `width` fit the cap at once (not limited by the request count)."""
    return cap_bytes // plan.simulate(width, new_tokens)["peak_bytes"]


# -- measuring ---------------------------------------------------------------------------------------------------------
def buffer_bytes(cache) -> int:
    """Bytes the cache's K/V buffers hold right now (capacity, not just the used slots)."""
    return sum(kv_bytes(layer) for layer in cache.layers)


def _data_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.token_data.values())


def run_batch(model, plan: Plan, prompts: list[list[int]], new_tokens: int, pad_id: int, eos: list[int]) -> dict:
    """One static batch: prefill, then new_tokens - 1 greedy steps with EOS ignored. Times it and measures the real
    buffers after the prefill and after every step (a host-side read, no device sync)."""
    ids, n_pad = left_pad(prompts, pad_id)
    b = ids.shape[0]
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    with torch.inference_mode(), attention_for(model, plan.policy):
        dec = Decoder(model, plan.policy, plan.budget)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        synchronize(dev)
        t0 = time.perf_counter()
        nxt = dec.prefill(ids, n_pad).argmax(-1)  # [batch]
        kv_peak, data_peak = buffer_bytes(dec.cache), _data_bytes(dec.cache)
        out = torch.empty(b, new_tokens, dtype=torch.long, device=nxt.device)
        out[:, 0] = nxt
        synchronize(dev)
        t_prefill = time.perf_counter() - t0
        for i in range(1, new_tokens):
            nxt = dec.step(nxt[:, None]).argmax(-1)
            out[:, i] = nxt
            kv_peak = max(kv_peak, buffer_bytes(dec.cache))
        data_peak = max(data_peak, _data_bytes(dec.cache))
        synchronize(dev)
        seconds = time.perf_counter() - t0
        rec = {"rows": b, "width": ids.shape[1], "seconds": seconds, "prefill_seconds": t_prefill,
               "kv_peak_bytes": kv_peak, "policy_data_bytes": data_peak, "max_cache_tokens": dec.cache.max_tokens,
               "evictions": dec.cache.evictions}
        if cuda:
            peak = torch.cuda.max_memory_allocated(dev)
            rec.update(cuda_peak_bytes=peak, cuda_peak_over_start_bytes=peak - base)
    toks = out.tolist()
    eos_set = set(eos)
    # the first EOS of each row's greedy output: a static batch would keep that slot busy from there to the end
    rec["first_eos"] = [next((j for j, t in enumerate(row) if t in eos_set), None) for row in toks]
    return rec


@dataclass
class Config:
    """One (policy, batch) point: its static batches and what they measured."""

    plan: Plan
    batch: int
    jobs: list[range]
    full_set: bool  # every request runs (else only the first batch: a ladder point)
    records: list[dict] = field(default_factory=list)


def warm_up(model, plans: list[Plan], prompt: list[int], pad_id: int) -> None:
    """First-call allocations and kernel selection, not timed."""
    for plan in plans:
        run_batch(model, plan, [prompt], 4, pad_id, [])


def run_throughput(model, tokenizer, plans: list[Plan], prompts: list[list[int]], new_tokens: int, cap_mib: float,
                   ladder: int = 1, extra_batches: list[int] | None = None, ladder_full_set: bool = False,
                   eos: list[int] | None = None, journal=None, job_key: Callable[[Config, int], str] | None = None,
                   on_job: Callable[[Config, int, dict], None] | None = None) -> dict:
    """Find each plan's largest fitting batch, run the request set at it (and at smaller batches), return points and
    ratios to `full`."""
    cap = int(cap_mib * MIB)
    widths = [len(p) for p in prompts]
    n = len(prompts)
    for plan in plans:
        plan.check_prompt(max(widths), max(widths), new_tokens)
    found = {}
    for plan in plans:
        b = max_batch(plan, widths, new_tokens, cap)
        if b == 0:
            need = max(x["peak_bytes"] for x in batch_bytes(plan, widths, 1, new_tokens))
            raise EpiKVError(f"--cap-mib {cap_mib:g} is too small for one {plan.label} sequence: it needs "
                             f"{need / MIB:.1f} MiB (prompt + {new_tokens} new tokens)")
        found[plan.label] = b
    full_b = next((found[p.label] for p in plans if p.policy.name == FULL), None)
    configs: list[Config] = []
    for plan in plans:
        top = found[plan.label]
        sizes = {top} | {top >> k for k in range(1, ladder + 1) if top >> k >= 1} | set(extra_batches or [])
        if full_b:
            sizes.add(full_b)  # every policy also at full's batch: per-sequence speed at equal concurrency
        for b in sorted(sizes, reverse=True):
            if b > n or not fits(plan, widths, b, new_tokens, cap):
                continue
            whole = b == top or ladder_full_set
            jobs = chunks(n, b) if whole else chunks(n, b)[:1]
            configs.append(Config(plan, b, jobs, whole))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    warm_up(model, plans, prompts[0], pad_id)
    rounds = max(len(c.jobs) for c in configs)
    for j in range(rounds):  # one batch of every configuration per round
        for c in configs:
            if j >= len(c.jobs):
                continue
            key = job_key(c, j) if job_key else None
            if journal is not None and key in journal.done:
                rec = journal.done[key]["record"]
            else:
                rec = run_batch(model, c.plan, [prompts[i] for i in c.jobs[j]], new_tokens, pad_id, eos or [])
                pred = batch_bytes(c.plan, [widths[i] for i in c.jobs[j]], len(c.jobs[j]), new_tokens)[0]
                rec.update(job=j, requests=list(c.jobs[j]), predicted_kv_bytes=pred["kv_bytes"],
                           predicted_peak_bytes=pred["peak_bytes"],
                           kv_accounting_exact=rec["kv_peak_bytes"] == pred["kv_bytes"])
                if journal is not None and key is not None:
                    journal.add({"key": key, "record": rec})
            c.records.append(rec)
            if on_job:
                on_job(c, j, rec)
    points = [summarize(c, n, new_tokens, cap) for c in configs]
    search = {}
    for plan in plans:
        search[plan.label] = {
            "policy": plan.policy.name, "budget": plan.budget, "tau": plan.policy.tau if plan.budget else None,
            "max_batch": found[plan.label],
            "fits_sequences_of_longest_prompt": concurrency(plan, max(widths), new_tokens, cap),
            "capacity_hint_slots": plan.hint,
            "per_sequence_at_longest_prompt": plan.simulate(max(widths), new_tokens),
            "batch_plus_one_fits": (found[plan.label] < n and fits(plan, widths, found[plan.label] + 1, new_tokens, cap)),
        }
        if plan.policy.name == FULL:  # what full would fit with buffers of exactly prompt + new tokens
            exact = (max(widths) + new_tokens - 1) * plan.shape.slot_bytes
            search[plan.label]["fits_sequences_if_allocated_exactly"] = cap // exact
    return {"cap_mib": cap_mib, "requests": n, "new_tokens": new_tokens, "prompt_tokens": widths,
            "slot_bytes": plans[0].shape.slot_bytes, "shape": plans[0].shape.__dict__, "search": search,
            "points": points, "ratios": ratios(points, FULL)}


def summarize(c: Config, n: int, new_tokens: int, cap: int) -> dict:
    recs = c.records
    seconds = sum(r["seconds"] for r in recs)
    rows = sum(r["rows"] for r in recs)
    tokens = rows * new_tokens
    slot_steps = len(recs) * c.batch * new_tokens
    idle = sum((c.batch - r["rows"]) * new_tokens for r in recs)  # empty slots of a last, partial batch
    after_eos = sum(new_tokens - (e + 1) for r in recs for e in r["first_eos"] if e is not None)
    p = {"label": c.plan.label, "policy": c.plan.policy.name, "budget": c.plan.budget,
         "attention_free": c.plan.policy.attention_free, "batch": c.batch, "full_request_set": c.full_set,
         "batches_run": len(recs), "requests_run": rows, "seconds": seconds,
         "prefill_seconds": sum(r["prefill_seconds"] for r in recs),
         "aggregate_tokens_per_s": tokens / seconds,
         "decode_tokens_per_s": rows * (new_tokens - 1) / max(seconds - sum(r["prefill_seconds"] for r in recs), 1e-9),
         "per_sequence_tokens_per_s": sum(new_tokens / r["seconds"] * r["rows"] for r in recs) / rows,
         "time_all_requests_s": seconds if c.full_set else None,
         "projected_time_all_requests_s": seconds if c.full_set else seconds / len(recs) * math.ceil(n / c.batch),
         "kv_peak_bytes": max(r["kv_peak_bytes"] for r in recs),
         "predicted_peak_bytes": max(r["predicted_peak_bytes"] for r in recs),
         "kv_accounting_exact": all(r["kv_accounting_exact"] for r in recs),
         "policy_data_bytes": max(r["policy_data_bytes"] for r in recs),
         "cap_bytes": cap,
         "slot_steps": slot_steps, "slot_steps_idle": idle, "slot_steps_after_first_eos": after_eos,
         "static_waste_fraction": (idle + after_eos) / slot_steps,
         "first_job_seconds": recs[0]["seconds"], "first_job_rows": recs[0]["rows"]}
    if all("cuda_peak_bytes" in r for r in recs):
        p["cuda_peak_bytes"] = max(r["cuda_peak_bytes"] for r in recs)
        p["cuda_peak_over_start_bytes"] = max(r["cuda_peak_over_start_bytes"] for r in recs)
    return p


def ratios(points: list[dict], base: str = FULL) -> dict:
    """Each policy against `full`: at each one's largest batch (what the cap buys), and at full's batch (per-sequence
    speed at equal concurrency, same requests: the first batch)."""
    top = {}
    for p in points:
        if p["full_request_set"] and (p["label"] not in top or p["batch"] > top[p["label"]]["batch"]):
            top[p["label"]] = p
    if base not in top:
        return {}
    f = top[base]
    out: dict = {"at_max_batch": {}, "at_full_batch": {}}
    for label, p in top.items():
        if label == base:
            continue
        r = {"batch": p["batch"] / f["batch"], "aggregate_tokens_per_s": p["aggregate_tokens_per_s"] / f["aggregate_tokens_per_s"],
             "time_all_requests": p["time_all_requests_s"] / f["time_all_requests_s"],
             "per_sequence_tokens_per_s": p["per_sequence_tokens_per_s"] / f["per_sequence_tokens_per_s"],
             "kv_peak_bytes": p["kv_peak_bytes"] / f["kv_peak_bytes"]}
        if "cuda_peak_bytes" in p and "cuda_peak_bytes" in f:
            r["cuda_peak_bytes"] = p["cuda_peak_bytes"] / f["cuda_peak_bytes"]
        out["at_max_batch"][label] = r
        same = next((q for q in points if q["label"] == label and q["batch"] == f["batch"]), None)
        if same is not None:  # first batch of each: the same requests
            out["at_full_batch"][label] = {
                "batch": f["batch"],
                "per_sequence_tokens_per_s": (f["first_job_seconds"] / same["first_job_seconds"]),
                "kv_peak_bytes": same["kv_peak_bytes"] / f["kv_peak_bytes"]}
    return {k: v for k, v in out.items() if v}


def job_key(model_name: str, device: str, dtype: str, new_tokens: int, cap_mib: float, settings: dict):
    """Journal key of one static batch: a rerun skips the batches already measured with the same settings."""

    def key(c: Config, j: int) -> str:
        return json.dumps(["throughput", model_name, device, dtype, c.plan.label, c.plan.policy.tau,
                           settings.get(c.plan.policy.name, {}), c.batch, list(c.jobs[j]), new_tokens, cap_mib],
                          sort_keys=True, default=str)

    return key
