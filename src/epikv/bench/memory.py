"""The memory wall: peak memory of one forward pass over n tokens, attention weights read (eager) against the
attention-free path (SDPA + hidden states at two blocks), and peak memory of long generations.

CPU: every point runs in a child process (`python -m epikv.bench.memory --child SPEC`) whose peak RSS is the
measure. The child limits its own address space to the cap (an allocation past it fails cleanly: "oom") and the
parent kills it if its resident memory passes the cap anyway ("over-cap"), so no point can take the machine down.
CUDA: every point runs in this process, measured with torch.cuda peak statistics; an OutOfMemoryError is "oom".
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..engine import Decoder, attention_for
from ..errors import EpiKVError
from ..policies import Observes, Policy, get_policy
from .speed import long_generation, random_ids

GIB = 2**30
MODES = ("eager+attn", "sdpa+hidden")


@dataclass
class AttentionWeights(Policy):
    """What attention scoring must see: the softmax weights of every layer (as output_attentions=True returns
    them), under eager attention. It keeps everything: only the cost of reading the weights is measured."""

    name = "attention-weights"
    attention_free = False
    evicts = False

    def observes(self, n_layers: int) -> Observes:
        return Observes(attention_layers=tuple(range(n_layers)))


def forward_pass(model, mode: str, n: int, seed: int = 0) -> None:
    """One prefill of n random tokens through the Decoder, with what `mode` needs captured."""
    if mode not in MODES:
        raise EpiKVError(f"unknown memory mode {mode!r}; known: {', '.join(MODES)}")
    pol = AttentionWeights() if mode == "eager+attn" else get_policy("epikv")  # epikv: hidden states at 2 blocks
    ids = random_ids(model, n, seed)
    with torch.inference_mode(), attention_for(model, pol):
        dec = Decoder(model, pol, budget=(n + 256) if pol.evicts else None)  # room for all n: no eviction
        dec.prefill(ids, [0])
        synchronize_all()


def synchronize_all() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# -- CPU: process memory -----------------------------------------------------------------------------------------------
def _status_kib(pid: int | str, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _limit_memory(cap: int) -> None:
    """Let this process grow by at most the cap minus what it already holds: larger allocations fail."""
    room = cap - _status_kib("self", "VmRSS") * 1024
    if room <= 0:
        raise MemoryError("the model alone exceeds the cap")
    limit = _status_kib("self", "VmSize") * 1024 + room
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _emit(rec: dict) -> None:
    print("EPIKV-BENCH " + json.dumps(rec), flush=True)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "alloc" in str(e).lower() or "out of memory" in str(e).lower()


def _child(spec: dict) -> int:
    """The child process: load the model, cap memory, run one memory point or one long generation."""
    from ..models import load_model

    _exit_with_parent()
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    lm = load_model(spec["model"], dtype=spec.get("dtype"), device="cpu", attn_implementation=spec.get("attn"))
    base = peak_rss_bytes()
    base_now = _status_kib("self", "VmRSS") * 1024
    try:
        if spec.get("cap"):
            _limit_memory(int(spec["cap"]))
        if spec["task"] == "point":
            t0 = time.perf_counter()
            forward_pass(lm.model, spec["mode"], spec["n"], spec.get("seed", 0))
            _emit({"status": "ok", "peak_gib": peak_rss_bytes() / GIB, "delta_gib": (peak_rss_bytes() - base_now) / GIB,
                   "model_gib": base / GIB, "seconds": time.perf_counter() - t0})
        else:
            long_generation(lm.model, spec["policy"], spec["budget"], spec["lengths"], tau=spec.get("tau"),
                            prompt_tokens=spec.get("prompt_tokens", 64), seed=spec.get("seed", 0),
                            settings=spec.get("settings"),
                            memory=lambda: {"peak_gib": peak_rss_bytes() / GIB,
                                            "delta_gib": (peak_rss_bytes() - base_now) / GIB},
                            on_point=lambda p: _emit({"status": "ok", **p}))
    except EpiKVError as e:
        _emit({"status": "error", "error": str(e)})
    except (MemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        _emit({"status": "oom", "error": str(e).strip().splitlines()[0][:200] if str(e).strip() else "MemoryError"})
    return 0


def _exit_with_parent() -> None:
    """A killed benchmark must not leave its child running: exit as soon as the parent is gone."""
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def run_in_child(spec: dict, cap: int | None, timeout: float | None = None) -> list[dict]:
    """Run `spec` in a child process; returns its records, or one record saying why it has none
    (over-cap: killed by the parent; oom: killed by the kernel; error: anything else)."""
    cmd = [sys.executable, "-m", "epikv.bench.memory", "--child", json.dumps(dict(spec, cap=cap))]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        why, peak_seen, t0 = None, 0, time.monotonic()
        while proc.poll() is None:
            rss = _status_kib(proc.pid, "VmRSS") * 1024
            peak_seen = max(peak_seen, rss)
            if cap and rss > cap:
                why = "over-cap"
            elif timeout and time.monotonic() - t0 > timeout:
                why = "timeout"
            if why:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.02)
        out.seek(0), err.seek(0)
        recs = [json.loads(line[len("EPIKV-BENCH "):]) for line in out if line.startswith("EPIKV-BENCH ")]
        if why:
            return recs + [{"status": why, "peak_gib": peak_seen / GIB}]
        if proc.returncode in (-9, 137):
            return recs + [{"status": "oom", "error": "killed by the system (out of memory)"}]
        if proc.returncode != 0:
            tail = [l.strip() for l in err.read().splitlines() if l.strip()]
            return recs + [{"status": "error", "error": (tail[-1] if tail else f"exit {proc.returncode}")[:300]}]
        return recs or [{"status": "error", "error": "the child reported nothing"}]


# -- CUDA: allocator statistics ----------------------------------------------------------------------------------------
def cuda_point(model, mode: str, n: int, cap: int | None, seed: int = 0) -> dict:
    dev = model.get_input_embeddings().weight.device
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    try:
        forward_pass(model, mode, n, seed)
    except torch.OutOfMemoryError as e:
        rec = {"status": "oom", "error": str(e).strip().splitlines()[0][:200]}
    else:
        peak = torch.cuda.max_memory_allocated(dev)
        rec = {"status": "ok", "peak_gib": peak / GIB, "delta_gib": (peak - base) / GIB, "model_gib": base / GIB,
               "seconds": time.perf_counter() - t0}
        if cap and peak > cap:
            rec["status"] = "over-cap"
    gc.collect()
    torch.cuda.empty_cache()
    return rec


# -- the ladder ----------------------------------------------------------------------------------------------------------
class Journal:
    """Append-only JSONL of finished records keyed by their settings: a rerun skips what is already there."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self.done: dict[str, dict] = {}
        if self.path:
            from ..store import read_records  # the shared JSONL rules (epikv.store); never modifies the file

            for rec in read_records(self.path, strict=False):  # strict=False: older journals' glued torn lines
                if isinstance(rec, dict) and "key" in rec:
                    self.done[rec["key"]] = rec

    def add(self, rec: dict) -> None:
        self.done[rec["key"]] = rec
        if self.path:
            from ..store import append_record

            append_record(self.path, rec)  # torn tail repaired first; flushed and fsynced


