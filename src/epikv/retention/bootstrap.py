"""Aggregate retention records per (policy, budget) with bootstrap confidence intervals over traces.

Traces, not tokens, are the independent units: each record contributes one value per metric (its per-token mean)."""

from __future__ import annotations

import warnings
from collections import defaultdict

import numpy as np

METRICS = ("answer_nll_increase", "top1_agreement", "kl", "answer_nll", "tail_nll_increase", "answer_kl", "seconds",
           "peak_cache_tokens", "kv_peak_bytes")  # kv_peak_bytes: llama.cpp records (cells + policy buffers)
# the direction in which a metric is better, for paired comparisons
LOWER_IS_BETTER = {"answer_nll_increase": True, "top1_agreement": False, "kl": True, "answer_nll": True,
                   "tail_nll_increase": True, "answer_kl": True}


def policy_label(rec: dict, name_tau: bool = False) -> str:
    """The policy name, plus its non-default settings if any (`epikv[layers=[6, 20]]`) and, with name_tau, its
    interval (`epikv@tau=128`): runs of one policy with other settings or schedules are other rows, never pooled."""
    s = rec.get("settings") or {}
    at = f"@tau={rec.get('tau')}" if name_tau else ""
    return rec["policy"] + ("[" + ", ".join(f"{k}={v}" for k, v in sorted(s.items())) + "]" if s else "") + at


def engine(rec: dict) -> str:
    """The engine a record came from (records before the llama.cpp engine carry none: torch)."""
    return rec.get("engine") or "torch"


def unique(records) -> list[dict]:
    """Retention records, one per (trace, label, budget), each with its row label in "label": the last one wins, so
    merging folders that share a trace counts it once. A policy found at several intervals (folders run at tau 16
    and 128) names the interval in its label, except at the run's main interval (its plain name) and for `full`,
    whose rows at any interval are the same no-eviction reference. The main interval is the one most evicting
    policies were run at (ties: more records, then the smaller), so the plain `epikv` that the other rows are paired
    with runs at their schedule however far each folder has got; a policy never run at it keeps its plain name at
    its own most common interval."""
    recs = [r for r in records if r.get("kind") == "retention"]
    engines = sorted({engine(r) for r in recs})
    if len(engines) > 1:  # a row of one engine paired with another's would compare engines, not policies
        from ..errors import EpiKVError

        raise EpiKVError(f"the retention records come from engines {' and '.join(engines)}: report each engine's "
                         "folders on their own")
    taus: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    for r in recs:
        taus[policy_label(r)][r.get("tau")] += 1
    most = lambda ts: max(ts, key=lambda t: (ts[t], -(t or 0)))  # noqa: E731  most records; ties: smaller tau
    by_tau: dict = defaultdict(lambda: [0, 0])  # tau -> [policies, records]
    for p, ts in taus.items():
        if p != "full":
            for t, n in ts.items():
                by_tau[t][0] += 1
                by_tau[t][1] += n
    main = max(by_tau, key=lambda t: (*by_tau[t], -(t or 0))) if by_tau else None
    plain = {p: main if main in ts else most(ts) for p, ts in taus.items()}
    out: dict[tuple, dict] = {}
    for r in recs:
        base = policy_label(r)
        name_tau = r["policy"] != "full" and r.get("tau") != plain[base]
        label = policy_label(r, name_tau)
        out[(r["trace_id"], label, r["budget"])] = {**r, "label": label}
    return list(out.values())


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
    for r in unique(records):
        groups[(r["label"], r["budget"])].append(r)
    rows = []
    for (policy, budget), recs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "full", kv[0][0], kv[0][1] or 0)):
        row = {"policy": policy, "budget": budget, "n": len({r["trace_id"] for r in recs})}
        for m in metrics:
            row[m] = bootstrap_ci([r.get(m) for r in recs], confidence, n_resamples)
        rows.append(row)
    return rows


MIN_PROBLEMS = 5  # a problem bootstrap needs at least this many problems among the paired traces


