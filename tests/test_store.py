"""The shared JSONL store (epikv.store): concurrent writers, read-only readers, claims of killed writers; progress
lines off a terminal (epikv.progress); per-run memory (epikv.measure); retention's counter and help."""

import io
import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from epikv.cli import main
from epikv.progress import Progress
import epikv.store as store_mod
from epikv.store import CLAIMS, Store, Tail, _claim_name, _start_time, append_record, read_records

STEPS = " ".join(f"Step {i}: add {i} to the total, which is now {i * (i + 1) // 2}." for i in range(1, 25))
GOOD = {"id": "g", "problem": "Add the numbers step by step.",
        "trace": "<think>\n" + STEPS + "\n</think>\nSo the final answer is \\boxed{27}, as checked above."}


def _racer(folder, who, n_cells, start):
    store = Store(folder, "records.jsonl", lambda r: r["cell"])
    start.wait()
    for c in range(n_cells):
        if store.claim([c]):
            time.sleep(0.01)  # the work: long enough for the others to want the same cells meanwhile
            store.append([{"cell": c, "who": who}])
    store.close()


def test_racing_writers_write_each_cell_once(tmp_path):
    ctx = mp.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_racer, args=(tmp_path, w, 30, start)) for w in range(3)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    recs = read_records(tmp_path / "records.jsonl")
    assert sorted(r["cell"] for r in recs) == list(range(30))  # every cell exactly once
    assert len({r["who"] for r in recs}) >= 2  # the processes really shared the work
    assert not list((tmp_path / CLAIMS).iterdir())  # claims are gone once their records are written


def test_readers_never_modify_a_torn_file(tmp_path):
    path = tmp_path / "records.jsonl"
    raw = b'{"cell": 1}\n{"cell": 2}\n{"cell": 3, "x'  # the last write was cut (or is still going on)
    path.write_bytes(raw)
    assert read_records(path) == [{"cell": 1}, {"cell": 2}]
    store = Store(tmp_path, "records.jsonl", lambda r: r["cell"])
    assert store.done == {1, 2} and store.records() == [{"cell": 1}, {"cell": 2}]
    assert path.read_bytes() == raw
    # a writer repairs it under the lock before appending
    store.append([{"cell": 4}])
    assert read_records(path) == [{"cell": 1}, {"cell": 2}, {"cell": 4}]
    # a complete record that lost only its newline is a record, and gets its newline back
    path.write_bytes(b'{"cell": 1}\n{"cell": 2}')
    assert read_records(path) == [{"cell": 1}, {"cell": 2}]
    append_record(path, {"cell": 5})
    assert path.read_bytes() == b'{"cell": 1}\n{"cell": 2}\n{"cell": 5}\n'
    path.write_bytes(b'{"cell": 1}\nnot json\n{"cell": 2}\n')
    with pytest.raises(Exception, match="malformed record at line 2"):
        read_records(path)
    assert read_records(path, strict=False) == [{"cell": 1}, {"cell": 2}]


def _proc_start(pid):
    """Field 22 (starttime) of /proc/PID/stat, read here independently of epikv.store: the name field (2) is in
    parentheses and may hold spaces, so the fields are counted from the end of the line's last ')'."""
    with open(f"/proc/{pid}/stat") as f:
        line = f.read()
    head, rest = line.rsplit(")", 1)
    fields = [head.split(" (", 1)[0], head.split(" (", 1)[1]] + rest.split()  # fields 1, 2, 3, ...
    return fields[21]


def _claim_file(folder, key, pid, host=None, start=None):
    d = folder / CLAIMS
    d.mkdir(exist_ok=True)
    (d / _claim_name(key)).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "start": start,
                                                  "key": key}))


