"""Issue 56 item 4: eviction at equal peak KV bytes, against KV quantization alone and llama.cpp's context shift.

Reads the three folders `benchmarks/results/equal-bytes/run.sh` writes (f16/, q8_0/, q4_0/: `epikv retention
--engine llama.cpp --kv-memory ...`, one cell type a folder) and prints / writes:
- one row per method (policy x cell type) and byte budget: the measured peak KV bytes (cells and the policy's
  buffers, `kv_peak_bytes`), its K, the answer-NLL increase against the whole F16 cache (f16/'s `full`), with a
  95 % interval from a bootstrap that resamples problems (the traces are problems x writers x outcomes), and the
  paired difference against `context-shift` and against `random` on the same cell type (interval, traces won);
- the whole cache at q8_0 and at q4_0 (quantization alone): its answer-NLL increase and its peak bytes (the whole
  trace's cells), and on how many traces it fits each byte budget;
- the goal rows: at each budget the best epikv row against the best context-shift row and the best random row
  (chosen on the same traces: a selection the interval does not correct for; said in the text);
- a figure: peak KV bytes (x) against answer-NLL increase (y), one line per method across the budgets.

    python benchmarks/equal_bytes.py                      # the tables on stdout (markdown)
    python benchmarks/equal_bytes.py --write              # also summary.json, table.md and docs/img/equal-bytes.png

Only traces with a record in every row of a comparison are paired; the text states how many traces each row has.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from epikv.retention.bootstrap import problem_bootstrap

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "benchmarks" / "results" / "equal-bytes"
FIGURE = ROOT / "docs" / "img" / "equal-bytes.png"
TYPES = ("f16", "q8_0", "q4_0")
EPIKV = ("epikv-seg-q", "epikv-learned-mean")  # the epikv rows the goal compares
BASELINES = ("context-shift", "random", "streaming")
N_BOOT = 4000


def cluster_ci(diffs: dict[str, float], n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): epikv.retention.bootstrap.problem_bootstrap's interval (problems resampled; nan under
    MIN_PROBLEMS problems)."""
    return problem_bootstrap(diffs, n_boot, seed)[:3]


def parse_size(text: str) -> int:
    m = re.fullmatch(r"([0-9.]+)(KiB|MiB|GiB)", text.strip())
    if not m:
        raise ValueError(f"expected sizes like 12MiB, got {text!r}")
    return int(float(m.group(1)) * {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}[m.group(2)])


def label(r: dict) -> str:
    return r["policy"]  # one variant a policy in this run (context-shift[n_keep=-1], epikv-seg-q[tau=128])


def load(root: Path) -> dict[str, list[dict]]:
    out = {}
    for t in TYPES:
        f = root / t / "results.jsonl"
        if f.exists():
            recs = {}
            for line in f.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    recs[(r["trace_id"], label(r), r["budget"])] = r  # the last record of a key wins
            out[t] = list(recs.values())
    return out


def collect(folders: dict[str, list[dict]], memories: list[int]) -> dict:
    """{"ref": {trace: f16 full answer NLL}, "whole": {type: {trace: (increase, bytes)}},
    "rows": {(policy, type, memory): {trace: (increase, peak bytes, K)}}}. A policy's budgets map to the memories
    in order (--kv-memory gives each memory its own K, larger for the larger)."""
    ref = {r["trace_id"]: r["answer_nll"] for r in folders.get("f16", []) if r["policy"] == "full"}
    whole, rows = {}, {}
    for t, recs in folders.items():
        whole[t] = {r["trace_id"]: (r["answer_nll"] - ref[r["trace_id"]], r["peak_kv_mib"] * 2 ** 20)
                    for r in recs if r["policy"] == "full" and r["trace_id"] in ref}
        ks: dict[str, set] = defaultdict(set)
        for r in recs:
            if r["policy"] != "full":
                ks[label(r)].add(r["budget"])
        for pol, kset in ks.items():
            if len(kset) > len(memories):
                raise SystemExit(f"equal_bytes: {t}/{pol} has {len(kset)} budgets for {len(memories)} memories")
            # a run still going may lack the larger budget's K yet: the smaller runs first (run.sh's order)
            for k, mem in zip(sorted(kset), sorted(memories)):
                rows[(pol, t, mem)] = {r["trace_id"]: (r["answer_nll"] - ref[r["trace_id"]], r["kv_peak_bytes"], k)
                                       for r in recs if label(r) == pol and r["budget"] == k
                                       and r["trace_id"] in ref}
    return {"ref": ref, "whole": whole, "rows": rows}


