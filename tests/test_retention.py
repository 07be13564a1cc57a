"""Retention benchmark: exactness against full, tau = 1 against a token-by-token decode, CLI, resume, bad input."""

import contextlib
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from epikv.cli import main
from epikv.engine import Decoder
from epikv.errors import EpiKVError
from epikv.retention.bootstrap import aggregate, bootstrap_ci, holm, paired, signed_rank_p
from epikv.retention.report import grid, paired_table
from epikv.retention.runner import policy_pass, prepare_traces, reference_metrics, reference_pass, run_retention
from epikv.retention.store import append_record, read_records

STEPS = "".join(f"Step {i}: add {i} and {i + 3} to get {2 * i + 3}, then check it again carefully. " for i in range(12))
GOOD = {"id": "synthetic/good", "problem": "Add the numbers step by step.",
        "trace": "<think>\n" + STEPS + "\n</think>\nSo the final answer is \\boxed{27}, as checked above."}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # two threads on a shared, loaded 2-core machine spin against each other; one is many times faster
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def item(tiny):
    items, skipped = prepare_traces([GOOD], tiny.tokenizer)
    assert not skipped
    return items[0]


def test_split_at_think_end(tiny, item):
    tok = tiny.tokenizer
    assert tok.decode(item.reasoning_ids).endswith("</think>")
    assert tok.decode(item.answer_ids).strip().startswith("So the final answer")
    capped, _ = prepare_traces([GOOD], tok, max_reasoning_tokens=10, max_answer_tokens=5)
    assert len(capped[0].reasoning_ids) == 10 + len(tok("</think>", add_special_tokens=False)["input_ids"])
    assert len(capped[0].answer_ids) == 5


def test_full_is_exact_and_large_budget_equals_full(tiny, item):
    ref = reference_pass(tiny.model, item, tau=4)
    full = reference_metrics(ref)
    assert full["top1_agreement"] == 1.0 and full["kl"] == 0.0 and full["answer_kl"] == 0.0
    n = len(item.ids)
    for policy in ("epikv", "streaming"):
        m = policy_pass(tiny.model, item, ref, policy, n + 10, tau=4)
        assert m["evictions"] == 0
        assert m["answer_nll"] == full["answer_nll"]  # bit-identical: zero increase
        assert m["top1_agreement"] == 1.0 and m["kl"] == 0.0
    small = policy_pass(tiny.model, item, ref, "epikv", 64, tau=4)
    assert small["evictions"] > 0 and small["peak_cache_tokens"] <= 64 + 3
    assert small["kl"] > 0 and small["answer_nll"] != full["answer_nll"]


def _token_by_token(model, item, policy, budget):
    """Reference decode: prefill the prompt, then one step per token (last-position logits only)."""
    ids = torch.tensor([item.ids])
    p, out = len(item.prompt_ids), []
    with torch.inference_mode():
        dec = Decoder(model, policy, budget, tau=1)
        out.append(dec.prefill(ids[:, :p], [0])[0])
        for s in range(p, ids.shape[1] - 1):
            out.append(dec.step(ids[:, s : s + 1])[0])
    return torch.log_softmax(torch.stack(out).float(), -1), dec.cache.evictions  # [R + A, vocab]


def test_tau_one_equals_token_by_token_decode(tiny):
    item = prepare_traces([GOOD], tiny.tokenizer, max_reasoning_tokens=90, max_answer_tokens=12)[0][0]
    full_lp, _ = _token_by_token(tiny.model, item, "full", None)
    pol_lp, evictions = _token_by_token(tiny.model, item, "epikv", 56)
    assert evictions > 0
    r = len(item.reasoning_ids)
    tgt = torch.tensor(item.reasoning_ids + item.answer_ids)
    kl = (full_lp.exp() * (full_lp - pol_lp)).sum(-1)
    nll = -pol_lp.gather(-1, tgt[:, None]).squeeze(-1)
    full_nll = -full_lp.gather(-1, tgt[:, None]).squeeze(-1)
    agree = (pol_lp.argmax(-1) == full_lp.argmax(-1)).double()

    ref = reference_pass(tiny.model, item, tau=1)
    m = policy_pass(tiny.model, item, ref, "epikv", 56, tau=1)
    assert m["kl"] == pytest.approx(float(kl[:r].mean()), rel=1e-4, abs=1e-7)
    assert m["top1_agreement"] == pytest.approx(float(agree[:r].mean()))
    assert m["answer_nll"] == pytest.approx(float(nll[r:].mean()), rel=1e-5)
    assert reference_metrics(ref)["answer_nll"] == pytest.approx(float(full_nll[r:].mean()), rel=1e-5)
    assert m["evictions"] == evictions


def test_bootstrap_intervals():
    mean, lo, hi = bootstrap_ci([0.1, 0.3, 0.2, 0.5, 0.4])
    assert mean == pytest.approx(0.3) and lo < mean < hi and lo >= 0.1 and hi <= 0.5
    assert bootstrap_ci([0.0, 0.0, 0.0]) == (0.0, 0.0, 0.0)
    m1, lo1, hi1 = bootstrap_ci([0.7])
    assert m1 == 0.7 and math.isnan(lo1) and math.isnan(hi1)
    recs = [{"kind": "retention", "policy": "epikv", "budget": 64, "trace_id": str(i), "kl": v}
            for i, v in enumerate([1.0, 2.0, 3.0])] + [{"kind": "eval", "policy": "x"}]
    rows = aggregate(recs, metrics=("kl",))
    assert len(rows) == 1 and rows[0]["n"] == 3 and rows[0]["kl"][0] == pytest.approx(2.0)


