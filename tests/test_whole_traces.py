"""benchmarks/whole_traces.py (issue 57): rows at each policy's shipped tau, the ranking that picks the default on
common traces, the problem bootstrap's p and Holm over the table."""

import json

import numpy as np
import pytest
from conftest import bench_module

from epikv.retention.bootstrap import holm, problem_bootstrap


@pytest.fixture(scope="module")
def wt():
    return bench_module("whole_traces")


def _rec(tid, policy, budget, inc, tau=16, settings=None):
    return {"kind": "retention", "trace_id": tid, "policy": policy, "budget": budget, "tau": tau,
            "settings": settings or {}, "answer_nll_increase": inc}


def test_rows_are_read_at_each_policys_shipped_tau(wt, tmp_path, monkeypatch):
    """epikv-seg-q counts at tau 128 only, the others at 16; a row with another setting is left out. Mutant: the
    tau check removed (Seg-Q's tau-16 row overwrites its shipped one)."""
    recs = [_rec("a/problem_1/x", "epikv-seg-q", 1024, 0.1, tau=128, settings={"tau": 128}),
            _rec("a/problem_1/x", "epikv-seg-q", 1024, 0.9, tau=16),
            _rec("a/problem_1/x", "random", 1024, 0.2),
            _rec("a/problem_1/x", "random", 1024, 0.7, settings={"seed": 3})]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setitem(wt.SOURCES, "llama.cpp", ["x.jsonl"])
    cells = wt.load("llama.cpp", tmp_path)
    assert cells[("epikv-seg-q", 1024)] == {"a/problem_1/x": 0.1}
    assert cells[("random", 1024)] == {"a/problem_1/x": 0.2}


def test_the_ranking_compares_candidates_on_common_traces_least_loss_first(wt):
    """Only per-token policies, each its mean at K = 1,024 (the default's budget) on the traces all have: `streaming`
    leads on the common trace although its mean over all of its own traces is the worst; `epikv-learned-decay` beats
    `random` at K = 1,024 though not over both budgets; at K = 512 alone the order is another. Per-head h2o is no
    candidate. Mutants: the sort reversed; each policy's mean over its own traces; both budgets together."""
    cells = {("streaming", 1024): {"t1": 0.05, "t2": 0.9}, ("random", 1024): {"t1": 0.2},
             ("epikv-learned-decay", 1024): {"t1": 0.1}, ("h2o", 1024): {"t1": 0.0}, ("h2o", 512): {"t1": 0.0},
             ("streaming", 512): {"t1": 0.25, "t2": 0.9}, ("random", 512): {"t1": 0.2},
             ("epikv-learned-decay", 512): {"t1": 0.32}, ("full", None): {"t1": 0.0}}
    rank = wt.ranking(cells)
    assert [r["policy"] for r in rank] == ["streaming", "epikv-learned-decay", "random"]
    assert rank[0]["mean"] == pytest.approx(0.05) and rank[0]["n"] == 1
    assert wt.winner("llama.cpp", rank) == "streaming"
    assert [r["policy"] for r in wt.ranking(cells, (512,))] == ["random", "streaming", "epikv-learned-decay"]
    s = wt.summarise({"llama.cpp": cells})
    assert [r["policy"] for r in s["ranking"]] == ["streaming", "epikv-learned-decay", "random"]
    assert [r["policy"] for r in s["ranking_by_budget"][512]] == ["random", "streaming", "epikv-learned-decay"]


def test_the_winner_is_the_first_the_entry_point_runs(wt):
    """An entry point that refuses the best-ranked policy gets the next one it runs (h2o-global reads attention
    weights: llama.cpp refuses it, torch runs it). Mutant: the refusal check dropped."""
    rank = [{"policy": "h2o-global", "mean": 0.0, "n": 1}, {"policy": "streaming", "mean": 0.1, "n": 1}]
    assert wt.winner("llama.cpp", rank) == "streaming"
    assert wt.winner("torch", rank) == "h2o-global"


def test_the_bootstrap_p_is_two_sided_and_holm_covers_the_table(wt):
    """Seven problems all at +0.2 give p = 0 (every resampled mean above 0); a sign flip of one changes nothing
    about the side; differences centred on 0 give p near 1. Mutants: one-sided p (the all-negative case gets 1),
    Holm over one row only."""
    pos = {f"x/problem_{i}/a": 0.2 + 0.01 * i for i in range(7)}
    neg = {k: -v for k, v in pos.items()}
    assert problem_bootstrap(pos)[3] == 0 and problem_bootstrap(neg)[3] == 0
    mid = {f"x/problem_{i}/a": v for i, v in enumerate((-0.3, 0.3, -0.1, 0.1, -0.2, 0.2, 0.0))}
    assert problem_bootstrap(mid)[3] > 0.8
    assert np.isnan(problem_bootstrap(dict(list(pos.items())[:4]))[3])
    ids = [f"x/problem_{i}/a" for i in range(7)]
    cells = {("random", 1024): dict.fromkeys(ids, 0.3),
             ("streaming", 1024): {t: 0.3 + 0.02 * ((-1) ** i) for i, t in enumerate(ids)},
             ("epikv-learned-decay", 1024): {t: 0.1 + 0.01 * i for i, t in enumerate(ids)}}
    s = wt.summarise({"llama.cpp": cells}, budgets=(1024,))
    diffs = [d for r in s["rows"] for d in r["vs"].values()]
    assert s["holm_m"] == len(diffs) == 4  # decay vs random, vs streaming; streaming vs random; random vs streaming
    assert [d["p_holm"] for d in diffs] == holm([d["p"] for d in diffs])
    assert any(d["p_holm"] > d["p"] for d in diffs)  # the correction moved something


def test_llamacpp_rows_meet_torch_only_for_h2o(wt):
    """A llama.cpp row is paired with llama.cpp's random and streaming (none yet: no pair) and with torch's h2o,
    which llama.cpp cannot run. Mutant: torch's rows stand in for any reference llama.cpp lacks."""
    t = {"x/problem_1/a": 0.2}
    data = {"llama.cpp": {("epikv-learned-decay", 1024): t},
            "torch": {("random", 1024): {"x/problem_1/a": 0.3}, ("h2o", 1024): {"x/problem_1/a": 0.1}}}
    row = next(r for r in wt.summarise(data, budgets=(1024,))["rows"] if r["engine"] == "llama.cpp")
    assert set(row["vs"]) == {"h2o"} and row["vs"]["h2o"]["engine"] == "torch"
    assert row["vs"]["h2o"]["mean"] == pytest.approx(0.1)