def test_a_killed_writers_claim_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _claim_file(tmp_path, "a", dead.pid)  # its writer was killed: stale
        _claim_file(tmp_path, "b", live.pid, start=_proc_start(live.pid))  # a live writer on this host
        _claim_file(tmp_path, "c", 1, host="another-host")  # cannot be checked from here: honoured
        _claim_file(tmp_path, "d", live.pid, start="1")  # the pid was reused by another process: stale
        store = Store(tmp_path, "records.jsonl", lambda r: r["k"])
        assert sorted(store.claim(["a", "b", "c", "d", "e"])) == ["a", "d", "e"]
        assert set(store.claimed_elsewhere) == {"b", "c"}
        store.append([{"k": "a"}])
        store.close()  # releases d and e without records
        assert {p.name for p in (tmp_path / CLAIMS).iterdir()} == {_claim_name("b"), _claim_name("c")}
        again = Store(tmp_path, "records.jsonl", lambda r: r["k"])
        assert sorted(again.claim(["a", "d", "e"])) == ["d", "e"]  # a is done
    finally:
        live.kill()
        live.wait()


def test_start_time_is_the_process_start_in_clock_ticks_since_boot():
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    t0 = time.time()
    try:
        got = _start_time(live.pid)
        assert got == _proc_start(live.pid)
        with open("/proc/stat") as f:
            btime = next(int(l.split()[1]) for l in f if l.startswith("btime "))
        started = btime + int(got) / os.sysconf("SC_CLK_TCK")  # wall-clock start of the child
        assert abs(started - t0) < 5  # btime is whole seconds; the child started just now
    finally:
        live.kill()
        live.wait()
    assert _start_time(live.pid) is None  # reaped: no such process


