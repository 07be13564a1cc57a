"""Issue 26 item 1: paired difference, new reading (rolling windows over decode tokens only) minus old reading
(windows over prompt and decode tokens), per trace, for the whole-trace retention rows at K = 1024.

Old rows: epikv, epikv-raw from ../retention-full/tau16 and epikv-seg from ../retention-full/tau128 (committed
before the change, same engine otherwise), kv-key and kv-val from the `[window_over=all]` rows of this folder's own
run. New rows: this folder's default rows. Also checks that the `full` reference of both runs is the same.

    .venv/bin/python benchmarks/window_over_pairs.py > benchmarks/results/window-over/pairs.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from epikv.retention.bootstrap import LOWER_IS_BETTER, bootstrap_ci  # noqa: E402

R = Path(__file__).resolve().parent / "results"
NEW, OLD = R / "window-over", R / "retention-full"
K = 1024
METRICS = ("answer_nll_increase", "answer_kl", "tail_nll_increase", "kl", "top1_agreement")


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows(records, policy: str, settings: dict, budget=K) -> dict[str, dict]:
    """trace_id -> record for one policy, settings and budget (the last record wins, as in the report)."""
    return {r["trace_id"]: r for r in records
            if r.get("kind") == "retention" and r["policy"] == policy and (r.get("settings") or {}) == settings
            and r["budget"] == budget}


def main() -> None:
    new16, new128 = load(NEW / "tau16/results.jsonl"), load(NEW / "tau128/results.jsonl")
    old16, old128 = load(OLD / "tau16/results.jsonl"), load(OLD / "tau128/results.jsonl")
    old_all = {"window_over": "all"}
    pairs = [  # (label, new rows, old rows)
        ("epikv (tau 16)", rows(new16, "epikv", {}), rows(old16, "epikv", {})),
        ("epikv-raw (tau 16)", rows(new16, "epikv-raw", {}), rows(old16, "epikv-raw", {})),
        ("kv-key (tau 16)", rows(new16, "kv-key", {}), rows(new16, "kv-key", old_all)),
        ("kv-val (tau 16)", rows(new16, "kv-val", {}), rows(new16, "kv-val", old_all)),
        ("epikv-seg (tau 128)", rows(new128, "epikv-seg", {}), rows(old128, "epikv-seg", {})),
    ]
    print(f"# New minus old window reading, K = {K}, paired per trace\n")
    print("Mean [95 % percentile-bootstrap CI over traces]; `better` counts traces where the new reading is better, "
          "`same` where the two records agree to 1e-9.\n")
    for (name, ref_new, ref_old) in (("tau 16", rows(new16, "full", {}, None), rows(old16, "full", {}, None)),
                                     ("tau 128", rows(new128, "full", {}, None), rows(old128, "full", {}, None))):
        common = sorted(set(ref_new) & set(ref_old))
        worst = max(abs(ref_new[t]["answer_nll"] - ref_old[t]["answer_nll"]) for t in common)
        print(f"- `full` reference, {name}: {len(common)} common traces, largest |answer NLL difference| "
              f"{worst:.2e} nats/token")
    print()
    print("| policy | traces | " + " | ".join(METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for label, new, old in pairs:
        common = sorted(set(new) & set(old))
        cells = []
        for m in METRICS:
            d = np.array([new[t][m] - old[t][m] for t in common], dtype=float)
            mean, lo, hi = bootstrap_ci(d)
            better = int(((d < 0) if LOWER_IS_BETTER[m] else (d > 0)).sum())
            same = int((np.abs(d) < 1e-9).sum())
            bold = "**" if (lo > 0 or hi < 0) else ""
            cells.append(f"{bold}{mean:+.4f}{bold} [{lo:+.4f}, {hi:+.4f}], better {better}, same {same}")
        print(f"| {label} | {len(common)} | " + " | ".join(cells) + " |")
    print("\nBold: the interval excludes 0. Lower is better for every metric except top1_agreement.")


if __name__ == "__main__":
    main()