def run_memory(model_name: str, lengths: list[int], cap_gib: float | None, device: str = "cpu",
               dtype: str | None = None, attn: str | None = None, modes: tuple[str, ...] = MODES, seed: int = 0,
               journal: str | Path | None = None, threads: int | None = None,
               on_point: Callable[[dict], None] | None = None) -> dict:
    """Peak memory (or oom / over-cap) of one forward pass per mode and length; bigger lengths are skipped once a
    mode fails. Returns points and, per mode, the longest feasible length."""
    if cap_gib is not None and cap_gib <= 0:
        raise EpiKVError(f"--cap-gib must be positive, got {cap_gib}")
    cap = int(cap_gib * GIB) if cap_gib else None
    cuda = device.startswith("cuda")
    if not cuda and cap is None:
        raise EpiKVError("a CPU memory run needs --cap-gib (it protects the machine)")
    jr = Journal(journal)
    model = None
    if cuda:
        from ..models import load_model

        model = load_model(model_name, dtype=dtype, device=device, attn_implementation=attn).model
    points = []
    for mode in modes:
        failed_at = None
        for n in sorted(set(lengths)):
            key = json.dumps([model_name, device, dtype, mode, n, cap_gib])
            if key in jr.done:
                rec = jr.done[key]
            elif failed_at is not None:
                rec = {"status": "skipped", "error": f"infeasible already at n={failed_at}"}
            elif cuda:
                rec = cuda_point(model, mode, n, cap, seed)
            else:
                spec = {"task": "point", "model": model_name, "dtype": dtype, "attn": attn, "mode": mode, "n": n,
                        "seed": seed, "threads": threads}
                rec = run_in_child(spec, cap)[-1]
            rec = {"key": key, "mode": mode, "n": n, **{k: v for k, v in rec.items() if k not in ("key", "mode", "n")}}
            if rec["status"] != "skipped" and key not in jr.done:
                jr.add(rec)
            if rec["status"] != "ok" and failed_at is None:
                failed_at = n
            points.append(rec)
            if on_point:
                on_point(rec)
    return {"model": model_name, "device": device, "dtype": dtype or ("bfloat16" if cuda else "float32"),
            "cap_gib": cap_gib, "lengths": sorted(set(lengths)), "points": points, "summary": summarize(points)}


