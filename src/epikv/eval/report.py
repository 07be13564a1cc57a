"""Tables and plots from evaluation records: accuracy per (dataset, model, policy, budget) with 95% confidence
intervals, tokens, speed, memory and failure-mode rates; several output directories merge into one report."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

from ..errors import EpiKVError
from ..plots import budget_axes, policy_style
from .records import cell_key, read_config, read_records

COLUMNS = ["dataset", "model", "protocol", "policy", "budget", "problems", "generations", "accuracy", "ci_low",
           "ci_high", "strict_accuracy", "lenient_accuracy", "mean_new_tokens", "seconds_per_1k_tokens",
           "peak_memory_mib", "peak_memory_kind", "kv_cache_peak_mib", "cap_hit_rate", "empty_rate", "no_answer_rate",
           "repetition_rate", "mean_evictions"]


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n (well-behaved at 0% and 100%)."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def accuracy_ci(per_problem: list[list[bool]]) -> tuple[float, float, float]:
    """pass@1 = mean over problems of each problem's mean correctness; Wilson interval with one sample per problem,
    otherwise a normal interval over the per-problem rates."""
    rates = [sum(v) / len(v) for v in per_problem]
    n = len(rates)
    acc = sum(rates) / n
    if all(len(v) == 1 for v in per_problem):
        lo, hi = wilson(sum(rates), n)
    else:
        sd = math.sqrt(sum((r - acc) ** 2 for r in rates) / max(n - 1, 1))
        lo, hi = max(0.0, acc - 1.96 * sd / math.sqrt(n)), min(1.0, acc + 1.96 * sd / math.sqrt(n))
    return acc, lo, hi


def summarize(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["dataset"], r["model"], r["protocol"], r["policy"], r["budget"])].append(r)
    rows = []
    for (ds, model, proto, pol, k), recs in groups.items():
        by_problem: dict[str, list[bool]] = defaultdict(list)
        for r in recs:
            by_problem[r["id"]].append(bool(r["correct"]))
        acc, lo, hi = accuracy_ci(list(by_problem.values()))
        n = len(recs)
        new = sum(r["new_tokens"] for r in recs)
        # Each record carries its batch's wall time; count every batch once via its share of tokens.
        secs = sum(r["seconds_per_1k_tokens"] * r["new_tokens"] / 1000 for r in recs)
        rows.append({
            "dataset": ds, "model": model, "protocol": proto, "policy": pol, "budget": k,
            "problems": len(by_problem), "generations": n, "accuracy": acc, "ci_low": lo, "ci_high": hi,
            "strict_accuracy": sum(bool(r["correct_strict"]) for r in recs) / n,
            "lenient_accuracy": sum(bool(r.get("correct_lenient", r["correct"])) for r in recs) / n,
            "mean_new_tokens": new / n, "seconds_per_1k_tokens": 1000 * secs / max(new, 1),
            # each record's batch's own peak (older records: the process's high-water mark, see the kind)
            "peak_memory_mib": _max_mib(r.get("peak_memory_bytes") for r in recs),
            "peak_memory_kind": "+".join(sorted({str(r.get("peak_memory_kind")) for r in recs})),
            "kv_cache_peak_mib": _max_mib(r.get("kv_cache_peak_bytes") for r in recs),
            "cap_hit_rate": sum(bool(r["hit_cap"]) for r in recs) / n,
            "empty_rate": sum(bool(r["empty"]) for r in recs) / n,
            "no_answer_rate": sum(bool(r["no_answer"]) for r in recs) / n,
            "repetition_rate": sum(bool(r["repetition"]) for r in recs) / n,
            "mean_evictions": sum(r["evictions"] for r in recs) / n,
        })
    rows.sort(key=lambda r: (r["dataset"], r["model"], r["protocol"], r["policy"] != "full", r["policy"],
                             r["budget"] or 0))
    return rows


def _max_mib(values) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) / 2**20 if vals else None


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.2f}"


def _fmt(row: dict) -> list[str]:
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    return [row["dataset"], row["model"], row["policy"], "-" if row["budget"] is None else str(row["budget"]),
            str(row["generations"]), f"{pct(row['accuracy'])} [{pct(row['ci_low'])}, {pct(row['ci_high'])}]",
            pct(row["strict_accuracy"]), pct(row["lenient_accuracy"]), f"{row['mean_new_tokens']:.0f}",
            f"{row['seconds_per_1k_tokens']:.1f}",
            _mib(row["peak_memory_mib"]), _mib(row.get("kv_cache_peak_mib")), pct(row["cap_hit_rate"]),
            pct(row["empty_rate"]),
            pct(row["no_answer_rate"]), pct(row["repetition_rate"])]


_HEAD = ["dataset", "model", "policy", "K", "n", "accuracy % [95% CI]", "strict %", "lenient %", "new tokens",
         "s / 1k tok", "peak MiB", "KV peak MiB", "cap hit %", "empty %", "no answer %", "repetition %"]


def table_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    lines += ["| " + " | ".join(_fmt(r)) + " |" for r in rows]
    return "\n".join(lines)


def table_text(rows: list[dict]) -> str:
    if not rows:
        return "(no records)"
    cells = [_HEAD] + [_fmt(r) for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(_HEAD))]
    return "\n".join("  ".join(c[i].ljust(w[i]) for i in range(len(w))) for c in cells)


def merge(dirs: list[str | Path]) -> tuple[list[dict], list[dict]]:
    """Records of several directories (each cell once: the first directory wins) and their configs."""
    seen, records, configs = set(), [], []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise EpiKVError(f"{d} is not a directory")
        cfg = read_config(d)
        configs.append(dict(cfg, directory=str(d)))
        for r in read_records(d):
            key = (r["dataset"], r["model"], r["protocol"], *cell_key(r))
            if key not in seen:
                seen.add(key)
                records.append(r)
    if not records:
        raise EpiKVError(f"no records in {', '.join(map(str, dirs))}")
    return records, configs


def plot(rows: list[dict], out: Path) -> list[Path]:
    """accuracy_vs_budget.png and speed_vs_budget.png: one panel per (dataset, model), one line per policy, the
    no-eviction (`full`) result as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dataset"], r["model"], r["protocol"]) for r in rows})
    written = []
    for metric, ylabel, fname in [("accuracy", "accuracy (%)", "accuracy_vs_budget.png"),
                                  ("seconds_per_1k_tokens", "seconds per 1k generated tokens",
                                   "speed_vs_budget.png")]:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (ds, model, proto) in zip(axes[0], panels):
            sub = [r for r in rows if (r["dataset"], r["model"], r["protocol"]) == (ds, model, proto)]
            scale = 100 if metric == "accuracy" else 1
            for r in sub:
                if r["budget"] is None:
                    ax.axhline(scale * r[metric], color="black", linestyle="--", label=f"{r['policy']} (no eviction)")
            for pol in sorted({r["policy"] for r in sub if r["budget"] is not None}):
                pts = sorted((r["budget"], r) for r in sub if r["policy"] == pol and r["budget"] is not None)
                xs = [k for k, _ in pts]
                ys = [scale * r[metric] for _, r in pts]
                if metric == "accuracy":
                    err = [[scale * (r["accuracy"] - r["ci_low"]) for _, r in pts],
                           [scale * (r["ci_high"] - r["accuracy"]) for _, r in pts]]
                    ax.errorbar(xs, ys, yerr=err, capsize=3, label=pol, **policy_style(pol))
                else:
                    ax.plot(xs, ys, label=pol, **policy_style(pol))
            budget_axes(ax, [r["budget"] for r in sub if r["budget"] is not None], ylabel, f"{ds} / {model} ({proto})")
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def tau_text(tau: int | None, rows: list[dict]) -> str:
    """The eviction interval a run used: the one given, or each policy's own default (`--tau` unset)."""
    if tau is not None:
        return f"tau {tau}"
    from ..policies import REGISTRY

    by_tau = defaultdict(list)
    for name in dict.fromkeys(r["policy"] for r in rows):
        if name in REGISTRY and REGISTRY[name].evicts:
            by_tau[REGISTRY[name]().tau].append(name)
    if len(by_tau) <= 1:
        return f"tau {next(iter(by_tau), 1)} (the default)"
    return "tau: each policy's default (" + "; ".join(f"{t}: {', '.join(n)}" for t, n in sorted(by_tau.items())) + ")"


