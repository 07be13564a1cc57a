"""Render retention results: a Markdown table with bootstrap CIs and one plot per metric against budget.

`render_retention(records, out_dir)` takes records with "kind": "retention" (others are ignored) and returns the
paths it wrote. `full` (no eviction, budget null) is drawn as a horizontal line. Besides the full table, the
Markdown has one policy x budget grid per headline metric and paired differences against a reference policy
(EPIKV by default) on common traces, which is what a claim "A beats B" needs."""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

from .bootstrap import LOWER_IS_BETTER, aggregate, engine, holm, paired

PLOTS = {
    "answer_nll_increase": "answer NLL increase over full (nats/token)",
    "top1_agreement": "top-1 agreement with full, reasoning span",
    "kl": "KL(full || policy), reasoning span (nats/token)",
    "seconds": "forward seconds per trace",
    "tail_nll_increase": "NLL increase over full, last 256 reasoning tokens (nats/token)",
    "answer_kl": "KL(full || policy), answer tokens (nats/token)",
}
# a paired table's dagger: the family-wise error rate over its cells (Holm)
HOLM_ALPHA = 0.05
# the paired-difference figure: one row of panels per metric, one column per budget
PAIRED_PLOT = ("answer_nll_increase", "tail_nll_increase", "answer_kl")


def _fmt(ci, pct: bool = False, digits: int = 4, sci: bool = False) -> str:
    mean, lo, hi = ci
    if math.isnan(mean):
        return "-"
    f = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.2e}") if sci else (lambda v: f"{v:.{digits}f}")
    return f(mean) if math.isnan(lo) else f"{f(mean)} [{f(lo)}, {f(hi)}]"


def table(rows: list[dict]) -> str:
    lines = ["| policy | budget | traces | answer NLL increase | top-1 agreement % | KL (reasoning) | answer NLL | "
             "s / trace | peak cache tokens |", "|---|---|---|---|---|---|---|---|---|"]
    # the peak KV bytes beside K where records carry them (llama.cpp: the cells at their type and the policy's
    # buffers); a table of torch records alone has no such column
    bytes_col = any(not math.isnan((r.get("kv_peak_bytes") or (math.nan,))[0]) for r in rows)
    if bytes_col:
        lines = [lines[0] + " peak KV MiB |", lines[1] + "---|"]
    for r in rows:
        peak = (r.get("kv_peak_bytes") or (math.nan,))[0]
        lines.append(f"| {r['policy']} | {r['budget'] if r['budget'] is not None else 'all'} | {r['n']} | "
                     f"{_fmt(r['answer_nll_increase'])} | {_fmt(r['top1_agreement'], pct=True)} | {_fmt(r['kl'], sci=True)} | "
                     f"{_fmt(r['answer_nll'], digits=3)} | {r['seconds'][0]:.1f} | {r['peak_cache_tokens'][0]:.0f} |"
                     + (f" {'-' if math.isnan(peak) else f'{peak / 2 ** 20:.2f}'} |" if bytes_col else ""))
    return "\n".join(lines) + "\n"


GRIDS = {"answer_nll_increase": ("Answer-NLL increase over full (nats/token)", {}),
         "top1_agreement": ("Top-1 agreement with full over the reasoning span (%)", {"pct": True}),
         "tail_nll_increase": ("NLL increase over full on the last 256 reasoning tokens before </think> "
                               "(nats/token)", {}),
         "answer_kl": ("KL(full || policy) on the answer tokens (nats/token)", {})}


def _budgets(rows: list[dict]) -> list[int]:
    return sorted({r["budget"] for r in rows if r["budget"] is not None})