def summarize(points: list[dict]) -> dict:
    """Longest feasible n per mode, and the attention-free / attention-weights ratio of feasible contexts."""
    best: dict[str, Any] = {}
    tried: dict[str, int] = {}
    for p in points:
        tried[p["mode"]] = max(tried.get(p["mode"], 0), p["n"])
        if p["status"] == "ok":
            best[p["mode"]] = max(best.get(p["mode"], 0), p["n"])
    out: dict[str, Any] = {"max_feasible": {m: best.get(m) for m in tried}}
    a, e = best.get("sdpa+hidden"), best.get("eager+attn")
    if a and e:
        out["feasible_context_ratio"] = a / e
        # every tried length fit: the true ratio is at least this
        out["ratio_is_lower_bound"] = a == tried.get("sdpa+hidden")
    return out


# -- long generations (the decode side of the memory wall) ----------------------------------------------------------
def run_long(model_name: str, policies: list[str], budget: int, lengths: list[int], tau: int | None = None,
             device: str = "cpu", dtype: str | None = None, cap_gib: float | None = None, seed: int = 0,
             prompt_tokens: int = 64,
             model=None, settings: Callable[[str], dict] = lambda n: {}, threads: int | None = None,
             on_point: Callable[[dict], None] | None = None) -> list[dict]:
    """Per policy, tokens/s and peak memory at each checkpoint of one long greedy generation. CPU: one child
    process per policy (its own peak RSS); CUDA: in this process with the allocator's peak statistics."""
    cap = int(cap_gib * GIB) if cap_gib else None
    out = []
    for name in policies:
        if device.startswith("cuda"):
            dev = model.get_input_embeddings().weight.device
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            mem = lambda: {"peak_gib": torch.cuda.max_memory_allocated(dev) / GIB,  # noqa: E731
                           "delta_gib": (torch.cuda.max_memory_allocated(dev) - base) / GIB}
            try:
                recs = long_generation(model, name, budget, lengths, tau=tau, prompt_tokens=prompt_tokens,
                                       seed=seed, memory=mem,
                                       settings=settings(name), on_point=on_point)
            except torch.OutOfMemoryError:
                recs = [{"policy": name, "status": "oom"}]
        else:
            spec = {"task": "long", "model": model_name, "dtype": dtype, "policy": name, "budget": budget,
                    "lengths": lengths, "tau": tau, "seed": seed, "prompt_tokens": prompt_tokens,
                    "settings": settings(name), "threads": threads}
            recs = [dict(r, policy=r.get("policy", name)) for r in run_in_child(spec, cap)]
            if on_point:
                for r in recs:
                    on_point(r)
        out.extend(recs)
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--child":
        return _child(json.loads(argv[1]))
    print("usage: python -m epikv.bench.memory --child SPEC (internal; use `epikv bench memory`)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
