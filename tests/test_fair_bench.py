"""benchmarks/serve_vs_llama_server.py's arithmetic and order (the servers themselves run only in the benchmark):
per-quarter rates from the client's per-second counts, ratios paired by repeat against llama-server, rows alternating
between the two servers with the order reversed on odd repeats, and its refusals in one line with exit 2."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "serve_vs_llama_server.py"


@pytest.fixture(scope="module")
def fair():
    spec = importlib.util.spec_from_file_location("serve_vs_llama_server", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quarters_are_the_rate_over_each_quarter_of_the_tokens(fair):
    assert fair.quarters([10] * 40) == [10.0] * 4
    # 120 tokens: the first 30 take 3.5 s (two idle seconds, then 20/s), the next 30 take 1.5 s ...
    assert fair.quarters([0, 0, 20, 20, 20, 20, 10, 10, 10, 10]) == [8.57, 20.0, 15.0, 10.0]
    assert fair.quarters([]) == []


def _row(name, rep, rate, q1, server="epikv", flash="off", schema=None):
    return {**({"schema": schema} if schema else {}), "tokens": 1024, "row": name, "repeat": rep, "label": name,
            "server": server, "tokens_per_s": rate,
            "quarters": [q1, rate, rate, rate], "ttft_p50_s": 1.0, "peak_rss_mib": 500.0, "kv_mib": 10.0,
            "cells_per_sequence": 512, "load_before": [0.5, 0.5, 0.5], "cpu": {"model": "CPU X", "cores": 2},
            "llama_server_version": "v", "epikv_commit": "abc", "flash_attn": flash, "kv_type": "f16", "threads": 2,
            "sequences": 8, "generated_tokens": 8192}


def test_the_summary_pairs_each_repeat_with_llama_servers_own(fair, tmp_path, capsys):
    rows = [_row("llama-server", 0, 100.0, 50.0, "llama-server"), _row("llama-server", 1, 50.0, 25.0, "llama-server"),
            _row("full", 0, 100.0, 50.0), _row("full", 1, 50.0, 25.0)]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    fair.summary(type("A", (), {"out": str(tmp_path)}))
    table = (tmp_path / "summary.md").read_text()
    full = next(line for line in table.splitlines() if line.startswith("| full "))
    # paired by repeat: 1.00 both times (an unpaired ratio of medians, 75 / 75, would hide a swap of repeats)
    assert "| 75.0 (50.0-100.0) | 1.00 (1.00-1.00) |" in full and "CPU X" in table
    assert full.split(" | ")[9] == "1.00"


def test_rows_alternate_servers_and_reverse_on_odd_repeats(fair, tmp_path, monkeypatch):
    """Within a repeat: llama-server, epikv, llama-server, ... for each flash attention setting in turn; odd repeats
    run the whole order backwards; each row's flash attention reaches its server's argv (-fa / --flash-attn) and its
    row in results.jsonl; a rerun skips what is done."""
    ran, flags = [], []

    def fake_run_row(spec, tokens, logdir, tag):
        ran.append(tag)
        argv = spec["argv"]
        flags.append(argv[argv.index("-fa" if spec["server"] == "llama-server" else "--flash-attn") + 1])
        return {**_row(spec["label"], 0, 10.0, 10.0, spec["server"]), "peak_rss_mib": 1.0}

    ls = tmp_path / "llama-server"
    ls.write_text("#!/bin/sh\necho version: 1 >&2\n")
    ls.chmod(0o755)
    monkeypatch.setattr(fair, "run_row", fake_run_row)
    monkeypatch.setattr(fair, "gguf", lambda: "model.gguf")
    args = type("A", (), dict(tokens=64, repeats=2, rows="llama-server,full,epikv-seg-q:256", shift_cells=None,
                              tau=128, flash_attn="off,auto", cache_type="f16", llama_server=str(ls), out=str(tmp_path / "out")))
    fair.run(args)
    r0 = ["64-llama-server-fa-off-r0", "64-full-fa-off-r0", "64-epikv-seg-q-256-fa-off-r0",
          "64-llama-server-fa-auto-r0", "64-full-fa-auto-r0", "64-epikv-seg-q-256-fa-auto-r0"]
    assert ran == r0 + [t.replace("-r0", "-r1") for t in reversed(r0)]
    assert flags == [t.split("-fa-")[1][:-3] for t in ran]  # off x 3, auto x 3, then backwards
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [(r["row"], r["flash_attn"], r["repeat"]) for r in rows][:4] == [
        ("llama-server", "off", 0), ("full", "off", 0), ("epikv-seg-q:256", "off", 0), ("llama-server", "auto", 0)]
    assert {r["schema"] for r in rows} == {fair.SCHEMA}
    ran.clear()
    fair.run(args)  # resumable: everything done is skipped
    assert ran == []


@pytest.mark.parametrize("argv, needle", [
    (["run", "--tokens", "0", "--out", "x"], "--tokens and --repeats must be positive"),
    (["run", "--tokens", "8", "--rows", "seg-q", "--llama-server", "/bin/true", "--out", "OUT"], "give llama-server"),
    (["run", "--tokens", "8", "--llama-server", "/no/such", "--out", "x"], "no llama-server at /no/such"),
    (["summary", "--out", "/no/such"], "no results at"),
    (["run", "--tokens", "8", "--flash-attn", "off,fast", "--llama-server", "/bin/true", "--out", "OUT"],
     "--flash-attn 'off,fast': give one or more of off, on, auto"),
    (["run", "--tokens", "8", "--rows", "llama-server,llama-server-shift@epikv-seg-q:256", "--llama-server",
      "/bin/true", "--out", "OUT"], "add the row epikv-seg-q:256 it is paired with"),
    (["run", "--tokens", "8", "--rows", "llama-server-shift@epikv-seg-q", "--llama-server", "/bin/true", "--out",
      "OUT"], "give llama-server-shift@POLICY:K"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, tmp_path):
    argv = [str(tmp_path / "o") if a == "OUT" else a for a in argv]
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_llama_servers_cells_and_kv_bytes_come_from_its_log(fair):
    """The cells are the slots times n_ctx_slot of llama-server's log line; the bytes, the GGUF's F16 K and V per cell
    (SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) x 2 bytes = 23,040)."""
    line = "0.00.238 I srv    load_model: initializing, n_slots = 8, n_ctx_slot = 1280, kv_unified = 'false'\n"
    kv = fair.kv_of_llama_server("version: x\n" + line)
    assert kv == {"kv_mib": round(8 * 1280 * 23040 / 2**20, 1), "cells": 10240, "cells_per_sequence": 1280,
                  "kv_unified": "false"}
    assert fair.kv_of_llama_server("no such line")["cells"] is None


def test_goals_say_met_or_missed_from_the_paired_medians(fair):
    """Issue 50's goals: 8 x 1,024 `full` >= 0.97x; Seg-Q K = 512 at 8 x 4,096 >= 2.0x and <= a quarter of the KV."""
    rows = [_row("llama-server", 0, 100.0, 50.0, "llama-server"), _row("full", 0, 97.0, 40.0)]
    long = [{**_row("llama-server", 0, 50.0, 50.0, "llama-server"), "tokens": 4096, "kv_mib": 100.0},
            {**_row("epikv-seg-q:512", 0, 99.0, 60.0), "tokens": 4096, "kv_mib": 26.0}]
    lines = fair.goals(rows + long)
    assert lines[0] == "8 x 1,024, full: 0.97x llama-server's tokens/s over the run (goal >= 0.97: met)"
    assert lines[1].endswith("1.98x llama-server's tokens/s over the run (goal >= 2: missed)")
    assert lines[2].endswith("1.20x llama-server's in the first quarter (goal >= 1: met)")
    assert lines[3].endswith("0.26 of llama-server's KV bytes (cells + mirror) (goal <= 0.25: missed)")
    assert len(lines) == 4  # Seg-Q K = 256 at 8 x 1,024 was not measured: no line


