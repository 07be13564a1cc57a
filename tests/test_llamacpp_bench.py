"""`epikv bench speed --engine llama.cpp`: the torch engine's rounds, ratios and long checkpoints through llama.cpp,
the same JSON with the engine named and each row's context cells and KV bytes; torch-only options and policies
llama.cpp cannot run refused in one line (exit 2); `bench throughput` refuses the single-sequence engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--threads", "1", "--budgets", "128", "--taus", "16", "--gen-tokens", "32", "--prompt-tokens", "32"]


def _cli(*argv):
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "epikv.cli", *argv], capture_output=True, text=True, env=e,
                          timeout=300)


def test_bench_speed_on_llama_cpp_json(tmp_path):
    out = tmp_path / "speed.json"
    p = _cli("bench", "speed", "--engine", "llama.cpp", *SMALL, "--policies", "full,epikv", "--long-lengths",
             "64,320", "--long-budget", "96", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "long epikv: 320 tokens" in p.stderr and "nan" not in p.stderr  # no peak memory in this process's runs
    r = json.loads(out.read_text())
    assert r["kind"] == "speed" and r["engine"] == "llama.cpp" and r["threads"] == 1 and "CPU" in r["system_info"]
    (block,) = r["budgets"]
    rows = {c["label"]: c for c in block["configs"]}
    assert set(rows) == {"full", "epikv@tau=16"}
    epi, full = rows["epikv@tau=16"], rows["full"]
    assert epi["evictions"] > 0 and full["evictions"] == 0
    assert max(epi["cache_length_after_round"]) <= 128 + 15 < max(full["cache_length_after_round"]) + 16
    assert block["ratios"]["speedup_vs_full"]["epikv@tau=16"] == pytest.approx(
        full["ms_per_token"] / epi["ms_per_token"])
    assert epi["kv_bytes"] == epi["kv_cells"] * 30 * 2 * 3 * 64 * 2  # F16 K and V of 30 layers, 3 KV heads of 64
    long = {(q["policy"], q["generated"]): q for q in r["long"]}
    assert set(long) == {("full", 64), ("full", 320), ("epikv", 64), ("epikv", 320)}
    # full's context holds every token (32 + 320 -> 512 cells), epikv's about K (256 cells): the KV bytes follow
    assert long["full", 320]["kv_cells"] == 512 and long["epikv", 320]["kv_cells"] == 256
    assert long["epikv", 320]["kv_buffer_mib"] == long["full", 320]["kv_buffer_mib"] / 2
    assert long["epikv", 320]["cache_length"] <= 96 + 15 and long["full", 320]["cache_length"] == 32 + 320
    assert (tmp_path / "speed.png").exists() and (tmp_path / "speed.json.jsonl").exists()


@pytest.mark.parametrize("argv, needle", [
    (["bench", "speed", "--engine", "llama.cpp", "--policies", "full,h2o"],
     "policy h2o is not supported by --engine llama.cpp: it reads attention weights"),
    (["bench", "speed", "--engine", "llama.cpp", "--policies", "epikv", "--long-policies", "full,snapkv"],
     "policy snapkv is not supported by --engine llama.cpp"),
    (["bench", "speed", "--engine", "llama.cpp", "--dtype", "float16"], "--dtype: torch engine options"),
    (["bench", "speed", "--engine", "llama.cpp", "--no-transformers"], "--no-transformers: torch engine options"),
    (["bench", "speed", "--engine", "llama.cpp", "--cap-gib", "2"], "--cap-gib: torch engine options"),
    (["bench", "throughput", "--engine", "llama.cpp", "--cap-mib", "64"],
     "the llama.cpp engine decodes one sequence, so there is no batch"),
])
def test_bench_refusals_exit_2_in_one_line(tmp_path, argv, needle):
    p = _cli(*argv, "--out", str(tmp_path / "x.json"))
    assert p.returncode == 2, p.stderr
    assert p.stdout == "" and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr
    assert not list(tmp_path.iterdir())
