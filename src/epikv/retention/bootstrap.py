"""Aggregate retention records per (policy, budget) with bootstrap confidence intervals over traces.

Traces, not tokens, are the independent units: each record contributes one value per metric (its per-token mean)."""

from __future__ import annotations

import warnings
from collections import defaultdict

import numpy as np

METRICS = ("answer_nll_increase", "top1_agreement", "kl", "answer_nll", "seconds", "peak_cache_tokens")


def bootstrap_ci(values, confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap of the mean; (mean, nan, nan) for fewer than two values."""
    from scipy.stats import bootstrap

    x = np.asarray([v for v in values if v is not None], dtype=float)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(x.mean())
    if x.size < 2:
        return mean, float("nan"), float("nan")
    if np.all(x == x[0]):  # e.g. `full`: no spread, the interval is the point
        return mean, mean, mean
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                        random_state=np.random.default_rng(seed))
    return mean, float(res.confidence_interval.low), float(res.confidence_interval.high)


def aggregate(records, metrics=METRICS, confidence: float = 0.95, n_resamples: int = 2000) -> list[dict]:
    """One row per (policy, budget): n traces and {metric: (mean, low, high)}; `full` has budget None."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") == "retention":
            groups[(r["policy"], r["budget"])].append(r)
    rows = []
    for (policy, budget), recs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "full", kv[0][0], kv[0][1] or 0)):
        row = {"policy": policy, "budget": budget, "n": len({r["trace_id"] for r in recs})}
        for m in metrics:
            row[m] = bootstrap_ci([r.get(m) for r in recs], confidence, n_resamples)
        rows.append(row)
    return rows
