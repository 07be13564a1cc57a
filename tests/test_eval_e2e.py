"""End to end on the embedded model: 3 GSM8K problems of the shipped copy, 2 policies x 2 budgets, the local
executor and Ray (a local 2-worker instance) give identical records under greedy decoding; the report renders."""

import pytest

from epikv.cli import main
from epikv.data import data_dir, read_jsonl
from epikv.eval.prompts import PROTOCOLS, build_prompt
from epikv.eval.records import VOLATILE, cell_key, read_records

RECENT = 8


@pytest.fixture(scope="module")
def budgets(smollm2):
    rows = read_jsonl(data_dir() / "gsm8k_test.jsonl")[:3]
    longest = max(len(build_prompt(smollm2.tokenizer, r["problem"], PROTOCOLS["paper"])) for r in rows)
    return [longest + RECENT, longest + RECENT + 4]  # both evict within 16 new tokens


def _args(out, budgets, *extra):
    return ["eval", "--dataset", "gsm8k", "--limit", "3", "--model", "smollm2",
            "--policies", "epikv,streaming", "--budgets", ",".join(map(str, budgets)), "--recent", str(RECENT),
            "--max-new-tokens", "16", "--batch-size", "3", "--threads", "1", "--out", str(out), "--quiet", *extra]


def _stable(recs):
    return {cell_key(r): {k: v for k, v in r.items() if k not in VOLATILE} for r in recs}


def test_local_and_ray_agree_and_report_renders(tmp_path, budgets):
    local, distributed = tmp_path / "local", tmp_path / "ray"
    assert main(_args(local, budgets)) == 0
    recs = read_records(local)
    assert len(recs) == 3 * 2 * 2
    assert all(r["evictions"] > 0 and r["max_cache_tokens"] <= r["budget"] for r in recs)
    assert all(r["executor"] == "local" and r["output"] for r in recs)

    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main(_args(distributed, budgets, "--executor", "ray", "--workers", "2")) == 0
    finally:
        ray.shutdown()
    rrecs = read_records(distributed)
    assert {r["executor"] for r in rrecs} == {"ray"}
    assert len({r["worker"] for r in rrecs}) == 2  # the queue fed both workers
    assert _stable(rrecs) == _stable(recs)  # same texts, answers, verdicts, token counts, evictions

    assert main(["report", str(local), str(distributed), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    for pol in ("epikv", "streaming"):
        for k in budgets:
            assert f"| gsm8k | smollm2 | {pol} | {k} | 3 |" in md  # merged: each cell once
    assert (tmp_path / "rep" / "accuracy_vs_budget.png").stat().st_size > 1000
