"""`epikv eval` / `epikv report` on a tiny random model: records, resume, shards, refusal to mix, bad inputs,
kill-and-resume, reports."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epikv.cli import main
from epikv.failure import detect
from epikv.eval.records import RecordWriter, read_records
from epikv.eval.report import summarize, tau_text, wilson, write_report

# Fields EVALUATION.md section 1 asks of every record.
FIELDS = ["id", "policy", "budget", "tau", "seed", "prompt_tokens", "new_tokens", "final_answer", "correct",
          "correct_strict", "wall_seconds", "seconds_per_1k_tokens", "peak_memory_bytes", "evictions", "hit_cap",
          "empty", "repetition"]


def _dataset(path: Path, n: int = 6) -> Path:
    rows = [{"id": f"p{i}", "problem": f"What is {i} plus {i + 3}?", "answer": str(2 * i + 3)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(data, out, *extra, budgets="44,48", policies="epikv,streaming"):
    # Prompts are 39-40 tokens: with 4 recent tokens and 12 new tokens both budgets evict.
    return ["eval", "--dataset", str(data), "--model", "random:tiny", "--policies", policies, "--budgets", budgets,
            "--recent", "4", "--max-new-tokens", "12", "--out", str(out), "--quiet", *extra]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: several threads per process thrash on a shared 2-core machine (and tiny models gain
    nothing from them)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def data(tmp_path):
    return _dataset(tmp_path / "mini.jsonl")


def test_records_resume_and_extend(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(data, out, "--batch-size", "2")) == 0
    recs = read_records(out)
    assert len(recs) == 6 * 2 * 2
    assert {(r["policy"], r["budget"]) for r in recs} == {("epikv", 44), ("epikv", 48), ("streaming", 44),
                                                           ("streaming", 48)}
    for r in recs:
        assert all(k in r for k in FIELDS), [k for k in FIELDS if k not in r]
        assert r["new_tokens"] <= 12 and r["hit_cap"] == (r["finish_reason"] == "length")
        assert r["prompt_tokens"] + r["new_tokens"] > r["max_cache_tokens"] or r["evictions"] == 0
    assert any(r["evictions"] > 0 for r in recs)  # the budgets really evict
    assert all(r["max_cache_tokens"] <= r["budget"] for r in recs)
    # Same command again: nothing new.
    assert main(_args(data, out, "--batch-size", "2")) == 0
    assert "already done" in capsys.readouterr().out
    assert len(read_records(out)) == 24
    # A third budget and the no-eviction policy: only the new cells run (full once per problem).
    assert main(_args(data, out, budgets="44,48,56", policies="epikv,streaming,full")) == 0
    recs = read_records(out)
    assert len(recs) == 24 + 12 + 6
    assert len({(r["id"], r["policy"], r["budget"], r["sample"]) for r in recs}) == len(recs)
    assert {r["budget"] for r in recs if r["policy"] == "full"} == {None}


def test_refuses_another_configuration(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(data, out, budgets="48", policies="epikv")) == 0
    assert main(_args(data, out, "--tau", "4", budgets="48", policies="epikv")) == 2
    err = capsys.readouterr().err
    assert "holds another configuration" in err and "tau" in err
    assert main(_args(data, out, "--set", "epikv.n_sink=2", budgets="48", policies="epikv")) == 2
    assert "epikv.n_sink" in capsys.readouterr().err  # other policy settings: another folder
    assert len(read_records(out)) == 6  # nothing mixed in


def test_bad_inputs(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args("mathqa", out)) == 2
    assert "unknown dataset 'mathqa'" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n\n{"id": "b", "problem": "2+2?"\n')
    assert main(_args(bad, out)) == 2
    assert "bad.jsonl:3: malformed JSON" in capsys.readouterr().err
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"id": "a", "problem": "1+1?"}\n')
    assert main(_args(missing, out)) == 2
    assert "missing.jsonl:1: missing field(s) answer" in capsys.readouterr().err
    assert main(_args(tmp_path / "nope.jsonl", out)) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(_args(data, out, budgets="20")) == 2  # below the prompt length
    err = capsys.readouterr().err
    assert "budget 20 is below" in err and "prompt" in err and err.count("\n") == 1
    assert main(_args(data, out, "--samples", "2")) == 2  # greedy samples would be identical
    assert "--samples > 1 needs sampling" in capsys.readouterr().err
    assert not (out / "records.jsonl").exists()


def test_shards_partition_the_cells(data, tmp_path):
    out = tmp_path / "run"
    for i in range(3):
        assert main(_args(data, out, "--shard", f"{i}/3")) == 0
    files = sorted(p.name for p in out.glob("records*.jsonl"))
    assert files == ["records-0of3.jsonl", "records-1of3.jsonl", "records-2of3.jsonl"]
    recs = read_records(out)
    keys = [(r["id"], r["policy"], r["budget"], r["sample"]) for r in recs]
    assert len(keys) == len(set(keys)) == 24
    assert main(_args(data, out)) == 0  # an unsharded rerun finds everything done
    assert len(read_records(out)) == 24


def test_torn_line_is_cut_before_appending(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"id": "a", "policy": "epikv", "budget": 8, "sample": 0}\n{"id": "b", "pol')
    assert len(read_records(tmp_path)) == 1  # a torn final line is ignored
    with RecordWriter(path) as w:
        w.write({"id": "c", "policy": "epikv", "budget": 8, "sample": 0})
    assert [r["id"] for r in read_records(tmp_path)] == ["a", "c"]


def test_failure_flags_in_records_use_the_shared_detector():
    fm = detect("   ", [], "eos").as_dict()
    assert fm["empty"] and fm["no_answer"] and not fm["hit_cap"]
    fm = detect(r"so \boxed{4}", [1, 2, 3], "length").as_dict()
    assert not fm["empty"] and not fm["no_answer"] and fm["hit_cap"] and not fm["repetition"]


def test_report_merges_directories(data, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(_args(data, a, budgets="44", policies="epikv,full")) == 0
    assert main(_args(data, b, budgets="48", policies="epikv")) == 0
    rep = tmp_path / "rep"
    assert main(["report", str(a), str(b), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert "| mini | random:tiny | full | - | 6 |" in md and "| epikv | 44 |" in md and "| epikv | 48 |" in md
    assert "tau None" not in md and "tau 1 (the default)" in md  # --tau unset: the policies' own default
    csv_lines = (rep / "report.csv").read_text().splitlines()
    assert csv_lines[0].startswith("dataset,model,protocol,policy,budget") and len(csv_lines) == 4
    for png in ("accuracy_vs_budget.png", "speed_vs_budget.png"):
        assert (rep / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = summarize(read_records(a))
    assert {r["policy"] for r in rows} == {"epikv", "full"}
    assert all(0 <= r["ci_low"] <= r["accuracy"] <= r["ci_high"] <= 1 for r in rows)
    assert main(["report", str(tmp_path / "empty")]) == 2


def test_tau_text_names_each_policys_default():
    assert tau_text(4, []) == "tau 4"
    assert tau_text(None, [{"policy": "epikv"}, {"policy": "full"}]) == "tau 1 (the default)"
    assert tau_text(None, [{"policy": "epikv"}, {"policy": "snapkv"}]) == "tau: each policy's default (1: epikv; 128: snapkv)"


def test_wilson_interval():
    lo, hi = wilson(0, 50)
    assert lo == 0 and 0.06 < hi < 0.08
    lo, hi = wilson(25, 50)
    assert 0.36 < lo < 0.37 and 0.63 < hi < 0.64


def test_kill_and_resume(tmp_path):
    """SIGKILL a run mid-way; the rerun ends with every cell exactly once."""
    data = _dataset(tmp_path / "mini.jsonl", n=8)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "epikv.cli", *_args(data, out, "--max-new-tokens", "24", "--threads", "1")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    recs = out / "records.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if recs.exists() and recs.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_killed = len(read_records(out))
    assert 3 <= n_killed < 32
    assert main(_args(data, out, "--max-new-tokens", "24")) == 0
    final = read_records(out)
    keys = [(r["id"], r["policy"], r["budget"], r["sample"]) for r in final]
    assert len(keys) == len(set(keys)) == 8 * 2 * 2


def test_two_processes_share_one_folder(tmp_path):
    """Two `epikv eval` processes started together on one folder: every cell exactly once (issue 11.10: it was
    12 records for 6 cells)."""
    data = _dataset(tmp_path / "mini.jsonl", n=6)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "epikv.cli", *_args(data, out, "--max-new-tokens", "24", "--threads", "1")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    keys = [(r["id"], r["policy"], r["budget"], r["sample"]) for r in read_records(out)]
    assert len(keys) == len(set(keys)) == 6 * 2 * 2
    ran = [int(m) for log in logs for m in re.findall(r": (\d+) generations", log)]
    assert sum(ran) == 24, logs  # the work was split, not done twice (a process that found all done prints none)
    assert not list((out / ".epikv-claims").iterdir())


def test_same_configuration_written_differently_is_accepted(tmp_path, capsys):
    """`--tau 1` is epikv's default; `gsm8k` from a data folder and the same file by path are one dataset."""
    folder = tmp_path / "data"
    folder.mkdir()
    data = _dataset(folder / "gsm8k_test.jsonl", n=3)
    out = tmp_path / "run"
    named = ["--dataset", "gsm8k", "--data-dir", str(folder)]
    argv = _args(data, out, budgets="48", policies="epikv")
    argv[argv.index("--dataset"): argv.index("--dataset") + 2] = named
    assert main(argv) == 0
    assert main(_args(data, out, "--tau", "1", budgets="48", policies="epikv")) == 0  # by path, tau written out
    assert "every cell is already done" in capsys.readouterr().out
    recs = read_records(out)
    assert len(recs) == 3 and {r["dataset"] for r in recs} == {"gsm8k"}
    assert main(_args(data, out, "--tau", "2", budgets="48", policies="epikv")) == 2  # really different
    assert "epikv.tau" in capsys.readouterr().err
    other = _dataset(tmp_path / "other.jsonl", n=3)
    assert main(_args(other, out, budgets="48", policies="epikv")) == 2  # another dataset
    assert "dataset" in capsys.readouterr().err