def _rec(policy, budget, trace, **metrics):
    return {"kind": "retention", "policy": policy, "budget": budget, "trace_id": trace, **metrics}


def test_paired_differences_are_per_trace_on_common_traces():
    ref = [0.5, 1.0, 2.0, 4.0]  # the traces differ far more than the policies do
    recs = [_rec("epikv", 64, str(i), answer_nll_increase=v, top1_agreement=0.9) for i, v in enumerate(ref)]
    recs += [_rec("a", 64, str(i), answer_nll_increase=v - 0.1, top1_agreement=0.95) for i, v in enumerate(ref)]
    # b: only traces 0-2, worse by 0.2 on two of them, better by 0.1 on one
    recs += [_rec("b", 64, str(i), answer_nll_increase=ref[i] + d, top1_agreement=0.8) for i, d in
             enumerate([0.2, 0.2, -0.1])]
    recs += [_rec("full", None, "0", answer_nll_increase=0.0), _rec("c", 128, "0", answer_nll_increase=0.0)]
    rows = {r["policy"]: r for r in paired(recs, "epikv")}
    assert set(rows) == {"a", "b"}  # no reference at budget 128; `full` has no budget
    a, b = rows["a"], rows["b"]
    assert (a["n"], a["better"]) == (4, 4) and a["diff"] == pytest.approx((-0.1, -0.1, -0.1))
    assert (b["n"], b["better"]) == (3, 1) and b["diff"][0] == pytest.approx(0.1)
    # higher is better for agreement
    top1 = {r["policy"]: r for r in paired(recs, "epikv", "top1_agreement")}
    assert top1["a"]["better"] == 4 and top1["b"]["better"] == 0
    table = paired_table(recs, "epikv", "answer_nll_increase")
    assert "| a | **-0.1000 [-0.1000, -0.1000]**, better on 4/4 |" in table  # bold: the interval excludes 0
    assert "| b | +0.1000 [" in table  # not bold: its interval holds 0
    assert paired_table(recs, "absent", "answer_nll_increase") == ""


def test_holm_adjusts_step_down_and_stays_monotone():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 -> 0.02, 0.03, 0.06, 0.04, the last raised to 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0] and holm([]) == []


def test_signed_rank_p_is_wilcoxons_exact_two_sided_value():
    # eight differences of one sign: 2 of the 2^8 sign patterns are as extreme
    assert signed_rank_p([-0.1 * (i + 1) for i in range(8)]) == pytest.approx(2 / 256)
    # the smallest one flipped: W+ = 1, reached by 2 patterns on that side (rank sets {} and {1})
    assert signed_rank_p([0.1] + [-0.1 * (i + 2) for i in range(7)]) == pytest.approx(4 / 256)
    # zeros carry no sign and are dropped; no differences at all are no evidence
    assert signed_rank_p([0.0, 0.0] + [-0.1 * (i + 1) for i in range(8)]) == pytest.approx(2 / 256)
    assert signed_rank_p([0.0, 0.0, 0.0]) == 1.0


def test_paired_table_daggers_only_what_survives_holm():
    """Bold marks an interval that excludes 0; the dagger needs the signed-rank test to survive Holm over the whole
    table: 4 traces all better are bold but can reach only p = 1/8, 10 traces all better survive 4 comparisons, 8
    of 10 do not."""
    ref = [0.5 * (i + 1) for i in range(10)]
    recs = [_rec("epikv", 64, str(i), answer_nll_increase=v) for i, v in enumerate(ref)]
    recs += [_rec("strong", 64, str(i), answer_nll_increase=v - 0.01 * (i + 1)) for i, v in enumerate(ref)]
    recs += [_rec("few", 64, str(i), answer_nll_increase=ref[i] - 0.1) for i in range(4)]
    # better on 7 of 10 but worse by more on 3: the mean is near 0 and the test finds nothing
    recs += [_rec("mixed", 64, str(i), answer_nll_increase=v + (0.3 if i < 3 else -0.1)) for i, v in enumerate(ref)]
    # better on 8 of 10, worse on the ranks 1 and 4: W+ = 5, p = 2 x 10/1024 below 0.05 alone, not after Holm
    recs += [_rec("border", 64, str(i), answer_nll_increase=v + (1 if i in (0, 3) else -1) * 0.01 * (i + 1))
             for i, v in enumerate(ref)]
    rows = {r["policy"]: r for r in paired(recs, "epikv")}
    assert rows["strong"]["p"] == pytest.approx(2 / 1024) and rows["few"]["p"] == pytest.approx(2 / 16)
    assert rows["border"]["p"] == pytest.approx(20 / 1024)
    table = paired_table(recs, "epikv", "answer_nll_increase")
    lines = {ln.split(" | ")[0].lstrip("| "): ln for ln in table.splitlines()}
    assert lines["strong"].endswith("better on 10/10 † |")  # 4 x 2/1024 < 0.05
    assert "†" not in lines["border"] and "better on 8/10 |" in lines["border"]  # 3 x 20/1024 > 0.05
    assert "**-0.1000 [-0.1000, -0.1000]**, better on 4/4 |" in lines["few"]  # bold, no dagger
    assert "†" not in lines["mixed"] and "better on 7/10 |" in lines["mixed"]