def paired(a: dict, b: dict) -> dict:
    common = sorted(set(a) & set(b))
    diffs = {t: a[t][0] - b[t][0] for t in common}
    mean, lo, hi = cluster_ci(diffs)
    return {"n": len(common), "mean": mean, "low": lo, "high": hi, "wins": sum(d < 0 for d in diffs.values())}


def summarise(data: dict, memories: list[int]) -> dict:
    rows = data["rows"]
    out = {"memories": sorted(memories), "traces_with_reference": len(data["ref"]), "rows": [], "whole": [],
           "goals": []}
    for t, per in data["whole"].items():
        if not per:
            continue
        inc = {k: v[0] for k, v in per.items()}
        mean, lo, hi = cluster_ci(inc)
        sizes = [v[1] for v in per.values()]
        out["whole"].append({"type": t, "n": len(per), "increase": [mean, lo, hi], "bytes_median": float(np.median(sizes)),
                             "bytes_min": min(sizes), "bytes_max": max(sizes),
                             "fits": {str(m): sum(s <= m for s in sizes) for m in sorted(memories)}})
    for (pol, t, mem), per in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][0], TYPES.index(kv[0][1]))):
        inc = {k: v[0] for k, v in per.items()}
        row = {"policy": pol, "type": t, "memory": mem, "n": len(per), "K": next(iter(per.values()))[2] if per else None,
               "increase": list(cluster_ci(inc)),
               "peak_bytes_max": max((v[1] for v in per.values() if v[1] is not None), default=None),
               "peak_bytes_mean": float(np.mean([v[1] for v in per.values() if v[1] is not None])) if per else None}
        for base in ("context-shift", "random"):
            if pol != base and (base, t, mem) in rows:
                row["minus_" + base.replace("-", "_")] = paired(per, rows[(base, t, mem)])
        out["rows"].append(row)
    for mem in sorted(memories):
        def best(policies):
            cands = [(r["increase"][0], r["policy"], r["type"]) for r in out["rows"]
                     if r["memory"] == mem and r["policy"] in policies and r["n"]]
            return min(cands) if cands else None
        b_e = best(EPIKV)
        for base in ("context-shift", "random"):
            b_b = best((base,))
            if b_e and b_b:
                out["goals"].append({"memory": mem, "epikv": f"{b_e[1]} @ {b_e[2]}", "baseline": f"{b_b[1]} @ {b_b[2]}",
                                     **paired(rows[(b_e[1], b_e[2], mem)], rows[(b_b[1], b_b[2], mem)])})
    return out


def _ci(x) -> str:
    mean, lo, hi = x
    return f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]" if np.isfinite(lo) else f"{mean:+.3f}"


def _pair(p: dict | None) -> str:
    if not p:
        return ""
    s = _ci((p["mean"], p["low"], p["high"])) + f", {p['wins']}/{p['n']}"
    return f"**{s}**" if np.isfinite(p["low"]) and (p["low"] > 0 or p["high"] < 0) else s


def _mib(b) -> str:
    return "" if b is None else f"{b / 2 ** 20:.2f}"