def write_report(dirs: list[str | Path], out: str | Path | None = None) -> dict[str, Path]:
    """report.md, report.csv and the two PNGs into `out` (default: the first directory)."""
    records, configs = merge(dirs)
    rows = summarize(records)
    out = Path(out or dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "report.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else (round(r[k], 6) if isinstance(r[k], float) else r[k]))
                        for k in COLUMNS})
    pngs = plot(rows, out)
    md = ["# Evaluation report", "",
          "Accuracy is pass@1 graded with math-verify (integer compare for AIME/GSM8K) with a 95% confidence "
          "interval (Wilson for one sample per problem); `strict` is the paper's string matcher; `lenient` (not a "
          "protocol grader) also accepts the last number of an output without a box, for integer answers. Speed is wall "
          "seconds per 1k generated tokens (batched runs share a batch's time by tokens). Peak MiB: the largest of "
          "each batch's own peak (GPU: CUDA max allocated, reset per batch; CPU: the process's resident memory "
          "sampled during the batch, model weights included; kind `process_max_rss` in records of older versions "
          "is the process's high-water mark, which later rows inherit). KV peak MiB: the KV cache at its largest "
          "(peak stored tokens x bytes per token x batch rows), exact and device-independent. `full` (K = -) is "
          "the no-eviction run.", "",
          table_markdown(rows), "", "Sources:", ""]
    for c in configs:
        md.append(f"- `{c['directory']}`: {c['dataset']} ({c['protocol']}, max {c['max_new_tokens']} new tokens, "
                  f"temperature {c['temperature']}), model `{c['model']}`, {tau_text(c['tau'], rows)}")
    md += ["", *[f"![{p.stem}]({p.name})" for p in pngs], ""]
    md_path = out / "report.md"
    md_path.write_text("\n".join(md))
    return {"markdown": md_path, "csv": csv_path, **{p.stem: p for p in pngs}}