def test_report_with_daggers_is_written_under_an_ascii_locale(tmp_path):
    """The dagger is not ASCII: retention.md is written as UTF-8 whatever the user's locale (a C locale without
    coercion made `epikv report` die with UnicodeEncodeError)."""
    script = (
        "import json, sys\n"
        "from epikv.retention.report import render_retention\n"
        "render_retention(json.loads(sys.argv[1]), sys.argv[2], reference='epikv')\n"
    )
    ref = [0.5 * (i + 1) for i in range(10)]
    recs = [_rec("epikv", 64, str(i), answer_nll_increase=v) for i, v in enumerate(ref)]
    recs += [_rec("strong", 64, str(i), answer_nll_increase=v - 0.01 * (i + 1)) for i, v in enumerate(ref)]
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    res = subprocess.run([sys.executable, "-X", "utf8=0", "-c", script, json.dumps(recs), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-500:]
    assert "better on 10/10 †" in (tmp_path / "retention.md").read_text(encoding="utf-8")


def test_aggregate_dedupes_merged_folders_and_separates_settings():
    recs = [_rec("epikv", 64, str(i), kl=1.0) for i in range(3)]
    recs += [_rec("epikv", 64, "0", kl=1.0)]  # the same trace again (two folders merged): counted once
    recs += [dict(_rec("epikv", 64, str(i), kl=5.0), settings={"layers": [1, 2]}) for i in range(2)]
    rows = {r["policy"]: r for r in aggregate(recs, metrics=("kl",))}
    assert set(rows) == {"epikv", "epikv[layers=[1, 2]]"}
    assert rows["epikv"]["n"] == 3 and rows["epikv"]["kl"] == (1.0, 1.0, 1.0)
    assert rows["epikv[layers=[1, 2]]"]["n"] == 2 and rows["epikv[layers=[1, 2]]"]["kl"][0] == 5.0


def test_grid_orders_policies_best_first():
    recs = [_rec(p, b, str(i), answer_nll_increase=v * b / 64, top1_agreement=1 - v)
            for p, v in (("worst", 0.3), ("best", 0.1), ("mid", 0.2)) for b in (64, 128) for i in range(3)]
    rows = aggregate(recs)
    nll = grid(rows, "answer_nll_increase").splitlines()
    assert [l.split(" | ")[0] for l in nll[2:]] == ["| best", "| mid", "| worst"]
    assert nll[0] == "| policy | K = 64 | K = 128 |" and "| best | 0.1000 [0.1000, 0.1000] (3) | 0.2000" in nll[2]
    top1 = grid(rows, "top1_agreement", pct=True).splitlines()
    assert top1[2].startswith("| best | 90.0 [90.0, 90.0] (3)")


def test_store_drops_torn_tail(tmp_path):
    path = tmp_path / "r.jsonl"
    append_record(path, {"a": 1})
    with path.open("a") as f:
        f.write('{"a": 2, "b"')  # killed mid-write
    assert read_records(path) == [{"a": 1}]
    append_record(path, {"a": 3})
    assert read_records(path) == [{"a": 1}, {"a": 3}]


def test_ci_sized_cli_run_and_resume(tmp_path, capsys):
    out = tmp_path / "ret"
    argv = ["retention", "--model", "random:tiny", "--limit", "2", "--max-reasoning-tokens", "300",
            "--max-answer-tokens", "48", "--policies", "full,epikv,streaming", "--budgets", "128,256", "--out", str(out)]
    assert main(argv) == 0
    recs = read_records(out / "results.jsonl")
    assert len(recs) == 2 * (1 + 2 * 2)
    assert {r["kind"] for r in recs} == {"retention"}
    for r in recs:
        assert r["reasoning_tokens"] <= 300 + 5 and r["answer_tokens"] <= 48
        # time accounting: forward seconds are part of the record's wall time; throughput counts streamed tokens
        streamed = r["reasoning_tokens"] + r["answer_tokens"]
        assert 0 < r["seconds"] <= r["wall_s"] and r["tokens_per_s"] == pytest.approx(streamed / r["seconds"])
        # memory: the full cache holds every fed token (the last one predicts nothing and is not fed); a policy
        # never more than K + tau - 1 (tau 16 by default)
        n_fed = r["prompt_tokens"] + streamed - 1
        if r["policy"] == "full":
            assert r["peak_cache_tokens"] == n_fed
        else:
            assert r["budget"] < r["peak_cache_tokens"] <= r["budget"] + 15
        if r["policy"] == "full":
            assert r["budget"] is None and r["answer_nll_increase"] == 0.0 and r["top1_agreement"] == 1.0
        else:
            assert r["evictions"] > 0 and r["top1_agreement"] < 1.0
    for name in ("retention.md", "retention_summary.json", "retention_top1_agreement.png",
                 "retention_answer_nll_increase.png", "retention_kl.png"):
        assert (out / name).stat().st_size > 0
    table = (out / "retention.md").read_text()
    assert "| full | all | 2 |" in table and "| epikv | 128 | 2 |" in table
    capsys.readouterr()
    assert main(argv) == 0  # resume: nothing left to do
    assert "0 records written, 10 already done" in capsys.readouterr().out
    assert len(read_records(out / "results.jsonl")) == 10
    bad = argv[:-2] + ["--tau", "4", "--out", str(out)]
    assert main(bad) == 2
    assert "different tau" in capsys.readouterr().err


def test_bad_traces_are_skipped_by_id(tmp_path, tiny, capsys):
    rows = [dict(GOOD, id="no-end", trace="<think>\nthinking but never closing"),
            dict(GOOD, id="empty-answer", trace="<think>\nsome thought\n</think>\n  \n"), GOOD]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    assert main(["retention", "--model", "random:tiny", "--traces", str(path), "--policies", "full,epikv",
                 "--budgets", "64", "--tau", "8", "--out", str(out), "--no-report"]) == 0
    err = capsys.readouterr().err
    assert "skipped trace no-end: no </think>" in err and "skipped trace empty-answer: empty answer" in err
    assert {r["trace_id"] for r in read_records(out / "results.jsonl")} == {"synthetic/good"}


def test_skip_and_limit_select_a_slice(tmp_path, capsys):
    rows = [dict(GOOD, id=f"t{i}") for i in range(4)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["retention", "--model", "random:tiny", "--traces", str(path), "--policies", "full", "--no-report"]
    assert main(base + ["--skip", "1", "--limit", "2", "--out", str(tmp_path / "a")]) == 0
    assert [r["trace_id"] for r in read_records(tmp_path / "a" / "results.jsonl")] == ["t1", "t2"]
    assert main(base + ["--skip", "3", "--out", str(tmp_path / "b")]) == 0
    assert [r["trace_id"] for r in read_records(tmp_path / "b" / "results.jsonl")] == ["t3"]
    capsys.readouterr()
    assert main(base + ["--skip", "4", "--out", str(tmp_path / "c")]) == 2
    assert "--skip 4" in capsys.readouterr().err


def test_bad_input_is_one_line_error(tmp_path, capsys):
    assert main(["retention", "--model", "random:tiny", "--traces", str(tmp_path / "none.jsonl"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    assert main(["retention", "--model", "random:tiny", "--traces", str(path), "--policies", "nope",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'nope'" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(EpiKVError):
        run_retention(None, None, [GOOD], tmp_path / "o2", ["epikv"], [64], tau=0)
    # a variant without the settings it names is refused, never run as the plain policy
    with pytest.raises(EpiKVError, match="needs settings_for"):
        run_retention(None, None, [GOOD], tmp_path / "o3", ["epikv", "epikv[reserve=16]"], [64])


def _md_table(md: str, title: str) -> dict[str, list[str]]:
    """policy -> cells of the markdown table under the heading that starts with `title`."""
    block = md.split("## " + title, 1)[1].split("\n## ", 1)[0]
    rows = [l for l in block.splitlines() if l.startswith("| ") and not l.startswith("| policy")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in l.strip("|").split("|")] for l in rows)}


def test_report_over_two_fresh_folders_matches_the_records(tmp_path, capsys):
    """`epikv report` over two folders of a fresh run (one trace each; the first folder passed twice): every cell
    is the mean of the raw records over distinct traces, inside its interval, and the paired table's difference
    and win count are what the records give per trace."""
    rows = [GOOD, dict(GOOD, id="synthetic/other", trace=GOOD["trace"].replace("carefully", "once more, slowly"))]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["retention", "--model", "random:tiny", "--traces", str(path), "--policies", "full,epikv,streaming",
            "--budgets", "64,96", "--tau", "8", "--max-answer-tokens", "24", "--no-report"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(base + ["--limit", "1", "--out", str(a)]) == 0
    assert main(base + ["--skip", "1", "--out", str(b)]) == 0
    recs = read_records(a / "results.jsonl") + read_records(b / "results.jsonl")
    assert len(recs) == 2 * 5
    out = tmp_path / "rep"
    assert main(["report", str(a), str(a), str(b), "--out", str(out)]) == 0
    assert "retention:" in capsys.readouterr().out

    def metric(policy, budget, key):
        return {r["trace_id"]: r[key] for r in recs if r["policy"] == policy and r["budget"] == budget}

    summary = {(r["policy"], r["budget"]): r for r in json.loads((out / "retention_summary.json").read_text())}
    assert set(summary) == {("full", None)} | {(p, k) for p in ("epikv", "streaming") for k in (64, 96)}
    md = (out / "retention.md").read_text()
    nll = _md_table(md, "Answer-NLL increase")
    for (policy, budget), row in summary.items():
        vals = metric(policy, budget, "answer_nll_increase")
        mean = sum(vals.values()) / 2
        assert row["n"] == 2 and row["answer_nll_increase"][0] == pytest.approx(mean)
        lo, hi = row["answer_nll_increase"][1:]
        assert lo - 1e-12 <= mean <= hi + 1e-12 and lo <= min(vals.values()) + 1e-12 and hi >= max(vals.values()) - 1e-12
        top1 = metric(policy, budget, "top1_agreement")
        assert row["top1_agreement"][0] == pytest.approx(sum(top1.values()) / 2)
        if policy == "full":
            assert mean == 0.0 and row["top1_agreement"][0] == 1.0
        else:
            cell = nll[policy][[64, 96].index(budget)]
            assert cell.startswith(f"{mean:.4f} [") and cell.endswith("(2)")
    paired = _md_table(md, "Paired against epikv: answer-NLL")
    for heading in ("top-1 agreement", "NLL increase over full on the last 256", "KL(full || policy) on the answer"):
        assert f"## Paired against epikv: {heading}" in md  # acronyms keep their case mid-sentence
    for k, cell in zip((64, 96), paired["streaming"]):
        s, e = metric("streaming", k, "answer_nll_increase"), metric("epikv", k, "answer_nll_increase")
        diff = sum(s[t] - e[t] for t in s) / 2
        assert cell.lstrip("*").startswith(f"{diff:+.4f} [")
        assert f"better on {sum(s[t] < e[t] for t in s)}/2" in cell
    assert (out / "retention_top1_agreement.png").stat().st_size > 5000
    for name in ("retention_tail_nll_increase.png", "retention_answer_kl.png", "retention_paired_epikv.png"):
        assert (out / name).stat().st_size > 5000
    assert not (out / "retention_paired_random.png").exists()  # no random records: no pairs, no figure


def test_tail_metric_covers_the_last_reasoning_tokens_before_think_end():
    """tail_nll / tail_kl average the TAIL positions that predict the last body tokens before `</think>`: not the
    tag's own tokens, not the answer."""
    from epikv.retention.metrics import TAIL, Accumulator, Reference

    r, body, a, vocab = TAIL + 60, TAIL + 57, 5, 4  # 3 tokens of </think>
    n = r + a
    targets = torch.zeros(n, dtype=torch.long)
    ref_logp = torch.full((n, vocab), math.log(1 / vocab))
    ref = Reference(logp=ref_logp, top1=ref_logp.argmax(-1), targets=targets, n_reasoning=r, n_body=body)
    p = torch.linspace(0.05, 0.95, n)  # probability of the target at each position
    logp = torch.log(torch.stack([p, *(((1 - p) / (vocab - 1)),) * (vocab - 1)], dim=-1))
    acc = Accumulator(ref)
    acc.add_logp(0, logp)
    out = acc.result()
    nll = -torch.log(p).double()
    assert out["tail_nll"] == pytest.approx(float(nll[body - TAIL : body].mean()), rel=1e-6)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).double()
    assert out["tail_kl"] == pytest.approx(float(kl[body - TAIL : body].mean()), rel=1e-6)
    assert out["reasoning_nll"] == pytest.approx(float(nll[:r].mean()), rel=1e-6)


def test_prepare_traces_records_the_body_length(tiny):
    tok = tiny.tokenizer
    rows = [{"id": "t", "problem": "2+2?", "trace": "four is the sum</think>4"}]
    items, _ = prepare_traces(rows, tok)
    body = tok("four is the sum", add_special_tokens=False)["input_ids"]
    assert items[0].n_body == len(body) and items[0].reasoning_ids[: len(body)] == body
    assert len(items[0].reasoning_ids) > len(body)  # the tag's tokens follow


def test_the_plain_name_goes_to_the_main_interval_not_to_the_policy_with_more_records():
    """A run half done: epikv has more records at tau 128 (the Seg folder finished first) than at tau 16, but the
    other baselines run at tau 16, so the plain `epikv` they are paired with must be the tau-16 one, even while the
    tau-128 folder holds more records."""
    from epikv.retention.bootstrap import unique

    recs = [{**_rec("epikv", 64, str(i), answer_nll_increase=0.2), "tau": 128} for i in range(5)]
    recs += [{**_rec(p, 64, str(i), answer_nll_increase=0.1), "tau": 128} for p in ("epikv-seg", "epikv-seg-q")
             for i in range(5)]  # more records at tau 128 (15) than at tau 16 (11), but fewer policies
    recs += [{**_rec("epikv", 64, str(i), answer_nll_increase=0.5), "tau": 16} for i in range(2)]
    recs += [{**_rec(p, 64, str(i), answer_nll_increase=0.3), "tau": 16} for p in ("h2o", "random", "tova")
             for i in range(3)]
    labels = {(r["policy"], r["tau"]): r["label"] for r in unique(recs)}
    assert labels[("epikv", 16)] == "epikv" and labels[("epikv", 128)] == "epikv@tau=128"
    assert labels[("epikv-seg", 128)] == "epikv-seg"  # never run at tau 16: its plain name
    d = {r["policy"]: r for r in paired(recs, "epikv")}["h2o"]
    assert d["n"] == 2 and d["diff"][0] == pytest.approx(-0.2)


def test_other_intervals_are_other_rows_and_pair_with_the_default():
    """epikv at tau 16 and at tau 128 (two folders) are two rows, never pooled; `full` is one reference row."""
    from epikv.retention.bootstrap import unique

    recs = [_rec("epikv", 64, str(i), answer_nll_increase=0.5) for i in range(3)]
    recs += [{**_rec("epikv", 64, str(i), answer_nll_increase=0.2), "tau": 128} for i in range(3)]
    recs += [{**_rec("full", None, "0", answer_nll_increase=0.0), "tau": t} for t in (16, 128)]
    recs += [{**_rec("epikv-seg", 64, str(i), answer_nll_increase=0.1), "tau": 128} for i in range(3)]
    recs += [_rec("h2o", 64, str(i), answer_nll_increase=0.3) for i in range(4)]  # the main interval: the default
    labels = {(r["policy"], r.get("tau")): r["label"] for r in unique(recs)}
    assert labels[("epikv", 128)] == "epikv@tau=128" and labels[("epikv", None)] == "epikv"
    assert labels[("epikv-seg", 128)] == "epikv-seg"  # found at one interval only: its plain name
    rows = {(r["policy"], r["budget"]): r for r in aggregate(recs)}
    assert set(rows) == {("epikv", 64), ("epikv@tau=128", 64), ("epikv-seg", 64), ("h2o", 64), ("full", None)}
    assert rows[("epikv", 64)]["answer_nll_increase"][0] == pytest.approx(0.5)
    d = {r["policy"]: r for r in paired(recs, "epikv")}["epikv@tau=128"]
    assert d["n"] == 3 and d["diff"][0] == pytest.approx(-0.3)
    # the like-for-like reference of the Seg family: epikv at its interval, by its label
    d = {r["policy"]: r for r in paired(recs, "epikv@tau=128")}["epikv-seg"]
    assert d["n"] == 3 and d["diff"][0] == pytest.approx(-0.1)


def test_a_labelled_reference_gets_its_section_and_a_plain_file_name(tmp_path):
    from epikv.retention.report import render_retention

    recs = [{**_rec("epikv", 64, str(i), answer_nll_increase=0.5), "tau": 16} for i in range(3)]
    recs += [{**_rec("epikv", 64, str(i), answer_nll_increase=0.2), "tau": 128} for i in range(3)]
    recs += [{**_rec("epikv-seg", 64, str(i), answer_nll_increase=0.1), "tau": 128} for i in range(3)]
    recs += [{**_rec("h2o", 64, str(i), answer_nll_increase=0.3), "tau": 16} for i in range(3)]
    written = {p.name for p in render_retention(recs, tmp_path, reference=("epikv", "epikv@tau=128"))}
    assert {"retention_paired_epikv.png", "retention_paired_epikv_tau_128.png"} <= written
    md = (tmp_path / "retention.md").read_text()
    cell = _md_table(md, "Paired against epikv@tau=128: answer-NLL")["epikv-seg"][0]
    assert cell.startswith("**-0.1000 [") and "better on 3/3" in cell


def test_a_variant_is_another_row_of_one_invocation_with_its_settings(tmp_path, capsys):
    """`--policies epikv,epikv[reserve=8]` runs both against one reference pass; the variant's record is the one a
    separate `--set epikv.reserve=8` run writes (same key, same metrics), and it differs from plain epikv."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    base = ["retention", "--model", "random:tiny", "--traces", str(path), "--budgets", "64", "--tau", "8",
            "--no-report"]
    assert main(base + ["--policies", "full,epikv,epikv[reserve=8]", "--out", str(tmp_path / "v")]) == 0
    assert main(base + ["--policies", "epikv", "--set", "epikv.reserve=8", "--out", str(tmp_path / "s")]) == 0
    both = {json.dumps(r["settings"]): r for r in read_records(tmp_path / "v" / "results.jsonl")
            if r["policy"] == "epikv"}
    (alone,) = read_records(tmp_path / "s" / "results.jsonl")
    assert set(both) == {"{}", '{"reserve": 8}'} and alone["settings"] == {"reserve": 8}
    metrics = ("answer_nll", "kl", "top1_agreement", "tail_nll", "evictions")
    assert all(both['{"reserve": 8}'][m] == pytest.approx(alone[m], rel=1e-5, abs=1e-7) for m in metrics)
    assert any(both["{}"][m] != pytest.approx(alone[m], rel=1e-5, abs=1e-7) for m in metrics)
    capsys.readouterr()
    # resuming by the label, in another order, finds both done
    assert main(base + ["--policies", "epikv[reserve=8],epikv,full", "--out", str(tmp_path / "v")]) == 0
    assert "0 records written, 3 already done" in capsys.readouterr().out


def test_policy_variants_parse_and_refuse_like_set(tmp_path, capsys):
    import argparse

    from epikv.commands.common import policy_list, policy_variant

    assert policy_list("full, epikv,epikv[reserve=16, layers=[6, 20]]") == \
        ["full", "epikv", "epikv[reserve=16, layers=[6, 20]]"]
    assert policy_variant("epikv[reserve=16, layers=[6, 20]]") == ("epikv", {"reserve": 16, "layers": (6, 20)})
    assert policy_variant("lag-kv") == ("lag-kv", {})
    for bad, why in (("epikv[reserve=1.5]", "expects int"), ("epikv[nope=1]", "has no setting 'nope'"),
                     ("epikv[reserve=16", "unbalanced"), ("epikv[]", "expected POLICY[SETTING=VALUE"),
                     ("epikv[reserve=1, reserve=2]", "sets reserve twice"), ("nope[x=1]", "unknown policy")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(why)):
            policy_list(f"full,{bad}")
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")

    def refused(*argv) -> str:
        with pytest.raises(SystemExit) if "=x]" in argv[4] else contextlib.nullcontext():
            assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        return err

    assert "epikv.reserve expects int" in refused("retention", "--model", "random:tiny", "--policies",
                                                  "epikv[reserve=x]", "--traces", str(path), "--out", str(tmp_path))
    # commands without variant rows say what to use instead
    assert "use --set epikv.reserve=16" in refused("eval", "--model", "random:tiny", "--policies", "epikv[reserve=16]",
                                                   "--dataset", "gsm8k", "--out", str(tmp_path / "e"))


@pytest.mark.parametrize("rows,why", [
    ([dict(GOOD, id="a", trace="<think>\nnever closing"), dict(GOOD, id="b", trace="no tags at all")],
     "2 no </think> in the trace"),
    ([{"id": "a", "problem": "Q"}, {"id": "b", "trace": GOOD["trace"]}], "2 missing trace or problem text"),
    ([dict(GOOD, id="a", trace="<think>\nx\n</think>\n "), dict(GOOD, id="b", trace="only thinking")],
     "1 empty answer after </think>, 1 no </think> in the trace"),
])
def test_nothing_to_score_is_exit_2_and_leaves_no_folder(tmp_path, capsys, rows, why):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    assert main(["retention", "--model", "random:tiny", "--traces", str(path), "--policies", "full,epikv",
                 "--budgets", "64", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "none of the 2 traces can be scored" in lines[0] and why in lines[0], captured.err
    assert not out.exists() and "records written" not in captured.out


def test_every_run_impossible_is_exit_2_and_leaves_no_folder(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    out = tmp_path / "o"
    kept = tmp_path / "kept"
    kept.mkdir()  # a folder the user made stays, even when nothing went into it
    for folder in (out, kept):
        assert main(["retention", "--model", "random:tiny", "--traces", str(path), "--policies", "epikv",
                     "--budgets", "4", "--out", str(folder)]) == 2  # K = 4 is below the protected prompt
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no evicting run is possible: epikv K=4 (budget 4 is smaller than what is " \
               "protected" in err[0], err
    assert not out.exists() and kept.is_dir()


def test_full_alone_is_no_result(tmp_path, capsys, monkeypatch):
    """Every evicting run impossible: exit 2 naming them, even though `full` could run (it compares nothing)."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    out = tmp_path / "o"
    assert main(["retention", "--model", "random:tiny", "--traces", str(path), "--policies", "full,epikv,lag-kv",
                 "--budgets", "4,6", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no evicting run is possible: epikv K=4 (budget 4" in err[0], err
    assert all(f"{p} K={k} (" in err[0] for p in ("epikv", "lag-kv") for k in (4, 6))
    assert not out.exists()
    # failures found only while running (not by the budget check): the same refusal, the full records kept
    import epikv.retention.runner as runner

    def boom(*a, **k):
        raise runner.EpiKVError("boom")

    monkeypatch.setattr(runner, "policy_pass", boom)
    assert main(["retention", "--model", "random:tiny", "--traces", str(path), "--policies", "full,epikv",
                 "--budgets", "200", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no evicting run was possible: epikv K=200 (boom); the full-cache records written are kept" in err[-1]


def test_batch_traces_speed_is_stated_alike_in_help_and_docs(capsys):
    """--batch-traces' speed-up as measured (benchmarks/results/retention-speed: 1.69x), the same in both places."""
    from pathlib import Path

    with pytest.raises(SystemExit):
        main(["retention", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, hyphenated words too
    readme = "".join((Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text().split())
    assert "1.7xthetokensperCPU-secondatN=4ontheembeddedmodel(measured1.69x;" in text
    assert "1.7xthetokensperCPU-secondontheembeddedmodel(measured1.69x," in readme
    assert "1.5x" not in text


@pytest.mark.parametrize("folder,argv", [
    ("retention", ["retention", "retention/traces-17-28", "retention/rerun-1-16", "retention/rerun-17-28"]),
    ("retention-full", ["retention-full/tau16", "retention-full/tau128", "--reference", "epikv,random,epikv@tau=128"]),
])
def test_committed_retention_reports_are_current_renders(tmp_path, capsys, folder, argv):
    """The committed retention.md is what `epikv report` renders today from the committed records (the commands in
    each folder's README), not a stale render of an older report."""
    from pathlib import Path

    res = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    argv = [str(res / a) if "/" in a or a == folder else a for a in argv]
    assert main(["report", *argv, "--out", str(tmp_path)]) == 0
    fresh = (tmp_path / "retention.md").read_text(encoding="utf-8")
    assert fresh == (res / folder / "retention.md").read_text(encoding="utf-8"), \
        f"re-render benchmarks/results/{folder} with epikv report"


def test_report_refuses_an_unknown_reference(tmp_path, capsys):
    """--reference names rows of the records: a typo is one line and exit 2 before anything is written."""
    from pathlib import Path

    res = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "retention"
    assert main(["report", str(res), "--reference", "epikv,nosuch", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--reference nosuch: no such policy row" in err
    assert "lag-kv" in err and not (tmp_path / "r").exists()
    (tmp_path / "e").mkdir()  # an eval folder has no paired tables: --reference there is refused too
    assert main(["report", str(tmp_path / "e"), "--reference", "epikv"]) == 2
    assert "applies to retention directories" in capsys.readouterr().err


def _overlaps(fig) -> list[tuple[str, str]]:
    """Pairs of visible texts (titles, axis titles, tick labels) whose drawn boxes overlap."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    texts = [t for ax in fig.axes for t in (ax.title, ax.yaxis.label, ax.xaxis.label, *ax.get_yticklabels())
             if t.get_visible() and t.get_text()]
    boxes = [(t.get_text(), t.get_window_extent(r)) for t in texts]
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if ba.overlaps(bb)]


@pytest.mark.parametrize("n_policies", [1, 2, 8])
def test_paired_plot_texts_never_overprint(n_policies):
    """retention_paired_<ref>.png: each panel's titles and labels stay apart, with few policies as with many."""
    import matplotlib.pyplot as plt

    from epikv.retention.report import _paired_figure

    recs = []
    for i in range(4):
        for b in (256, 512, 1024):
            for p in ["epikv"] + [f"p{k}" for k in range(n_policies)]:
                recs.append(_rec(p, b, str(i), answer_nll_increase=0.1 * i + len(p), tail_nll_increase=0.05 * i,
                                 answer_kl=0.01 * i + len(p)))
    fig = _paired_figure(recs, "epikv")
    try:
        assert len(fig.axes) == 9 and not _overlaps(fig), _overlaps(fig)
    finally:
        plt.close(fig)


def test_a_variant_may_set_its_own_tau(tmp_path):
    """`streaming[tau=4]` in a folder at tau 8 runs and records tau 4 (rows at equal peak bytes, each policy at its
    own schedule): its record equals a folder run at --tau 4. Mutant: the folder's tau winning over the variant's."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    base = ["retention", "--model", "random:tiny", "--traces", str(path), "--budgets", "40", "--no-report"]
    assert main(base + ["--tau", "8", "--policies", "full,streaming[tau=4]", "--out", str(tmp_path / "v")]) == 0
    assert main(base + ["--tau", "4", "--policies", "full,streaming", "--out", str(tmp_path / "s")]) == 0
    (var,) = [r for r in read_records(tmp_path / "v" / "results.jsonl") if r["policy"] == "streaming"]
    (alone,) = [r for r in read_records(tmp_path / "s" / "results.jsonl") if r["policy"] == "streaming"]
    assert var["tau"] == 4 and var["settings"] == {"tau": 4}
    assert var["evictions"] == alone["evictions"] and var["peak_cache_tokens"] == alone["peak_cache_tokens"] <= 40 + 4
    assert var["answer_nll"] == pytest.approx(alone["answer_nll"], rel=1e-5, abs=1e-7)


def test_budgets_per_policy_share_one_reference_pass_per_trace(tiny, tmp_path, monkeypatch):
    """budgets_for (what --kv-memory gives: each policy its own K) runs each policy at its own budgets only, trace
    by trace with one reference pass a trace. Mutant: budgets_for ignored (every policy at `budgets`)."""
    import epikv.retention.runner as runner

    calls = []
    real = runner.reference_pass
    monkeypatch.setattr(runner, "reference_pass", lambda *a, **k: calls.append(a[1].id) or real(*a, **k))
    rows = [GOOD, {**GOOD, "id": "synthetic/other"}]
    own = {"full": [64], "streaming": [40], "epikv": [56, 64]}
    run_retention(tiny.model, tiny.tokenizer, rows, tmp_path / "o", list(own), [64], tau=4, quiet=True,
                  budgets_for=own.__getitem__)
    recs = read_records(tmp_path / "o" / "results.jsonl")
    got = sorted({(r["policy"], r["budget"]) for r in recs}, key=str)
    assert got == sorted({("full", None), ("streaming", 40), ("epikv", 56), ("epikv", 64)}, key=str)
    assert len(recs) == 8 and calls == ["synthetic/good", "synthetic/other"]


def test_the_report_states_peak_kv_bytes_beside_k():
    """llama.cpp records carry kv_peak_bytes: the report's table gives its mean in MiB beside K; torch records (none)
    show "-". Mutant: the column left out, or read from peak_cache_tokens."""
    from epikv.retention.report import table

    recs = [{**_rec("random", 64, str(i), answer_nll_increase=0.1), "kv_peak_bytes": 3 * 2 ** 20} for i in range(3)]
    recs += [_rec("streaming", 64, str(i), answer_nll_increase=0.1) for i in range(3)]
    rows = {line.split("|")[1].strip(): line for line in table(aggregate(recs)).splitlines()[2:]}
    assert rows["random"].rstrip(" |").endswith("3.00") and rows["streaming"].rstrip(" |").endswith("-")