def tables(s: dict) -> str:
    lines = ["Answer-NLL increase (nats/token) against the whole F16 cache, mean over traces [95 % interval, problems "
             "resampled]; paired differences: negative = the row loses less; `w/n` = traces where the row loses less; "
             "bold where the interval excludes 0.", ""]
    lines += ["| whole cache | traces | peak KV MiB (median, range) | fits " + " / ".join(
        f"{m / 2 ** 20:g} MiB" for m in s["memories"]) + " | answer-NLL increase |", "|---|---|---|---|---|"]
    for w in s["whole"]:
        fits = " / ".join(f"{w['fits'][str(m)]}/{w['n']}" for m in s["memories"])
        lines.append(f"| {w['type']} | {w['n']} | {_mib(w['bytes_median'])} ({_mib(w['bytes_min'])}-"
                     f"{_mib(w['bytes_max'])}) | {fits} | {_ci(w['increase'])} |")
    for mem in s["memories"]:
        lines += ["", f"**Byte budget {mem / 2 ** 20:g} MiB** (a sequence's peak: cells and the policy's buffers)", "",
                  "| policy | cells | K | traces | peak KV MiB (max measured) | answer-NLL increase | minus context-shift "
                  "(same cells) | minus random (same cells) |", "|---|---|---|---|---|---|---|---|"]
        for r in s["rows"]:
            if r["memory"] == mem:
                lines.append(f"| {r['policy']} | {r['type']} | {r['K']} | {r['n']} | {_mib(r['peak_bytes_max'])} | "
                             f"{_ci(r['increase'])} | {_pair(r.get('minus_context_shift'))} | "
                             f"{_pair(r.get('minus_random'))} |")
    if s["goals"]:
        lines += ["", "Goal rows (issue 56): at each budget the best epikv row (epikv-seg-q, epikv-learned-mean on any "
                  "cells) minus the best row of a baseline (on any cells), both picked by their mean on these traces:",
                  "", "| budget | epikv row | baseline row | difference [95 %], wins |", "|---|---|---|---|"]
        for g in s["goals"]:
            lines.append(f"| {g['memory'] / 2 ** 20:g} MiB | {g['epikv']} | {g['baseline']} | {_pair(g)} |")
    return "\n".join(lines) + "\n"


def figure(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"random": "tab:gray", "streaming": "tab:blue", "context-shift": "tab:red", "epikv-seg-q": "tab:green",
              "epikv-learned-mean": "tab:purple"}
    styles = {"f16": "-", "q8_0": "--", "q4_0": ":"}
    marks = {"f16": "o", "q8_0": "s", "q4_0": "^"}
    fig, ax = plt.subplots(figsize=(8, 5))
    lines = defaultdict(list)
    for r in s["rows"]:
        if r["n"] and r["peak_bytes_mean"] is not None:
            lines[(r["policy"], r["type"])].append((r["peak_bytes_mean"] / 2 ** 20, r["increase"][0]))
    for (pol, t), pts in sorted(lines.items()):
        pts.sort()
        ax.plot(*zip(*pts), styles[t], marker=marks[t], color=colors.get(pol, "black"), label=f"{pol} ({t})")
    for w in s["whole"]:
        ax.scatter([w["bytes_median"] / 2 ** 20], [w["increase"][0]], marker="*", s=160, color="black", zorder=5)
        ax.annotate(f"whole cache {w['type']}", (w["bytes_median"] / 2 ** 20, w["increase"][0]),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    for m in s["memories"]:
        ax.axvline(m / 2 ** 20, color="0.8", lw=0.8, zorder=0)
    ax.set_xscale("log")
    ax.set_xlabel("peak KV bytes of a sequence, MiB (cells + policy buffers; mean over traces; log scale)")
    ax.set_ylabel("answer-NLL increase vs whole F16 cache (nats/token)")
    n = max((r["n"] for r in s["rows"]), default=0)
    ax.set_title(f"Equal memory through llama.cpp, SmolLM2-135M, {n} whole R1 traces")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(DEFAULT))
    ap.add_argument("--memories", default="12MiB,24MiB", help="the --kv-memory sizes of the run, in order")
    ap.add_argument("--write", action="store_true",
                    help="write summary.json and table.md to --root, the figure to docs/img/equal-bytes.png")
    args = ap.parse_args(argv)
    try:
        memories = [parse_size(x) for x in args.memories.split(",")]
    except ValueError as e:
        print(f"equal_bytes: {e}", file=sys.stderr)
        return 2
    root = Path(args.root)
    folders = load(root)
    if "f16" not in folders:
        print(f"equal_bytes: {root}/f16/results.jsonl is missing (the whole F16 cache is the reference)",
              file=sys.stderr)
        return 2
    s = summarise(collect(folders, memories), memories)
    text = tables(s)
    print(text)
    if args.write:
        FIGURE.parent.mkdir(parents=True, exist_ok=True)
        (root / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
        (root / "table.md").write_text(text)
        figure(s, FIGURE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