def test_progress_lines_when_stderr_is_not_a_terminal(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EPIKV_PROGRESS_SECONDS", "0")  # a line per batch instead of every 20 s
    args = [a for a in _args(data, tmp_path / "run", budgets="48", policies="epikv") if a != "--quiet"]
    assert main(args + ["--limit", "3"]) == 0
    lines = re.findall(r"^eval: .*$", capsys.readouterr().err, re.M)  # capsys: stderr is not a TTY
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3", "3/3"]
    assert re.match(r"eval: 1/3 cells, \d+ s elapsed, ~\d+ s left \(epikv K=48 s0, acc \d+\.\d%\)", lines[0])
    assert main(args + ["--limit", "4"]) == 0  # resumed: the count includes what was done before
    assert re.findall(r"^eval: (\S+)", capsys.readouterr().err, re.M) == ["4/4", "4/4"]


def test_report_never_modifies_a_folder_being_written(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(data, out, budgets="48", policies="epikv")) == 0
    path = out / "records.jsonl"
    with path.open("ab") as f:
        f.write(b'{"id": "p9", "policy": "epikv", "budg')  # a writer in the middle of a record
    raw = path.read_bytes()
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    assert path.read_bytes() == raw
    assert "| epikv | 48 | 6 |" in (tmp_path / "rep" / "report.md").read_text()


def test_memory_is_measured_per_run(data, tmp_path):
    """Each record's memory is its own batch's: a later, smaller run reports less (not the process's high water)."""
    import torch

    from epikv.measure import RunPeak

    out = tmp_path / "run"
    assert main(_args(data, out, budgets="48", policies="epikv")) == 0
    assert main(_args(data, out, budgets="44,48", policies="epikv")) == 0  # K=44 runs after K=48
    recs = read_records(out)
    kv = {k: {r["kv_cache_peak_bytes"] for r in recs if r["budget"] == k} for k in (44, 48)}
    assert max(kv[44]) < min(kv[48])
    assert {r["peak_memory_kind"] for r in recs} == {"process_rss_sampled"}
    with RunPeak("cpu") as big:
        x = torch.ones(64 * 2**20)  # 256 MiB
        del x
    with RunPeak("cpu") as small:
        torch.ones(1024).sum()
    assert small.bytes < big.bytes - 128 * 2**20