def grid(rows: list[dict], metric: str, pct: bool = False) -> str:
    """Policies x budgets, best first (by the metric's mean over budgets); each cell mean [CI] (traces)."""
    budgets = _budgets(rows)
    by = {(r["policy"], r["budget"]): r for r in rows if r["budget"] is not None}
    policies = list(dict.fromkeys(p for p, _ in by))
    sign = 1 if LOWER_IS_BETTER.get(metric, True) else -1

    def key(p):
        means = [by[(p, b)][metric][0] for b in budgets if (p, b) in by]
        return sign * sum(means) / len(means)

    lines = ["| policy | " + " | ".join(f"K = {b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for p in sorted(policies, key=key):
        cells = [f"{_fmt(by[(p, b)][metric], pct=pct)} ({by[(p, b)]['n']})" if (p, b) in by else "-" for b in budgets]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_table(records, reference: str, metric: str, pct: bool = False) -> str:
    """Policy minus reference per budget, on common traces: mean [CI], and traces where the policy is better; bold
    where the interval excludes 0, a dagger where the signed-rank test survives Holm's correction over the table."""
    rows = paired(records, reference, metric)
    if not rows:
        return ""
    for r, adjusted in zip(rows, holm([r["p"] for r in rows])):
        r["holm"] = adjusted
    budgets = sorted({r["budget"] for r in rows})
    by = {(r["policy"], r["budget"]): r for r in rows}
    lines = ["| policy | " + " | ".join(f"K = {b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for p in sorted({r["policy"] for r in rows}):
        cells = []
        for b in budgets:
            r = by.get((p, b))
            if r is None:
                cells.append("-")
                continue
            mean, lo, hi = r["diff"]
            f = (lambda v: f"{100 * v:+.1f}") if pct else (lambda v: f"{v:+.4f}")
            ci = "" if math.isnan(lo) else f" [{f(lo)}, {f(hi)}]"
            sure = "" if math.isnan(lo) or lo <= 0 <= hi else "**"  # the interval excludes 0
            dagger = " †" if r["holm"] < HOLM_ALPHA else ""
            cells.append(f"{sure}{f(mean)}{ci}{sure}, better on {r['better']}/{r['n']}{dagger}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], metric: str, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import budget_axes, dodge, policy_style

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    budgets = _budgets(rows)
    lines = [p for p in dict.fromkeys(r["policy"] for r in rows)
             if not (p == "full" or all(r["budget"] is None for r in rows if r["policy"] == p))]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        if policy not in lines:
            mean = next(r for r in rows if r["policy"] == policy)[metric][0]
            ax.axhline(mean, color="black", ls=":", lw=1.2, label=f"{policy} (no eviction)")
    for i, policy in enumerate(lines):
        pr = sorted((r for r in rows if r["policy"] == policy and r["budget"] is not None), key=lambda r: r["budget"])
        xs = dodge([r["budget"] for r in pr], i, len(lines))
        ys = [r[metric][0] for r in pr]
        lo = [r[metric][0] - r[metric][1] if not math.isnan(r[metric][1]) else 0 for r in pr]
        hi = [r[metric][2] - r[metric][0] if not math.isnan(r[metric][2]) else 0 for r in pr]
        ax.errorbar(xs, ys, yerr=[lo, hi], ms=4, capsize=2, lw=1.2, elinewidth=0.8, label=policy,
                    **policy_style(policy))
    budget_axes(ax, budgets, label, f"{label}\n(mean over traces, 95% bootstrap CI; solid: hidden-state policies)",
                legend_size=7)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_paired(records, reference: str, path: Path) -> bool:
    """Write `_paired_figure` to path; False (nothing written) without pairs."""
    fig = _paired_figure(records, reference)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _paired_figure(records, reference: str):
    """Each policy minus `reference` per budget (columns) and metric (rows), on common traces: mean and 95 % bootstrap
    CI over traces; filled markers where the interval excludes 0. None without pairs. Each row names its metric in a
    horizontal title above its panels (a vertical axis title would overprint its neighbours when few policies make
    the rows short)."""
    tables = {m: paired(records, reference, m) for m in PAIRED_PLOT}
    tables = {m: t for m, t in tables.items() if t}
    if not tables:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import policy_style

    budgets = sorted({r["budget"] for t in tables.values() for r in t})
    policies = sorted({r["policy"] for t in tables.values() for r in t})
    fig, axes = plt.subplots(len(tables), len(budgets), squeeze=False, sharey=True,
                             figsize=(2.2 + 2.6 * len(budgets), 0.9 + (0.22 * len(policies) + 0.9) * len(tables)))
    for i, (metric, rows) in enumerate(tables.items()):
        by = {(r["policy"], r["budget"]): r for r in rows}
        for j, b in enumerate(budgets):
            ax = axes[i][j]
            ax.axvline(0, color="black", lw=0.8)
            for y, p in enumerate(policies):
                r = by.get((p, b))
                if r is None:
                    continue
                mean, lo, hi = r["diff"]
                sure = not (math.isnan(lo) or lo <= 0 <= hi)
                st = policy_style(p)
                err = None if math.isnan(lo) else [[mean - lo], [hi - mean]]
                ax.errorbar([mean], [y], xerr=err, color=st["color"], marker=st["marker"], ms=5, capsize=2,
                            mfc=st["color"] if sure else "white", lw=0, elinewidth=1.0)
            ax.set_yticks(range(len(policies)), policies, fontsize=7)
            if j == 0:
                ax.invert_yaxis()  # shared y: once flips every column
            ax.grid(alpha=0.3, axis="x")
            ax.tick_params(axis="x", labelsize=7)
            ax.set_title(textwrap.fill(f"{PLOTS[metric].split(' (')[0]}, K = {b}", 34), fontsize=8)
    fig.suptitle(f"policy minus {reference} on common traces: mean, 95% bootstrap CI over traces\n"
                 "filled: the interval excludes 0; left of 0: better", fontsize=8)
    fig.tight_layout()
    return fig


def _lower_first(title: str) -> str:
    """'Top-1 agreement' -> 'top-1 agreement' inside a sentence; an acronym ('NLL', 'KL(full') stays as it is."""
    word = title.split(" ", 1)[0]
    return title if len(word) > 1 and word[1].isupper() else title[:1].lower() + title[1:]


def _sections(records, rows: list[dict], references: tuple[str, ...]) -> str:
    parts = []
    for metric, (title, kw) in GRIDS.items():
        if any(not math.isnan(r[metric][0]) for r in rows):  # metrics older records lack are left out
            parts.append(f"## {title}\n\nBest first.\n\n" + grid(rows, metric, **kw))
    for reference in references:
        for metric, (title, kw) in GRIDS.items():
            t = paired_table(records, reference, metric, **kw)
            if t:
                better = "lower" if LOWER_IS_BETTER[metric] else "higher"
                parts.append(f"## Paired against {reference}: {_lower_first(title)}\n\nPolicy minus "
                             f"{reference} on the traces both have, mean [95% bootstrap CI over traces]; {better} is "
                             f"better; \"better on\": traces where the policy beat {reference}. **Bold**: the interval "
                             "excludes 0, a difference these traces support (one interval per cell, no correction "
                             "for the number of cells). †: the two-sided Wilcoxon signed-rank test on the same "
                             "differences stays below 0.05 after Holm's correction over every cell of this table, "
                             "a difference that survives the number of comparisons.\n\n" + t)
    parts.append("## All metrics\n\n" + table(rows))
    return "\n".join(parts)


def render_retention(records, out_dir, reference: str | tuple[str, ...] = ("epikv", "random")) -> list[Path]:
    """Write retention.md, retention_summary.json and retention_<metric>.png into out_dir; returns their paths.

    `reference`: the policy or policies the paired-difference tables compare every other policy with (each skipped
    if absent)."""
    references = (reference,) if isinstance(reference, str) else tuple(reference)
    records = [r for r in records if r.get("kind") == "retention"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = aggregate(records)
    if not rows:
        return []
    settings = sorted({(r.get("model"), engine(r), r.get("tau"), r.get("max_reasoning_tokens"),
                        r.get("max_answer_tokens")) for r in records}, key=str)  # one line per interval
    head = "; ".join(f"model {m}, engine {e}, tau {t}, reasoning cap {c or 'none'}, answer cap {a or 'none'}"
                     for m, e, t, c, a in settings)
    md = out / "retention.md"
    md.write_text(f"# Retention\n\n{head}. Mean over traces with 95% percentile-bootstrap CIs over traces "
                  "(2000 resamples). Answer NLL increase: answer NLL (teacher-forced text after `</think>`) minus "
                  "the full cache's; top-1 agreement and KL(full || policy) over the reasoning span. "
                  "(n) = traces.\n\n" + _sections(records, rows, references), encoding="utf-8")  # the dagger
    summary = out / "retention_summary.json"
    summary.write_text(json.dumps(rows, indent=1) + "\n")
    written = [md, summary]
    for metric, label in PLOTS.items():
        path = out / f"retention_{metric}.png"
        _plot(rows, metric, label, path)
        written.append(path)
    for reference in references:
        path = out / f"retention_paired_{re.sub(r'[^A-Za-z0-9._-]+', '_', reference)}.png"  # epikv@tau=128: epikv_tau_128
        if _plot_paired(records, reference, path):
            written.append(path)
    return written
