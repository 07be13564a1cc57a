"""The evaluation plan (cells), one batch of generations -> records, and the local executor.

A cell is (problem id, policy, budget, sample); `full` runs once per problem (budget None). Cells with the same
policy, budget and sample are batched (left padding) in order of prompt length; executors only differ in where the
batches run. Records are built by `run_batch`, the same function on every executor."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import EpiKVError
from .datasets import Dataset
from ..failure import detect
from .grading import grade
from .prompts import Protocol, build_prompt
from .records import ensure_config, open_store


@dataclass
class EvalSpec:
    """Everything a worker needs to run batches (picklable: plain data only)."""

    dataset: str
    integer: bool
    model: str
    model_kwargs: dict  # dtype, device, device_map, attn_implementation
    protocol: Protocol
    max_new_tokens: int
    tau: int | None
    seed: int
    settings: dict  # policy name -> policy settings
    store_text: bool = True
    threads: int | None = None  # torch CPU threads in each worker process


@dataclass(frozen=True)
class Batch:
    policy: str
    budget: int | None
    sample: int
    ids: tuple[str, ...]


@dataclass
class Plan:
    spec: EvalSpec
    problems: dict[str, dict]  # id -> row (+ "prompt_ids")
    batches: list[Batch] = field(default_factory=list)
    n_done: int = 0  # cells of this run (shard) already in the directory when it was planned

    @property
    def n_cells(self) -> int:
        return sum(len(b.ids) for b in self.batches)


def evicts(policy: str) -> bool:
    from ..policies import REGISTRY

    return bool(getattr(REGISTRY[policy], "evicts", True))


def all_cells(ids: list[str], policies: list[str], budgets: list[int], samples: int) -> list[tuple]:
    cells = []
    for pol in policies:
        for k in (budgets if evicts(pol) else [None]):
            for s in range(samples):
                cells.extend((i, pol, k, s) for i in ids)
    return cells


def in_shard(cell: tuple, shard: tuple[int, int] | None) -> bool:
    """Stable split by a hash of the cell, so adding policies or budgets later keeps every cell on its shard."""
    if shard is None:
        return True
    i, n = shard
    return zlib.crc32(repr(cell).encode()) % n == i


def make_batches(cells: list[tuple], prompt_len: dict[str, int], batch_size: int) -> list[Batch]:
    groups: dict[tuple, list[str]] = {}
    for pid, pol, k, s in cells:
        groups.setdefault((pol, k, s), []).append(pid)
    out = []
    for (pol, k, s), ids in groups.items():
        ids = sorted(ids, key=lambda i: (prompt_len[i], i))  # similar lengths together: less padding
        out.extend(Batch(pol, k, s, tuple(ids[j : j + batch_size])) for j in range(0, len(ids), batch_size))
    return out


def check_budgets(problems: dict[str, dict], policies: list[str], budgets: list[int], settings: dict,
                  tau: int | None) -> None:
    """Every evicting (policy, budget) must hold every prompt plus the protected recent window."""
    from ..policies import get_policy

    longest = max(problems.values(), key=lambda r: len(r["prompt_ids"]))
    p = len(longest["prompt_ids"])
    for pol in policies:
        if not evicts(pol):
            continue
        for k in budgets:
            policy = get_policy(pol, tau=tau, **settings[pol])
            recent = policy.recent_window(k)
            prot = policy.protected(p)
            if prot + recent > k:
                raise EpiKVError(f"budget {k} is below what {pol} protects for problem {longest['id']}: a "
                                 f"{p}-token prompt + {recent} recent tokens; raise the budget, lower --recent or "
                                 f"--limit the problems")


def run_batch(lm, spec: EvalSpec, problems: dict[str, dict], batch: Batch, executor: str = "local",
              worker: str = "0") -> list[dict]:
    """Generate one batch and grade it: one record per problem."""
    from ..engine import Sampling, generate, sequence_seed
    from ..measure import RunPeak, kv_bytes_per_token

    device = next(lm.model.parameters()).device
    sampling = Sampling(temperature=spec.protocol.temperature, top_p=spec.protocol.top_p, seed=spec.seed)
    rows = [problems[i] for i in batch.ids]
    # one seed per sequence from (base seed, problem, sample): a sample does not depend on its batch or shard
    seeds = [sequence_seed(spec.seed, r["id"], batch.sample) for r in rows]
    t0 = time.perf_counter()
    with RunPeak(device) as peak:  # this batch's own peak, not the process's high-water mark
        res = generate(lm.model, lm.tokenizer, [r["prompt_ids"] for r in rows], policy=batch.policy,
                       budget=batch.budget, tau=spec.tau, max_new_tokens=spec.max_new_tokens, sampling=sampling,
                       seeds=seeds, **spec.settings.get(batch.policy, {}))
    wall = time.perf_counter() - t0
    st = res.stats
    total_new = max(sum(st["new_tokens"]), 1)
    recs = []
    for j, r in enumerate(rows):
        text, toks = res.texts[j], res.token_ids[j]
        hit_cap = res.finish_reasons[j] == "length"
        g = grade(spec.protocol.think_prefix + text if spec.protocol.think_prefix else text, r["answer"], spec.integer)
        fm = detect(text, toks, res.finish_reasons[j]).as_dict()
        rec = {
            "dataset": spec.dataset, "model": spec.model, "protocol": spec.protocol.name,
            "id": r["id"], "policy": batch.policy, "budget": batch.budget, "tau": st["tau"], "sample": batch.sample,
            "seed": seeds[j], "temperature": sampling.temperature, "top_p": sampling.top_p,
            "prompt_tokens": res.prompt_tokens[j], "new_tokens": len(toks), "max_new_tokens": spec.max_new_tokens,
            "finish_reason": res.finish_reasons[j], "gold": r["answer"], **g,
            "hit_cap": hit_cap, "empty": fm.get("empty"), "no_answer": fm.get("no_answer"),
            "repetition": fm.get("repetition"),
            # Batch-level measurements: the batch ran as one; time is shared in proportion to tokens.
            "batch_size": len(rows), "wall_seconds": round(wall, 4),
            "seconds_per_1k_tokens": round(1000 * wall / total_new, 4),
            "peak_memory_bytes": peak.bytes, "peak_memory_kind": peak.kind,
            # the batch's KV cache at its largest: stored slots (left padding included) x bytes per token x rows
            "kv_cache_peak_bytes": st["max_cache_tokens"] * kv_bytes_per_token(lm.model) * len(rows),
            "evictions": st["evictions"], "max_cache_tokens": st["max_cache_tokens"],
            "executor": executor, "worker": worker, "finished_at": round(time.time(), 3),
        }
        if spec.store_text:
            rec["output"] = text
        recs.append(rec)
    return recs


def prepare(out: Path, ds: Dataset, spec: EvalSpec, policies: list[str], budgets: list[int], samples: int,
            batch_size: int, shard: tuple[int, int] | None, tokenizer, config: dict,
            normalise: Callable[[dict], dict] | None = None) -> Plan:
    """Check inputs, write or check config.json, and plan the batches still to run. Records keep the dataset name
    the directory was created with (the same data named differently stays one dataset)."""
    problems = {}
    for r in ds.rows:
        problems[r["id"]] = dict(r, prompt_ids=build_prompt(tokenizer, r["problem"], spec.protocol))
    check_budgets(problems, policies, budgets, spec.settings, spec.tau)
    held = ensure_config(out, config, normalise)
    spec.dataset = held.get("dataset", spec.dataset)
    store = open_store(out)
    cells = [c for c in all_cells(list(problems), policies, budgets, samples) if in_shard(c, shard)]
    todo = [c for c in cells if c not in store.done]
    lens = {i: len(r["prompt_ids"]) for i, r in problems.items()}
    return Plan(spec, problems, make_batches(todo, lens, batch_size), n_done=len(cells) - len(todo))


class Progress:
    """Progress over generations (`epikv.progress`): a tqdm bar on a terminal, plain periodic lines otherwise
    ("eval: 12/60 cells, 3.1 min elapsed, ~12 min left"), with the current batch and the accuracy so far."""

    def __init__(self, total: int, quiet: bool = False, done: int = 0):
        from ..progress import Progress as _P

        self.p = _P("eval", total=done + total, unit="cells", done=done, quiet=quiet)
        self.n = self.ok = 0
        self.batch = ""

    def start(self, batch: Batch) -> None:
        self.batch = f"{batch.policy} K={batch.budget} s{batch.sample}"
        self._status()

    def _status(self) -> None:
        acc = f", acc {self.ok / self.n:.1%}" if self.n else ""
        self.p.set_status(self.batch + acc)

    def update(self, recs: list[dict]) -> None:
        self.n += len(recs)
        self.ok += sum(bool(r["correct"]) for r in recs)
        self._status()
        self.p.update(len(recs))

    def skip(self, n: int) -> None:
        """Cells found finished or taken by another process."""
        self.p.skip(n)

    def close(self) -> None:
        self.p.close()


def claim_batch(store, batch: Batch) -> Batch | None:
    """The part of `batch` this process may run: cells neither finished nor claimed by a live process (claimed
    here until their records are written)."""
    cells = [(i, batch.policy, batch.budget, batch.sample) for i in batch.ids]
    got = set(store.claim(cells))
    ids = tuple(c[0] for c in cells if c in got)
    return Batch(batch.policy, batch.budget, batch.sample, ids) if ids else None


def run_local(plan: Plan, lm, records_path: Path, quiet: bool = False) -> int:
    """Run the planned batches; several processes may share the directory (each cell runs once)."""
    bar = Progress(plan.n_cells, quiet, done=plan.n_done)
    n = 0
    try:
        with open_store(records_path.parent, records_path.name) as store:
            for b in plan.batches:
                mine = claim_batch(store, b)
                if mine is None or len(mine.ids) < len(b.ids):
                    bar.skip(len(b.ids) - (len(mine.ids) if mine else 0))
                if mine is None:
                    continue
                bar.start(mine)
                recs = run_batch(lm, plan.spec, plan.problems, mine)
                store.append(recs)
                n += len(recs)
                bar.update(recs)
    finally:
        bar.close()
    return n