def test_profile_shares_split_the_engine_threads_busy_samples(tmp_path):
    """benchmarks/profile_summary.py (rendered in docs/benchmarks.md): the engine thread's samples waiting for work
    (in `_commands`) are not busy; of the busy ones, those whose leaf is the `_decode` line seen most (the line that
    calls llama_decode) are inside it, and every other function on a busy stack counts outside it; other threads
    count for nothing."""
    spec = importlib.util.spec_from_file_location("profile_summary", ROOT / "benchmarks" / "profile_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    loop = "thread (1): epikv-llamacpp;Thread.run (threading.py:1);LlamaBackend._loop (epikv/serving/llamacpp.py:280)"
    step = loop + ";LlamaBackend._step (epikv/serving/llamacpp.py:470);LlamaBackend._decode (epikv/serving/llamacpp.py:"
    lines = [f"{step}492) 6",
             f"{step}516);SequenceCache.attend (epikv/llamacpp/sequence.py:140);_layers (epikv/llamacpp/sequence.py:51) 2",
             f"{step}513) 1",  # a line of _decode itself
             f"{loop};LlamaBackend._commands (epikv/serving/llamacpp.py:294);Condition.wait (threading.py:331) 5",
             "thread (2): MainThread;Runner.run (asyncio/runners.py:118) 40"]
    path = tmp_path / "samples.txt"
    path.write_text("\n".join(lines) + "\n")
    sh = mod.engine_shares(str(path))
    assert sh["busy"] == 9
    assert sh["llama_decode"] == pytest.approx(6 / 9)
    assert sh["outside"]["SequenceCache.attend (sequence.py)"] == pytest.approx(2 / 9)
    assert sh["outside"]["_layers (sequence.py)"] == pytest.approx(2 / 9)
    assert sh["outside"]["LlamaBackend._decode (llamacpp.py), its own lines"] == pytest.approx(1 / 9)
    assert not any("Condition" in k or "Runner" in k for k in sh["outside"])
    path.write_text(lines[-1] + "\n")  # no engine thread: a clear error, not an IndexError
    with pytest.raises(ValueError, match="no busy sample of the engine thread"):
        mod.engine_shares(str(path))


def test_paired_ratios_and_their_95_percent_interval_by_hand(fair, tmp_path):
    """Each row over llama-server's row of the same repeat and the same flash attention, and over its equal-cells
    context-shift row; the interval is the t interval of the logs of the per-repeat ratios. By hand: llama-server runs
    100, 50, 80 tok/s and Seg-Q 100, 100, 320, so the ratios are 1, 2, 4, their log2 0, 1, 2 (mean 1, s 1), and the
    interval 2 ** (1 -+ t(0.975, 2) / sqrt(3)) = 2 ** (1 -+ 4.303 / 1.732) = 0.357 to 11.19 (median 2.00). Context
    shift runs 50, 100, 160: ratios 2, 1, 2, log2 1, 0, 1 (mean 2/3, s 1/sqrt(3)): 2 ** (2/3 -+ 4.303 / 3) = 0.587 to
    4.29. Flash attention auto pairs with llama-server's auto row only: 90 / 180 = 0.50, one repeat, no interval."""
    seg, shift = "epikv-seg-q:256", "llama-server-shift@epikv-seg-q:256"
    rows = [_row("llama-server", i, v, v, "llama-server", schema=2) for i, v in enumerate([100.0, 50.0, 80.0])]
    rows += [_row(seg, i, v, v, schema=2) for i, v in enumerate([100.0, 100.0, 320.0])]
    rows += [_row(shift, i, v, v, "llama-server", schema=2) for i, v in enumerate([50.0, 100.0, 160.0])]
    rows += [_row("llama-server", 0, 180.0, 180.0, "llama-server", "auto", 2),
             _row(seg, 0, 90.0, 90.0, flash="auto", schema=2)]
    m = fair.medians(rows)[1024]
    assert m[seg]["ratios"] == [1.0, 2.0, 4.0]
    assert m[seg]["ci"] == pytest.approx((0.357412, 11.191552), rel=1e-5)
    assert m[seg]["shift_ratios"] == [2.0, 1.0, 2.0]
    assert m[seg]["shift_ci"] == pytest.approx((0.587367, 4.290066), rel=1e-5)
    assert m[seg + "@fa-auto"]["ratios"] == [0.5] and m[seg + "@fa-auto"]["ci"] is None
    assert fair.interval95([1.5]) is None
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    fair.summary(type("A", (), {"out": str(tmp_path)}))
    cells = [next(x for x in (tmp_path / "summary.md").read_text().splitlines() if x.startswith(f"| {seg} | {fa} "))
             .split(" | ") for fa in ("off", "auto")]
    assert cells[0][1:6] == ["off", "3", "100.0 (100.0-320.0)", "2.00 [0.36-11.19]", "2.00 [0.59-4.29]"]
    assert cells[1][1:6] == ["auto", "1", "90.0", "0.50", "-"]


def test_both_servers_get_the_rows_flash_attention_and_context_shift_gets_the_epikv_rows_cells(fair, monkeypatch):
    """-fa (llama-server) and --flash-attn (epikv serve) carry the row's setting; `llama-server-shift@POLICY:K` runs
    llama-server --context-shift on 8 slots of exactly the cells epikv serve gives a stream of POLICY at K: Seg-Q
    (tau 128) at 256, 256 + 127 + a 256-token chunk = 639, rounded up to 768, as the committed fair run measured;
    streaming (tau 1) at 256: 512."""
    monkeypatch.setattr(fair, "gguf", lambda: "model.gguf")
    for fa in ("off", "on", "auto"):
        for name in ("llama-server", "llama-server-shift@epikv-seg-q:256", "full", "epikv-seg-q:256"):
            spec = fair.row_spec(name, 1024, 768, fa, "/ls")
            flag = "-fa" if spec["server"] == "llama-server" else "--flash-attn"
            assert spec["argv"][spec["argv"].index(flag) + 1] == fa, (name, fa)
    spec = fair.row_spec("llama-server-shift@epikv-seg-q:256", 1024, 999, "auto", "/ls")
    assert "--context-shift" in spec["argv"] and spec["argv"][spec["argv"].index("-c") + 1] == str(8 * 768)
    assert spec["cells_per_sequence"] == 768 and spec["equal_cells_to"] == "epikv-seg-q:256"
    assert fair.row_spec("llama-server-shift@streaming:256", 1024, 999, "off", "/ls")["cells_per_sequence"] == 512


def test_render_shows_the_interval_for_new_rows_and_older_files_as_before(tmp_path, monkeypatch):
    """benchmarks/render.py renders the fair script's tables from a raw file: a schema-2 file's paired ratios with
    their 95 % interval (in the table and the README's line), a committed older file without one."""
    spec = importlib.util.spec_from_file_location("epikv_render_fair", ROOT / "benchmarks" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    old = render._fair_block(render.FAIR, "cmd")
    assert "[" not in old.split("Issue 50")[0] and "x llama-server (paired)" in old
    seg = "epikv-seg-q:256"
    rows = [_row("llama-server", i, v, v, "llama-server", schema=2) for i, v in enumerate([100.0, 50.0, 80.0])]
    rows += [_row(seg, i, v, v, schema=2) for i, v in enumerate([100.0, 100.0, 320.0])]
    (tmp_path / "new.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    monkeypatch.setattr(render, "source_line", lambda files, command: "")  # (it asks git for the file's date)
    assert "| 2.00 [0.36-11.19] |" in render._fair_block("new.jsonl", "cmd")
    assert f"{seg} 2.00x [95 %: 0.36-11.19]" in render._fair_headline(rows)[1]


def test_epikv_rows_kv_is_the_cells_and_every_buffer_the_server_measured(fair):
    """An epikv row's KV bytes are its server's cells plus the most its sequences' buffers held at once, as /stats
    reports them (kv_bytes_with_buffers_peak: the mirror, the rows waiting for their statistic, the queries, the
    scores, the state), not the mirror alone; a /stats without them is refused. Mutant: kv_mib from the cells and
    the mirror (the old count)."""
    mib = 2**20
    peak = {"mirror": 1 * mib, "waiting_hidden": 0, "waiting_kv": 3 * mib, "queries": mib // 4, "token_data": mib // 4,
            "policy_state": 0, "total": 4 * mib + mib // 2}
    eng = {"kv_bytes": 10 * mib, "buffer_peak_bytes": peak, "kv_bytes_with_buffers_peak": 10 * mib + peak["total"]}
    kv = fair.epikv_kv(eng)
    assert (kv["kv_mib"], kv["kv_cells_mib"], kv["kv_buffers_peak_mib"], kv["kv_mirror_peak_mib"]) == \
        (14.5, 10.0, 4.5, 1.0)
    assert kv["kv_counts"] == "cells+buffers" and kv["kv_buffer_peak_bytes"] == peak
    with pytest.raises(RuntimeError, match="buffer_peak_bytes"):
        fair.epikv_kv({"kv_bytes": 10 * mib, "kv_mirror_bytes": mib})


def test_tables_and_goals_say_what_the_kv_bytes_count(fair):
    """Rows of this version (kv_counts "cells+buffers") head their KV column "cells + every buffer" and their KV goal
    says so; an older file's rows (no kv_counts: the mirror alone) keep "cells + mirror"; a file with both stars the
    new rows. Mutant: kv_head without the rows' kv_counts (always "cells + mirror")."""
    long = [{**_row("llama-server", 0, 50.0, 50.0, "llama-server"), "tokens": 4096, "kv_mib": 100.0},
            {**_row("epikv-seg-q:512", 0, 99.0, 60.0), "tokens": 4096, "kv_mib": 26.0}]
    new = [dict(r, kv_counts="cells+buffers") if r["server"] == "epikv" else r for r in long]
    assert "KV MiB (cells + every buffer)" in fair.tables(new) and "cells + mirror" not in fair.tables(new)
    assert fair.goals(new)[-1].endswith("0.26 of llama-server's KV bytes (cells + every buffer) (goal <= 0.25: missed)")
    assert "KV MiB (cells + mirror)" in fair.tables(long) and "every buffer" not in fair.tables(long)
    both = long + [{**new[1], "row": "epikv-seg-q:256", "label": "seg256", "kv_mib": 20.0}]
    table = fair.tables(both)
    assert "KV MiB (cells + mirror; * cells + every buffer)" in table
    assert "| 20.0* |" in next(x for x in table.splitlines() if x.startswith("| seg256 "))
    assert "| 26.0 |" in next(x for x in table.splitlines() if x.startswith("| epikv-seg-q:512 "))
