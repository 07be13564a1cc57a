"""benchmarks/equal_bytes.py (issue 56 item 4): rows against the whole F16 cache, budgets mapped to the byte sizes,
the bootstrap that resamples problems, paired wins."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import bench_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def eb():
    return bench_module("equal_bytes")


def _rec(tid, policy, budget, nll, peak=None, kv_mib=10.0):
    return {"trace_id": tid, "policy": policy, "budget": budget, "answer_nll": nll, "kv_peak_bytes": peak,
            "peak_kv_mib": kv_mib, "answer_nll_increase": 0.0}


def _write(root: Path, folder: str, recs) -> None:
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_rows_are_against_the_whole_f16_cache_and_budgets_map_to_sizes(eb, tmp_path):
    """A q8_0 row's increase is its answer NLL minus f16/'s full (not its own folder's full, which is quantization's
    own loss); a policy's smaller K is the smaller size. Mutants: the folder's own full as reference (the record's
    answer_nll_increase), the K order reversed."""
    ids = ["a/problem_1/correct", "a/problem_2/correct"]
    _write(tmp_path, "f16", [_rec(t, "full", None, 1.0, kv_mib=100) for t in ids]
           + [_rec(t, "random", k, 1.0 + d, peak=k * 10) for t in ids for k, d in ((500, 0.3), (1000, 0.1))])
    _write(tmp_path, "q8_0", [_rec(t, "full", None, 1.05, kv_mib=53) for t in ids]
           + [_rec(t, "random", k, 1.0 + d, peak=k * 5) for t in ids for k, d in ((1000, 0.2), (2000, 0.02))])
    mem = [12 * 2 ** 20, 24 * 2 ** 20]
    s = eb.summarise(eb.collect(eb.load(tmp_path), mem), mem)
    rows = {(r["policy"], r["type"], r["memory"]): r for r in s["rows"]}
    assert rows[("random", "q8_0", mem[0])]["increase"][0] == pytest.approx(0.2)
    assert rows[("random", "q8_0", mem[1])]["K"] == 2000 and rows[("random", "f16", mem[0])]["K"] == 500
    whole = {w["type"]: w for w in s["whole"]}
    assert whole["q8_0"]["increase"][0] == pytest.approx(0.05) and whole["f16"]["increase"][0] == 0
    assert whole["q8_0"]["fits"][str(mem[0])] == 0 and whole["q8_0"]["bytes_median"] == 53 * 2 ** 20


def test_the_bootstrap_resamples_problems_not_traces(eb):
    """Three traces of problem 1, one of each of problems 2-5: the interval's ends are those of the exact bootstrap
    distribution over problems; under five problems there is no interval. Mutants: resampling traces (its low end
    is about -0.09, not -0.20), MIN_PROBLEMS ignored."""
    import itertools

    vals = {1: 0.3, 2: -0.1, 3: 0.05, 4: 0.21, 5: -0.37}
    diffs = {f"x/problem_1/{c}": 0.3 for c in "abc"} | {f"x/problem_{p}/a": v for p, v in vals.items() if p > 1}
    groups = [[0.3] * 3] + [[vals[p]] for p in range(2, 6)]
    # the exact bootstrap distribution over problems: every one of the 5^5 equally likely draws (its 2.5 % point
    # is -0.200; resampling the 7 traces instead gives about -0.093)
    exact = np.percentile([sum(sum(groups[i]) for i in pick) / sum(len(groups[i]) for i in pick)
                           for pick in itertools.product(range(5), repeat=5)], [2.5, 97.5])
    mean, lo, hi = eb.cluster_ci(diffs, n_boot=4000)
    assert mean == pytest.approx(sum(diffs.values()) / len(diffs))
    assert lo == pytest.approx(exact[0], abs=0.03) and hi == pytest.approx(exact[1], abs=0.03)
    few = {k: v for k, v in diffs.items() if "problem_5" not in k}
    assert np.isnan(eb.cluster_ci(few)[1])


def test_paired_counts_wins_on_common_traces(eb):
    """paired(a, b): a - b on the traces both have; a win is a trace where a loses less. Mutant: wins counted where
    a loses more."""
    a = {f"p/problem_{i}/x": (v, 0, 0) for i, v in enumerate((0.1, 0.5, 0.2, 0.3, 0.3, 0.9))}
    b = {f"p/problem_{i}/x": (v, 0, 0) for i, v in enumerate((0.2, 0.4, 0.1, 0.4, 0.3))}
    p = eb.paired(a, b)
    assert p["n"] == 5 and p["wins"] == 2 and p["mean"] == pytest.approx(0.0, abs=1e-12)
    assert np.isfinite(p["low"])


def test_missing_reference_folder_is_one_line_exit_2(eb, tmp_path, capsys):
    assert eb.main(["--root", str(tmp_path)]) == 2
    assert "f16/results.jsonl is missing" in capsys.readouterr().err
    assert eb.main(["--root", str(tmp_path), "--memories", "lots"]) == 2
