"""Render retention results: a Markdown table with bootstrap CIs and one plot per metric against budget.

`render_retention(records, out_dir)` takes records with "kind": "retention" (others are ignored) and returns the
paths it wrote. `full` (no eviction, budget null) is drawn as a horizontal line."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .bootstrap import aggregate

PLOTS = {
    "answer_nll_increase": "answer NLL increase over full (nats/token)",
    "top1_agreement": "top-1 agreement with full, reasoning span",
    "kl": "KL(full || policy), reasoning span (nats/token)",
    "seconds": "forward seconds per trace",
}


def _fmt(ci, pct: bool = False, digits: int = 4, sci: bool = False) -> str:
    mean, lo, hi = ci
    if math.isnan(mean):
        return "-"
    f = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.2e}") if sci else (lambda v: f"{v:.{digits}f}")
    return f(mean) if math.isnan(lo) else f"{f(mean)} [{f(lo)}, {f(hi)}]"


def table(rows: list[dict]) -> str:
    lines = ["| policy | budget | traces | answer NLL increase | top-1 agreement % | KL (reasoning) | answer NLL | "
             "s / trace | peak cache tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['budget'] if r['budget'] is not None else 'all'} | {r['n']} | "
                     f"{_fmt(r['answer_nll_increase'])} | {_fmt(r['top1_agreement'], pct=True)} | {_fmt(r['kl'], sci=True)} | "
                     f"{_fmt(r['answer_nll'], digits=3)} | {r['seconds'][0]:.1f} | {r['peak_cache_tokens'][0]:.0f} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], metric: str, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import budget_axes

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pr = [r for r in rows if r["policy"] == policy]
        if policy == "full" or all(r["budget"] is None for r in pr):
            mean, lo, hi = pr[0][metric]
            ax.axhline(mean, color="black", ls="--", lw=1, label=f"{policy} (no eviction)")
            continue
        pr = sorted((r for r in pr if r["budget"] is not None), key=lambda r: r["budget"])
        xs = [r["budget"] for r in pr]
        ys = [r[metric][0] for r in pr]
        lo = [r[metric][0] - r[metric][1] if not math.isnan(r[metric][1]) else 0 for r in pr]
        hi = [r[metric][2] - r[metric][0] if not math.isnan(r[metric][2]) else 0 for r in pr]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=4, capsize=3, label=policy)
    budget_axes(ax, budgets, label, f"{label}\n(mean over traces, 95% bootstrap CI)", legend_size=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_retention(records, out_dir) -> list[Path]:
    """Write retention.md, retention_summary.json and retention_<metric>.png into out_dir; returns their paths."""
    records = [r for r in records if r.get("kind") == "retention"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = aggregate(records)
    if not rows:
        return []
    settings = sorted({(r.get("model"), r.get("tau"), r.get("max_reasoning_tokens"), r.get("max_answer_tokens"))
                       for r in records}, key=str)
    head = "; ".join(f"model {m}, tau {t}, reasoning cap {c or 'none'}, answer cap {a or 'none'}"
                     for m, t, c, a in settings)
    md = out / "retention.md"
    md.write_text(f"# Retention\n\n{head}. Mean over traces with 95% percentile-bootstrap CIs over traces "
                  "(2000 resamples). Answer NLL increase: answer NLL (teacher-forced text after `</think>`) minus "
                  "the full cache's; top-1 agreement and KL(full || policy) over the reasoning span.\n\n"
                  + table(rows))
    summary = out / "retention_summary.json"
    summary.write_text(json.dumps(rows, indent=1) + "\n")
    written = [md, summary]
    for metric, label in PLOTS.items():
        path = out / f"retention_{metric}.png"
        _plot(rows, metric, label, path)
        written.append(path)
    return written
