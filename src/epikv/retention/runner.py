"""Stream reasoning traces through the model under each policy and budget; compare with the full cache.

Per trace: the chat-formatted problem is prefilled (protected), then reasoning (up to and including `</think>`)
and answer are fed in chunks of tau tokens with all logits, the cache evicting after each chunk. The full cache
runs once per trace (same chunks) and every (policy, budget) run is compared with it chunk by chunk.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..data import read_jsonl, traces_path
from ..engine import Decoder, attention_for, encode_prompts
from ..errors import EpiKVError
from ..policies import get_policy
from .bootstrap import policy_label
from .metrics import Accumulator, Reference
from ..measure import RunPeak
from ..store import CLAIMS, LOCK, Store

THINK_END = "</think>"
KIND = "retention"


@dataclass
class TraceItem:
    id: str
    prompt_ids: list[int]
    reasoning_ids: list[int]  # ends with the tokens of `</think>`
    answer_ids: list[int]
    meta: dict
    n_body: int | None = None  # reasoning tokens before `</think>` (None: all of reasoning_ids)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.reasoning_ids + self.answer_ids


def load_traces(path: str | Path) -> list[dict]:
    """Traces of a JSONL file, or of a named set shipped with the package (`shared-28`)."""
    path = traces_path(str(path))
    rows = read_jsonl(path, required=("id",))
    if not rows:
        raise EpiKVError(f"{path} holds no traces")
    return rows


def prepare_traces(rows: Sequence[dict], tokenizer, max_reasoning_tokens: int | None = None,
                   system: str | None = None, max_answer_tokens: int | None = None) -> tuple[list[TraceItem], list[tuple[str, str]]]:
    """Tokenize traces; returns (items, skipped) where skipped lists (id, reason) for unusable traces.

    max_reasoning_tokens keeps the first N tokens of the reasoning before `</think>` (the closing tag is kept);
    max_answer_tokens scores only the first N answer tokens (CPU-sized runs)."""
    items, skipped = [], []
    for row in rows:
        tid = str(row.get("id"))
        trace, problem = row.get("trace"), row.get("problem")
        if not isinstance(trace, str) or not isinstance(problem, str) or not problem.strip():
            skipped.append((tid, "missing trace or problem text"))
            continue
        cut = trace.find(THINK_END)
        if cut < 0:
            skipped.append((tid, f"no {THINK_END} in the trace"))
            continue
        body, answer = trace[:cut], trace[cut + len(THINK_END):]
        if not answer.strip():
            skipped.append((tid, f"empty answer after {THINK_END}"))
            continue
        prompt_ids = encode_prompts(tokenizer, [problem], chat=True, system=system)[0]
        body_ids = tokenizer(body, add_special_tokens=False)["input_ids"]
        if max_reasoning_tokens is not None:
            body_ids = body_ids[:max_reasoning_tokens]
        reasoning = body_ids + tokenizer(THINK_END, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:max_answer_tokens]
        meta = {k: row[k] for k in ("source_model", "is_correct") if k in row}
        items.append(TraceItem(tid, list(prompt_ids), list(reasoning), list(answer_ids), meta, len(body_ids)))
    return items, skipped


def _stream(model, item: TraceItem, policy, budget: int | None, on_logits: Callable[[int, torch.Tensor], None]):
    """Prefill the prompt, then feed the rest in chunks of policy.tau; on_logits(j, logits [T, vocab]) gets the
    predictions of tokens P + j .. P + j + T - 1. Returns (forward seconds, cache stats, peak KV MiB)."""
    if hasattr(model, "stream_trace"):  # another engine (epikv.retention.llamacpp): the same chunks, its own cache
        return model.stream_trace(item, policy, budget, on_logits)
    ids = torch.tensor([item.ids])  # [1, N]
    p, n, tau = len(item.prompt_ids), ids.shape[1], policy.tau
    fwd = 0.0
    with torch.inference_mode(), attention_for(model, policy):
        dec = Decoder(model, policy, budget)
        t0 = time.perf_counter()
        last = dec.prefill(ids[:, :p], [0])  # [1, vocab], predicts token P
        fwd += time.perf_counter() - t0
        on_logits(0, last)
        for s in range(p, n - 1, tau):  # the last token predicts nothing we score
            e = min(s + tau, n - 1)
            t0 = time.perf_counter()
            logits = dec.step(ids[:, s:e], all_logits=True)[0]  # [T, vocab]
            fwd += time.perf_counter() - t0
            on_logits(s + 1 - p, logits)
        stats = dec.cache.stats()
        layer = dec.cache.layers[0]
        per_token = 2 * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size() * dec.cache.n_layers
    return fwd, stats, stats["max_cache_tokens"] * per_token / 2**20


def batchable(policy, n_layers: int = 1) -> bool:
    """Whether a policy's rows are independent, so traces may share one batch: a random-number generator in its
    state is shared by the rows (each row's draws would depend on its batch-mates), so such policies run alone.
    n_layers: the model's depth (signals.model_depth), for a policy whose state depends on the model (a learned
    score's weights are looked up by its shape)."""
    def has_gen(x, seen) -> bool:
        if isinstance(x, torch.Generator):
            return True
        if id(x) in seen or isinstance(x, (torch.Tensor, str, bytes, int, float, type(None))):
            return False
        seen.add(id(x))
        if isinstance(x, dict):
            return any(has_gen(v, seen) for v in x.values())
        if isinstance(x, (list, tuple, set)):
            return any(has_gen(v, seen) for v in x)
        return any(has_gen(v, seen) for v in getattr(x, "__dict__", {}).values())

    return not has_gen(policy.init_state(2, n_layers, torch.device("cpu")), set())


def _stream_batch(model, items: Sequence[TraceItem], policy, budget: int | None,
                  on_logits: Callable[[int, int, torch.Tensor], None]) -> list[tuple[float, dict, float]]:
    """_stream for several traces with the same prompt length as one batch (no padding, so every row has the same
    stored length and the shared eviction schedule is each row's own). A row whose stream ends inside the next chunk
    leaves the batch: its last, shorter chunk runs on its own copy of the cache (its policy state selected with it),
    so each row sees exactly the chunks and evictions of a single run. on_logits(row, j, logits [T, vocab]);
    returns per row (forward seconds, its share of the batch forwards; cache stats; peak KV MiB)."""
    p = len(items[0].prompt_ids)
    if any(len(it.prompt_ids) != p for it in items):
        raise ValueError("a batch of traces needs one prompt length")
    ns = [len(it.ids) for it in items]
    width = max(ns)
    ids = torch.tensor([it.ids + [0] * (width - len(it.ids)) for it in items])  # [B, N]; the tail is never fed
    tau = policy.tau
    fwd = [0.0] * len(items)
    out: list = [None] * len(items)

    def finish(dec, i):
        stats = dec.cache.stats()
        layer = dec.cache.layers[0]
        per_token = 2 * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size() * dec.cache.n_layers
        out[i] = (fwd[i], stats, stats["max_cache_tokens"] * per_token / 2**20)

    with torch.inference_mode(), attention_for(model, policy):
        dec = Decoder(model, policy, budget)
        rows = list(range(len(items)))  # batch row -> item
        t0 = time.perf_counter()
        last = dec.prefill(ids[:, :p], [0] * len(rows))  # [B, vocab], predicts token P
        for i in rows:
            fwd[i] += (time.perf_counter() - t0) / len(rows)
            on_logits(i, 0, last[i : i + 1])
        s = p
        while rows:
            stay = []
            for r, i in enumerate(rows):
                e = min(s + tau, ns[i] - 1)  # the last token predicts nothing we score
                if e - s == tau:
                    stay.append(r)
                    continue
                if e > s:  # a shorter last chunk: on a copy holding only this row
                    one = copy.copy(dec)
                    one.cache = copy.deepcopy(dec.cache)
                    one.cache.batch_select_indices([r])
                    t0 = time.perf_counter()
                    logits = one.step(ids[i : i + 1, s:e], all_logits=True)[0]  # [T, vocab]
                    fwd[i] += time.perf_counter() - t0
                    on_logits(i, s + 1 - p, logits)
                    finish(one, i)
                else:  # fed to its end: the batch's stats are its own
                    finish(dec, i)
            if len(stay) < len(rows):
                if stay:
                    dec.cache.batch_select_indices(stay)
                rows = [rows[r] for r in stay]
            if not rows:
                break
            t0 = time.perf_counter()
            logits = dec.step(ids[rows, s : s + tau], all_logits=True)  # [B, T, vocab]
            dt = (time.perf_counter() - t0) / len(rows)
            for r, i in enumerate(rows):
                fwd[i] += dt
                on_logits(i, s + 1 - p, logits[r])
            s += tau
    return out


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _mib(n: int | None) -> float | None:
    return None if n is None else n / 2**20


class _RefBuffer:
    """The full cache's log-probabilities of one trace, written chunk by chunk into one preallocated tensor (a whole
    8k-token trace is ~1.5 GiB of float32 log-probabilities on a 49k vocabulary: no second copy from a concatenation)."""

    def __init__(self, item: TraceItem) -> None:
        self.n = len(item.reasoning_ids) + len(item.answer_ids)
        self.logp: torch.Tensor | None = None  # [n, vocab], allocated at the first chunk (vocab and device known)
        self.top1: torch.Tensor | None = None

    def __call__(self, j: int, logits: torch.Tensor) -> None:
        x = logits[: self.n - j].float()
        if self.logp is None:
            self.logp = torch.empty(self.n, x.shape[-1], dtype=torch.float32, device=x.device)
            self.top1 = torch.empty(self.n, dtype=torch.long, device=x.device)
        out = self.logp[j : j + x.shape[0]]
        torch.log_softmax(x, dim=-1, out=out)
        self.top1[j : j + x.shape[0]] = out.argmax(-1)


def reference_pass(model, item: TraceItem, tau: int) -> Reference:
    """The full cache's log-probabilities at every predicted position, streamed in the same chunks of tau."""
    buf = _RefBuffer(item)
    with RunPeak(model.device) as peak:  # this pass's own peak (CUDA allocator, else sampled RSS)
        secs, stats, kv = _stream(model, item, get_policy("full", tau=tau), None, buf)
    return _reference(item, buf, secs, stats, kv, peak)


def _reference(item: TraceItem, buf: _RefBuffer, secs: float, stats: dict, kv: float, peak) -> Reference:
    """One trace's Reference from its filled buffer."""
    ref = Reference(logp=buf.logp, top1=buf.top1,
                    targets=torch.tensor(item.reasoning_ids + item.answer_ids, device=buf.logp.device),
                    n_reasoning=len(item.reasoning_ids), seconds=secs,
                    peak_cache_tokens=stats["max_cache_tokens"], peak_kv_mib=kv, peak_mem_mib=_mib(peak.bytes),
                    n_body=item.n_body)
    ref.peak_mem_kind = peak.kind
    return ref


def make_policy(name: str, tau: int, settings: dict):
    """The policy of a run: the folder's tau unless the variant sets its own (`random[tau=16]` in a folder at tau
    128: rows at equal peak bytes, each policy at its own schedule)."""
    return get_policy(name, **{"tau": tau, **settings})


def policy_pass(model, item: TraceItem, ref: Reference, policy: str, budget: int | None, tau: int,
                settings: dict | None = None) -> dict:
    """Metrics of one (policy, budget) run on one trace against the reference."""
    pol = make_policy(policy, tau, settings or {})
    acc = Accumulator(ref)
    with RunPeak(model.device) as peak:  # this run's own peak, not the process's high-water mark
        secs, stats, kv = _stream(model, item, pol, budget if pol.evicts else None, acc.add)
    out = acc.result()
    out.update(seconds=secs, evictions=stats["evictions"], peak_cache_tokens=stats["max_cache_tokens"],
               peak_kv_mib=kv, peak_mem_mib=_mib(peak.bytes), peak_mem_kind=peak.kind)
    out.update({k: v for k, v in stats.items() if k.startswith("kv_peak")})  # llama.cpp's peak KV bytes
    return out


def reference_pass_batch(model, items: Sequence[TraceItem], tau: int) -> list[Reference]:
    """reference_pass for traces of one prompt length as one batch (`_stream_batch`); the peak memory of each is
    the batch's."""
    bufs = [_RefBuffer(it) for it in items]
    with RunPeak(model.device) as peak:
        runs = _stream_batch(model, items, get_policy("full", tau=tau), None, lambda i, j, x: bufs[i](j, x))
    return [_reference(it, b, secs, stats, kv, peak) for it, b, (secs, stats, kv) in zip(items, bufs, runs)]


def policy_pass_batch(model, items: Sequence[TraceItem], refs: Sequence[Reference], policy: str,
                      budget: int | None, tau: int, settings: dict | None = None) -> list[dict]:
    """policy_pass for traces of one prompt length as one batch; each row's metrics are its single run's."""
    pol = make_policy(policy, tau, settings or {})
    accs = [Accumulator(r) for r in refs]
    with RunPeak(model.device) as peak:
        runs = _stream_batch(model, items, pol, budget if pol.evicts else None, lambda i, j, x: accs[i].add(j, x))
    outs = []
    for acc, (secs, stats, kv) in zip(accs, runs):
        out = acc.result()
        out.update(seconds=secs, evictions=stats["evictions"], peak_cache_tokens=stats["max_cache_tokens"],
                   peak_kv_mib=kv, peak_mem_mib=_mib(peak.bytes), peak_mem_kind=peak.kind)
        outs.append(out)
    return outs


def batches(items: Sequence[TraceItem], size: int) -> list[list[TraceItem]]:
    """Traces grouped into batches of at most `size` with one prompt length each (no padding: see
    `_stream_batch`), in order of first appearance."""
    groups: dict[int, list[list[TraceItem]]] = {}
    order: list[list[TraceItem]] = []
    for it in items:
        g = groups.setdefault(len(it.prompt_ids), [])
        if not g or len(g[-1]) >= size:
            g.append([])
            order.append(g[-1])
        g[-1].append(it)
    return order


def reference_metrics(ref: Reference) -> dict:
    """The full cache scored against itself (zero loss by construction, computed, not assumed)."""
    acc = Accumulator(ref)
    acc.add_logp(0, ref.logp)
    out = acc.result()
    out.update(seconds=ref.seconds, evictions=0, peak_cache_tokens=ref.peak_cache_tokens, peak_kv_mib=ref.peak_kv_mib,
               peak_mem_mib=ref.peak_mem_mib, peak_mem_kind=getattr(ref, "peak_mem_kind", None))
    return out


def record_key(rec: dict) -> tuple:
    return (rec["trace_id"], rec["policy"], rec["budget"], json.dumps(rec.get("settings") or {}, sort_keys=True))


def engine_of(model) -> str:
    """The engine a model runs on: "torch" for a transformers model, else the adapter's own name."""
    return getattr(model, "epikv_engine", "torch")


# config keys older folders lack, with the value they meant (every folder before the llama.cpp engine is torch's)
_CONFIG_DEFAULTS = {"engine": "torch", "cache_type_k": "f16", "cache_type_v": "f16"}


def _check_config(out_dir: Path, config: dict) -> None:
    """One results folder holds one setting (model, engine, tau, cap, prompt); policies and budgets may be added
    later."""
    path = out_dir / "config.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise EpiKVError(f"{path} is malformed; move it away or use another --out") from None
        old = {**_CONFIG_DEFAULTS, **old}
        diff = [k for k in config if old.get(k) != config[k]]
        if diff:
            raise EpiKVError(f"{out_dir} holds a run with different {', '.join(diff)} "
                             f"({', '.join(f'{k}={old.get(k)!r}' for k in diff)}); use another --out")
    else:
        path.write_text(json.dumps(config, indent=2) + "\n")


def _name(spec: str) -> str:
    """The policy a spec runs: 'epikv[reserve=16]' -> 'epikv' (its settings come from settings_for(spec))."""
    return spec.partition("[")[0].strip()


def run_retention(model, tokenizer, rows: Sequence[dict], out_dir: str | Path, policies: Sequence[str],
                  budgets: Sequence[int], tau: int = 16, max_reasoning_tokens: int | None = None,
                  system: str | None = None, max_answer_tokens: int | None = None, model_name: str = "", settings_for: Callable[[str], dict] | None = None,
                  log: Callable[[str], None] | None = None, quiet: bool = False, batch_traces: int = 1,
                  budgets_for: Callable[[str], Sequence[int]] | None = None) -> dict:
    """Run every missing (trace, policy, budget) record, appending each to out_dir/results.jsonl.

    `policies` holds names or variants 'name[...]' (other rows of one policy; each spec's settings are
    settings_for(spec)). `full` is run once per trace (budget null); other policies once per budget. Several processes may share
    out_dir: a trace's missing records are claimed before its reference pass, so each record is computed once.
    Each record is logged as "[k/total] ...", k counting records finished (in this run or before); when stderr is
    not a terminal a progress line with the time left also appears every 20 s.

    batch_traces > 1 streams up to that many traces with the same prompt length as one batch (`_stream_batch`): the
    same metrics as one at a time (rows are independent and share the eviction schedule), faster on a CPU; policies
    whose rows share a random generator still run one trace at a time.

    budgets_for(spec), where given, is that spec's own budgets (`--kv-memory`: each policy's largest K whose peak
    fits), in place of `budgets`; the runs still go trace by trace, one reference pass for all of a trace's
    policies. Returns a summary dict."""
    from ..progress import Progress

    if settings_for is None:  # a variant's settings come from the caller's parser (the CLI's `policy_variant`)
        odd = [spec for spec in policies if _name(spec) != spec]
        if odd:
            raise EpiKVError(f"policy variant {odd[0]!r} needs settings_for to give its settings")
        settings_for = lambda spec: {}  # noqa: E731
    if not isinstance(tau, int) or tau < 1:
        raise EpiKVError(f"tau must be a positive integer, got {tau!r}")
    if not isinstance(batch_traces, int) or isinstance(batch_traces, bool) or batch_traces < 1:
        raise EpiKVError(f"batch_traces must be a positive integer, got {batch_traces!r}")
    engine = engine_of(model)
    if engine != "torch" and batch_traces > 1:
        raise EpiKVError(f"--batch-traces {batch_traces}: the {engine} engine streams one trace at a time")
    depth = 1
    if engine == "torch":  # batchable() builds a policy state: the model's depth names its shape
        from ..hooks import decoder_layers
        from ..signals import model_depth

        depth = model_depth(model.config, len(decoder_layers(model)))
    for spec in policies:
        pol = make_policy(_name(spec), tau, settings_for(spec))  # unknown names and bad settings fail first
        if hasattr(model, "check"):  # what the engine cannot run is refused by name before any work
            model.check(pol)
    items, skipped = prepare_traces(rows, tokenizer, max_reasoning_tokens, system, max_answer_tokens)
    if not items:  # before the results folder exists: nothing to leave behind
        why = {}
        for _, w in skipped:
            why[w] = why.get(w, 0) + 1
        raise EpiKVError(f"none of the {len(rows)} traces can be scored (" + ", ".join(
            f"{n} {w}" for w, n in why.items()) + "): each needs id, problem and trace text with an answer after "
            f"{THINK_END}")
    if budgets_for is None:
        budgets_for = lambda spec: budgets  # noqa: E731
    _check_some_run_possible(items, policies, budgets_for, tau, settings_for)
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_config(out_dir, {"model": model_name, "engine": engine, "tau": tau, "max_reasoning_tokens": max_reasoning_tokens,
                            "max_answer_tokens": max_answer_tokens, "system": system,
                            **getattr(model, "epikv_config", {})})
    store = Store(out_dir, "results.jsonl", lambda r: record_key(r) if r.get("kind") == KIND else None)
    results = store.path
    runs = {}  # (name, budget, settings as JSON) -> (name, budget, settings): `full` once, whatever the budgets
    for spec in policies:
        name, s = _name(spec), settings_for(spec)
        for b in budgets_for(spec):
            b = b if get_policy(name).evicts else None
            runs.setdefault((name, b, json.dumps(s, sort_keys=True)), (name, b, s))
    plan = [(item, list(runs.values())) for item in items]
    runs_of = {id(item): rs for item, rs in plan}
    key = lambda item, name, b, s: (item.id, name, b, json.dumps(s, sort_keys=True))  # noqa: E731
    total = len(items) * len(runs)
    done_at_start = {key(item, *r) for item, rs in plan for r in rs if key(item, *r) in store.done}
    already = len(done_at_start)  # counted once here, not again when their trace comes up
    summary = {"written": 0, "already_done": already, "skipped_traces": skipped, "failed": [],
               "claimed_elsewhere": 0}
    progress = Progress("retention", total=total, unit="records", done=already, quiet=quiet, bar=False)
    log = log or progress.note
    for tid, why in skipped:
        log(f"skipped trace {tid}: {why}")
    try:
        with store:
            for group in batches(items, batch_traces):
                todo: dict[int, list] = {}  # id(item) -> its runs claimed by this process
                for item in group:
                    rs = runs_of[id(item)]
                    keys = [key(item, *r) for r in rs]
                    if all(k in store.done for k in keys):
                        continue
                    mine = set(store.claim(keys))  # taken by this process until written (or released on exit)
                    finished_meanwhile = [k for k in keys
                                          if k not in mine and k in store.done and k not in done_at_start]
                    elsewhere = [k for k in keys if k not in mine and k not in store.done]
                    progress.skip(len(finished_meanwhile) + len(elsewhere))
                    summary["already_done"] += len(finished_meanwhile)
                    summary["claimed_elsewhere"] += len(elsewhere)
                    mine_runs = [r for r, k in zip(rs, keys) if k in mine]
                    if mine_runs:
                        todo[id(item)] = mine_runs
                group = [it for it in group if id(it) in todo]
                if not group:
                    continue
                progress.set_status(f"{', '.join(it.id for it in group)}: full reference")
                t_ref = time.perf_counter()
                refs = ([reference_pass(model, group[0], tau)] if len(group) == 1
                        else reference_pass_batch(model, group, tau))
                ref_wall = (time.perf_counter() - t_ref) / len(group)  # a batch's wall time is shared by its rows
                fulls = [reference_metrics(r) for r in refs]
                order = []  # the runs in plan order (settings are dicts: no set)
                for it in group:
                    order += [r for r in todo[id(it)] if r not in order]
                for name, b, s in order:
                    rows = [i for i, it in enumerate(group) if (name, b, s) in todo[id(it)]]
                    label = policy_label({"policy": name, "settings": s})
                    progress.set_status(f"{', '.join(group[i].id for i in rows)}: {label} K={b}")
                    t0 = time.perf_counter()
                    try:
                        if name == "full":
                            ms = [dict(fulls[i]) for i in rows]
                        elif len(rows) > 1 and batchable(make_policy(name, tau, s), depth):
                            ms = policy_pass_batch(model, [group[i] for i in rows], [refs[i] for i in rows], name, b,
                                                   tau, s)
                        else:
                            ms = [policy_pass(model, group[i], refs[i], name, b, tau, s) for i in rows]
                    except EpiKVError as e:  # e.g. a budget below the protected prompt (the same for a batch's rows)
                        for i in rows:
                            progress.update(1)
                            store.release([key(group[i], name, b, s)])
                            log(f"[{progress.n}/{total}] {group[i].id} {label} K={b}: not run: {e}")
                            summary["failed"].append((group[i].id, name, b, str(e)))
                        continue
                    # `full` is the shared reference pass: its wall time is that pass's
                    wall = ref_wall if name == "full" else (time.perf_counter() - t0) / len(rows)
                    for i, m in zip(rows, ms):
                        item = group[i]
                        base = {"kind": KIND, "trace_id": item.id, "policy": name, "budget": b,
                                "tau": s.get("tau", tau),
                                "model": model_name, "engine": engine, "max_reasoning_tokens": max_reasoning_tokens,
                                "max_answer_tokens": max_answer_tokens, "settings": s,
                                "prompt_tokens": len(item.prompt_ids), "reasoning_tokens": len(item.reasoning_ids),
                                "answer_tokens": len(item.answer_ids), **item.meta}
                        full_nll = fulls[i]["answer_nll"]
                        rec = {**base, **m, "full_answer_nll": full_nll,
                               "answer_nll_increase": m["answer_nll"] - full_nll,
                               "tail_nll_increase": _diff(m.get("tail_nll"), fulls[i].get("tail_nll")), "wall_s": wall,
                               "tokens_per_s": (len(item.ids) - len(item.prompt_ids)) / max(m["seconds"], 1e-9)}
                        store.append([rec])
                        summary["written"] += 1
                        progress.update(1)
                        log(f"[{progress.n}/{total}] {item.id} {label} K={b}: answer NLL "
                            f"{rec['answer_nll_increase']:+.4f}, top-1 {100 * rec['top1_agreement']:.1f}%, "
                            f"KL {rec['kl']:.4f} ({m['seconds']:.1f} s)")
                del refs
    finally:
        progress.close()
    summary["results"] = str(results)
    evicting = [r for r in runs.values() if r[0] != "full"]
    failed = [f for f in summary["failed"] if f[1] != "full"]
    if evicting and len(failed) == len(items) * len(evicting):  # `full` alone compares nothing: not a result
        raise EpiKVError("no evicting run was possible: " + _runs_text(failed)
                         + ("; the full-cache records written are kept for a rerun" if summary["written"] else ""))
    if summary["failed"] and not (summary["written"] or summary["already_done"] or summary["claimed_elsewhere"]):
        if created:
            _remove_if_empty(out_dir)
        tid, name, b, e = summary["failed"][0]
        raise EpiKVError(f"nothing could be scored: all {len(summary['failed'])} runs were not possible (first: "
                         f"{tid} {name} K={b}: {e})")
    return summary


def _runs_text(failed: list[tuple]) -> str:
    """The impossible runs, each once with its first reason: 'epikv K=8 (budget 8 is smaller ...)'."""
    first: dict[tuple, str] = {}
    for _, name, b, why in failed:
        first.setdefault((name, b), why)
    return "; ".join(f"{name} K={b} ({why})" for (name, b), why in first.items())


def _check_some_run_possible(items, policies, budgets_for, tau, settings_for) -> None:
    """Before any work: refuse a run in which no evicting (policy, budget) can hold some trace's protected prompt and
    recent window (what every such run would fail on), naming them; `full` alone would be a report of nothing."""
    failed, n_evicting = [], 0
    for spec in policies:
        pol = make_policy(_name(spec), tau, settings_for(spec))
        if not pol.evicts:
            continue
        for b in budgets_for(spec):
            n_evicting += 1
            whys = [pol.protected_overflow(b, pol.recent_window(b), len(it.prompt_ids)) for it in items]
            if all(whys):
                failed.append((None, policy_label({"policy": pol.name, "settings": settings_for(spec)}), b, whys[0]))
    if n_evicting and len(failed) == n_evicting:
        raise EpiKVError("no evicting run is possible: " + _runs_text(failed))


def _remove_if_empty(folder: Path) -> None:
    """Remove a results folder this run created if it holds nothing but its own bookkeeping (config, lock, empty
    results and claims); anything else (another process's records) stays."""
    import shutil

    mine = {"config.json", LOCK, CLAIMS, "results.jsonl"}
    entries = list(folder.iterdir())
    if any(p.name not in mine for p in entries):
        return
    if (folder / "results.jsonl").exists() and (folder / "results.jsonl").stat().st_size:
        return
    if (folder / CLAIMS).is_dir() and any((folder / CLAIMS).iterdir()):
        return
    shutil.rmtree(folder, ignore_errors=True)