def test_tail_returns_an_unterminated_record_once_its_newline_arrives(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_bytes(b'{"cell": 1}\n{"cell": 2}')  # the second write is still going on (or lost its newline)
    tail = Tail(path)
    assert tail.poll() == [{"cell": 1}]
    assert tail.poll() == []  # complete JSON, but no newline yet: not a record for an incremental reader
    with open(path, "ab") as f:
        f.write(b"\n")
    assert tail.poll() == [{"cell": 2}]  # now it is, once
    assert tail.poll() == []


def test_an_unreadable_claim_has_a_60_second_grace(tmp_path, monkeypatch):
    """A claim file that does not parse is one being written (or of a claimant killed right after creating it):
    honoured for 60 s after its last change, then taken over."""
    d = tmp_path / CLAIMS
    d.mkdir()
    path = d / _claim_name("a")
    path.write_bytes(b"")  # created, not yet written
    t0 = 1_700_000_000.0
    os.utime(path, (t0, t0))
    now = {"t": t0 + 59.0}
    monkeypatch.setattr(store_mod, "time", type("Clock", (), {"time": staticmethod(lambda: now["t"])}))
    store = Store(tmp_path, "records.jsonl", lambda r: r["k"])
    assert store.claim(["a"]) == [] and path.read_bytes() == b""
    now["t"] = t0 + 61.0
    assert store.claim(["a"]) == ["a"]
    assert json.loads(path.read_text())["pid"] == os.getpid()
    store.close()


def test_a_same_pid_leftover_claim_is_taken_but_not_a_live_store_s(tmp_path):
    _claim_file(tmp_path, "a", os.getpid(), start=_proc_start(os.getpid()))  # an earlier run in this process
    first = Store(tmp_path, "records.jsonl", lambda r: r["k"])
    assert first.claim(["a", "b"]) == ["a", "b"]
    second = Store(tmp_path, "records.jsonl", lambda r: r["k"])  # same pid, another Store: first's are live
    assert second.claim(["a", "b", "c"]) == ["c"]
    first.close()
    second.close()


def test_a_zombie_holders_claim_is_taken_over(tmp_path):
    """A writer killed but not yet reaped by its parent still has its pid (kill(pid, 0) succeeds): it is dead."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        start = _proc_start(child.pid)
        deadline = time.time() + 20
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # exited, not reaped
            assert time.time() < deadline, "the child did not exit"
            time.sleep(0.01)
        os.kill(child.pid, 0)  # the pid still answers
        _claim_file(tmp_path, "a", child.pid, start=start)
        store = Store(tmp_path, "records.jsonl", lambda r: r["k"])
        assert store.claim(["a"]) == ["a"]
        store.close()
    finally:
        child.wait()


def test_append_removes_the_claim_file_at_once(tmp_path):
    store = Store(tmp_path, "records.jsonl", lambda r: r["k"])
    assert store.claim(["a", "b"]) == ["a", "b"]
    path = tmp_path / CLAIMS / _claim_name("a")
    assert path.exists()
    store.append([{"k": "a"}])
    assert not path.exists() and "a" not in store.held  # before close: another process may look right now
    assert (tmp_path / CLAIMS / _claim_name("b")).exists()
    store.close()


def test_claim_repairs_a_dead_writers_last_record_first(tmp_path):
    """A record that lost only its newline (its writer died between the two) is a finished cell: claim repairs
    the file under the lock, then reads it, so the cell is not done twice."""
    path = tmp_path / "records.jsonl"
    path.write_bytes(b'{"k": "a"}\n{"k": "b"}')
    store = Store(tmp_path, "records.jsonl", lambda r: r["k"])
    assert store.done == {"a"}  # a reader does not count an unterminated line
    assert store.claim(["a", "b", "c"]) == ["c"]
    assert path.read_bytes() == b'{"k": "a"}\n{"k": "b"}\n'
    path.write_bytes(path.read_bytes() + b'{"k": "c", "x')  # a torn record: cut off, and its cell stays to do
    other = Store(tmp_path, "records.jsonl", lambda r: r["k"], pattern="*.jsonl")
    assert other.claim(["d"]) == ["d"] and path.read_bytes() == b'{"k": "a"}\n{"k": "b"}\n'
    store.close()
    other.close()


def test_progress_lines_when_stderr_is_not_a_terminal():
    out = io.StringIO()  # not a TTY
    p = Progress("eval", total=4, unit="cells", done=1, interval=0.05, stream=out)
    p.set_status("epikv K=512")
    time.sleep(0.02)
    p.update(1)
    time.sleep(0.2)  # no update: the heartbeat still reports
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3
    assert re.fullmatch(r"eval: 2/4 cells, \d+ s elapsed, ~\d+ s left \(epikv K=512\)", lines[0])
    assert lines[-1].startswith("eval: 2/4 cells")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = Progress("eval", total=4, unit="cells", interval=0.01, stream=tty)
    p.update(2)
    time.sleep(0.05)
    p.close()
    assert "eval: 2/4 cells" not in tty.getvalue()  # a terminal gets the live bar, no log lines
    quiet = io.StringIO()
    p = Progress("eval", total=4, quiet=True, interval=0.01, stream=quiet)
    p.update(1)
    time.sleep(0.03)
    p.close()
    assert quiet.getvalue() == ""


# -- retention: counter, help, progress, concurrency, per-run memory ---------------------------------------------------
@pytest.fixture
def traces(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(dict(GOOD, id=f"t{i}")) + "\n" for i in range(2)))
    return path


def _retention(traces, out, *extra):
    return ["retention", "--model", "random:tiny", "--traces", str(traces), "--policies", "full,epikv",
            "--budgets", "64", "--tau", "8", "--max-reasoning-tokens", "80", "--max-answer-tokens", "8",
            "--out", str(out), "--no-report", *extra]


def test_retention_counter_after_a_resume(traces, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EPIKV_PROGRESS_SECONDS", "0")
    out = tmp_path / "r"
    assert main(_retention(traces, out, "--limit", "1")) == 0  # t0 complete
    capsys.readouterr()
    assert main(_retention(traces, out)) == 0  # t0 done, t1 to run
    err = capsys.readouterr().err
    assert re.findall(r"^\[(\d+)/(\d+)\]", err, re.M) == [("3", "4"), ("4", "4")]
    # non-TTY progress lines (one per record with EPIKV_PROGRESS_SECONDS=0), counting the 2 resumed records
    assert re.findall(r"^retention: (\d+)/4 records", err, re.M) == ["3", "4", "4"]


def test_retention_counter_after_a_resume_inside_a_trace(traces, tmp_path, capsys, monkeypatch):
    """A trace with some of its records done (a run killed between two policies) is not counted twice."""
    monkeypatch.setenv("EPIKV_PROGRESS_SECONDS", "0")
    out = tmp_path / "r"
    assert main(_retention(traces, out, "--limit", "1", "--policies", "full")) == 0  # t0: full done, epikv not
    capsys.readouterr()
    assert main(_retention(traces, out)) == 0
    err = capsys.readouterr().err
    assert re.findall(r"^\[(\d+)/(\d+)\]", err, re.M) == [("2", "4"), ("3", "4"), ("4", "4")]


def test_retention_help_names_its_tau_default(capsys):
    with pytest.raises(SystemExit):
        main(["retention", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    tau_help = help_text.rsplit("--tau TAU", 1)[1].split(" --", 1)[0]  # the --tau option's own text
    assert "(default 16)" in tau_help and not re.search(r"default 1\b", tau_help)


def test_retention_leaves_records_claimed_by_a_live_process(traces, tmp_path, capsys):
    """A trace another live process is working on is left to it (no second reference pass, no duplicate)."""
    out = tmp_path / "r"
    out.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pol, k in (("full", None), ("epikv", 64)):
            _claim_file(out, ["t1", pol, k, "{}"], live.pid, start=_proc_start(live.pid))
        assert main(_retention(traces, out)) == 0
        assert "2 being computed by another process" in capsys.readouterr().out
        assert {r["trace_id"] for r in read_records(out / "results.jsonl")} == {"t0"}
    finally:
        live.kill()
        live.wait()
    assert main(_retention(traces, out)) == 0  # its owner is gone: the claims are taken over
    keys = [(r["trace_id"], r["policy"], r["budget"]) for r in read_records(out / "results.jsonl")]
    assert len(keys) == len(set(keys)) == 4


def test_retention_memory_is_per_run(tiny):
    from epikv.retention.runner import policy_pass, prepare_traces, reference_pass

    item = prepare_traces([GOOD], tiny.tokenizer)[0][0]
    ref = reference_pass(tiny.model, item, 8)
    big = policy_pass(tiny.model, item, ref, "epikv", 128, 8)
    small = policy_pass(tiny.model, item, ref, "epikv", 64, 8)  # after the larger run, on a smaller cache
    assert 0 < small["peak_kv_mib"] < big["peak_kv_mib"] < ref.peak_kv_mib
    assert small["peak_mem_kind"] == "process_rss_sampled" and small["peak_mem_mib"] > 0


# -- bench and anatomy -------------------------------------------------------------------------------------------------
def test_bench_long_runs_report_their_own_kv_peak(tiny):
    from epikv.bench.speed import long_generation

    full = long_generation(tiny.model, "full", 48, [96], tau=1, prompt_tokens=16)[-1]
    epikv = long_generation(tiny.model, "epikv", 48, [96], tau=1, prompt_tokens=16)[-1]
    assert epikv["kv_cache_peak_mib"] < full["kv_cache_peak_mib"]  # the later, smaller run reports less
    # 16 + 96 tokens x (keys + values) x 4 layers x 2 KV heads x head dim 16 x 4 bytes
    assert full["kv_cache_peak_mib"] == pytest.approx(112 * 2 * 4 * 2 * 16 * 4 / 2**20)


def test_anatomy_label_progress_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EPIKV_PROGRESS_SECONDS", "0")
    words = " ".join(f"step{j} adds {j} more" for j in range(12))
    row = {"id": "t0", "prompt": "Problem: compute.\nSolution: \n<think>\n",
           "trace": f"<think>\n{words}\n</think>\n\nSo the answer is \\boxed{{1}}."}
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(row) + "\n")
    argv = ["anatomy", "label", "--traces", str(path), "--model", "random:tiny", "--window", "8", "--stride", "8",
            "--answer-tokens", "8", "--max-reasoning-tokens", "24", "--out", str(tmp_path / "lab")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert re.findall(r"^anatomy label: (\d+)/3 windows", err, re.M)[-1] == "3"
    assert len(read_records(tmp_path / "lab" / "labels.jsonl")) == 1