def problem_of(trace_id: str) -> str:
    """The problem a trace answers (`.../problem_1591/correct` -> problem_1591): the unit a problem bootstrap
    resamples (the shared traces are several traces of each problem, so traces of one problem are not independent)."""
    import re

    m = re.search(r"problem_[^/]+", trace_id)
    return m.group(0) if m else trace_id


def problem_bootstrap(diffs: dict[str, float], n_boot: int = 4000, seed: int = 0) -> tuple[float, float, float, float]:
    """(mean, low, high, p) of the mean over traces of paired differences {trace_id: difference}: the 95 % percentile
    interval from resampling problems with replacement (all of a drawn problem's traces come with it), and the
    two-sided bootstrap p-value, twice the smaller share of resampled means on either side of 0 (capped at 1). Under
    MIN_PROBLEMS problems there is no interval and no p (nan): a bootstrap over so few says nothing."""
    nan = float("nan")
    if not diffs:
        return nan, nan, nan, nan
    by_problem: dict[str, list[float]] = defaultdict(list)
    for tid, d in diffs.items():
        by_problem[problem_of(tid)].append(d)
    groups = list(by_problem.values())
    mean = float(np.mean([d for g in groups for d in g]))
    if len(groups) < MIN_PROBLEMS:
        return mean, nan, nan, nan
    rng = np.random.default_rng(seed)
    sums = np.array([sum(g) for g in groups])
    counts = np.array([len(g) for g in groups])
    idx = rng.integers(0, len(groups), size=(n_boot, len(groups)))  # [resamples, problems]
    means = sums[idx].sum(1) / counts[idx].sum(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    p = min(1.0, 2 * min(float((means <= 0).mean()), float((means >= 0).mean())))
    return mean, float(lo), float(hi), p


def per_trace(records, metric: str) -> dict[tuple, dict[str, float]]:
    """{(policy, budget): {trace_id: value}} for the retention records that carry `metric`."""
    out: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in unique(records):
        if r.get(metric) is not None:
            out[(r["label"], r["budget"])][r["trace_id"]] = float(r[metric])
    return out


def signed_rank_p(diff) -> float:
    """Two-sided Wilcoxon signed-rank p-value of paired differences against 0 (exact for the run's trace counts).
    Zero differences carry no sign and are dropped, as in Wilcoxon's test; with none left, 1."""
    from scipy.stats import wilcoxon

    d = np.asarray([v for v in diff if v is not None], dtype=float)
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns that a handful of differences gives little power
        return float(wilcoxon(d).pvalue)


def holm(pvalues) -> list[float]:
    """Holm's step-down adjustment: the i-th smallest of m p-values times (m - i), i from 0, made monotone and capped
    at 1. Rejecting where the adjusted value is below alpha controls the chance of any false claim among the m."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    out = [1.0] * len(pvalues)
    run = 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        out[i] = run
    return out


def paired(records, reference: str, metric: str = "answer_nll_increase", confidence: float = 0.95,
           n_resamples: int = 2000) -> list[dict]:
    """Each policy minus `reference` at the same budget, on the traces both have (a paired comparison).

    Traces differ far more from each other than policies do on one trace, so only paired differences say whether
    one policy beats another. One row per (budget, policy): n common traces, the mean difference with its
    bootstrap CI over traces, `better`: on how many of those traces the policy beat the reference, and `p`: the
    two-sided Wilcoxon signed-rank p-value of the differences (uncorrected; see `holm`)."""
    values = per_trace(records, metric)
    lower = LOWER_IS_BETTER.get(metric, True)
    rows = []
    for (policy, budget), vals in sorted(values.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0])):
        ref = values.get((reference, budget))
        if policy == reference or budget is None or not ref:
            continue
        common = sorted(set(vals) & set(ref))
        if not common:
            continue
        diff = np.array([vals[t] - ref[t] for t in common])
        better = int((diff < 0).sum() if lower else (diff > 0).sum())
        rows.append({"policy": policy, "budget": budget, "reference": reference, "metric": metric,
                     "n": len(common), "better": better, "diff": bootstrap_ci(diff, confidence, n_resamples),
                     "p": signed_rank_p(diff)})
    return rows
