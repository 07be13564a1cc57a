"""The benchmark data ships inside the package (epikv/datasets/, package data): the named datasets and trace set
load from it by default, $EPIKV_DATA_DIR overrides it, SOURCES.md describes every shipped file, and an installed
wheel finds its data from a directory with no ../shared next to it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from epikv.data import SHIPPED, TRACES, traces_path
from epikv.errors import EpiKVError
from epikv.eval.datasets import DATASETS, load_dataset
from epikv.retention.runner import load_traces

ROOT = Path(__file__).resolve().parents[1]
# rows per file as SOURCES.md's table gives them (written by whoever assembled the data, not by the loaders)
ROWS = {"math500.jsonl": 500, "aime2024.jsonl": 30, "aime2025.jsonl": 30, "gsm8k_test.jsonl": 1319,
        "reasoning_traces.jsonl": 28}


def _raw(name: str) -> list[dict]:
    with open(SHIPPED / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_named_dataset_reads_the_shipped_file(name, monkeypatch):
    """Mutant: data_dir() back at ../shared/data, or load_dataset reading the hub by default, fails here."""
    monkeypatch.delenv("EPIKV_DATA_DIR", raising=False)
    file = DATASETS[name].file
    ds = load_dataset(name)
    assert Path(ds.source) == SHIPPED / file
    raw = _raw(file)
    assert len(raw) == ROWS[file]
    assert ds.rows == [{"id": str(r["id"]), "problem": r["problem"], "answer": str(r.get("answer_norm", r["answer"]))}
                       for r in raw]


def test_shared_28_reads_the_shipped_traces(monkeypatch):
    monkeypatch.delenv("EPIKV_DATA_DIR", raising=False)
    assert traces_path("shared-28") == traces_path(None) == SHIPPED / "reasoning_traces.jsonl"
    assert load_traces("shared-28") == _raw("reasoning_traces.jsonl")
    assert len(load_traces("shared-28")) == 28
    with pytest.raises(EpiKVError, match="unknown trace set 'shared28'.*shared-28"):
        traces_path("shared28")


def test_data_dir_overrides_the_shipped_copy(tmp_path, monkeypatch):
    """$EPIKV_DATA_DIR (the same file names) wins over the shipped copy; --data-dir wins over both."""
    (tmp_path / "env").mkdir()
    (tmp_path / "arg").mkdir()
    (tmp_path / "env" / "math500.jsonl").write_text(json.dumps({"id": "e", "problem": "1+1?", "answer": "2"}) + "\n")
    (tmp_path / "arg" / "math500.jsonl").write_text(json.dumps({"id": "a", "problem": "2+2?", "answer": "4"}) + "\n")
    (tmp_path / "env" / "reasoning_traces.jsonl").write_text(json.dumps({"id": "t"}) + "\n")
    monkeypatch.setenv("EPIKV_DATA_DIR", str(tmp_path / "env"))
    assert [r["id"] for r in load_dataset("math500").rows] == ["e"]
    assert [r["id"] for r in load_dataset("math500", data_dir=str(tmp_path / "arg")).rows] == ["a"]
    assert [r["id"] for r in load_traces("shared-28")] == ["t"]


def test_sources_describe_every_shipped_file():
    """SOURCES.md ships beside the data and its table names each file with its row count and an MIT licence.
    Mutant: a row dropped from a shipped file (or a file added without its line in SOURCES.md) fails here."""
    table, repos = {}, set()
    for line in (SHIPPED / "SOURCES.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].endswith(".jsonl"):
            table[cells[0]] = (int(cells[1]), cells[4])
            repos.add(cells[2].split(" @ ")[0])
    shipped = sorted(p.name for p in SHIPPED.glob("*.jsonl"))
    assert sorted(table) == shipped == sorted(ROWS)
    for name, (rows, licence) in table.items():
        assert len(_raw(name)) == rows == ROWS[name], name
        assert "MIT" in licence, name
    assert {i.file for i in DATASETS.values()} | set(TRACES.values()) == set(shipped)
    # MIT asks for its notice with every copy: each source repository's notice is in LICENSES.md
    notices = (SHIPPED / "LICENSES.md").read_text(encoding="utf-8").split("\n## ")[1:]
    assert repos and {n.split(": ", 1)[1].split(" (")[0] for n in notices} == repos
    assert all("Permission is hereby granted" in n and "Copyright (c)" in n for n in notices)


def test_installed_wheel_finds_its_data_without_shared(tmp_path):
    """A non-editable wheel built from pyproject carries the data and SOURCES.md, and run from a directory with no
    ../shared (EPIKV_DATA_DIR unset) it loads every named set and shared-28 from inside the installed package.
    Mutants: the datasets/ globs dropped from package-data, or data_dir() back at ../shared/data, fail here."""
    proj = tmp_path / "proj"
    proj.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, proj / f)
    shutil.copytree(ROOT / "src", proj / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    env = {k: v for k, v in os.environ.items() if k not in ("EPIKV_DATA_DIR", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                        "-w", str(tmp_path / "dist"), str(proj)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("epikv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"epikv/datasets/{n}" for n in [*ROWS, "SOURCES.md", "LICENSES.md"]} <= set(names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    cwd = tmp_path / "elsewhere" / "run"
    cwd.mkdir(parents=True)
    code = ("import json, epikv; from epikv.eval.datasets import DATASETS, load_dataset; "
            "from epikv.retention.runner import load_traces; "
            "print(json.dumps({'at': epikv.__file__, 'traces': len(load_traces('shared-28')), "
            "**{n: [len(d.rows), d.source] for n in DATASETS for d in [load_dataset(n)]}}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got.pop("at")).is_relative_to(site)
    assert got.pop("traces") == 28
    for name, (n, source) in got.items():
        assert n == ROWS[DATASETS[name].file] and Path(source).is_relative_to(site / "epikv" / "datasets"), name


@pytest.mark.parametrize("argv", [["retention", "--traces", "shared28"],
                                  ["anatomy", "label", "--traces", "shared28"]])
def test_an_unknown_trace_set_is_one_line_and_exit_2(argv, tmp_path, capsys):
    """Before any model loads: the name is refused in one line naming the known sets."""
    from epikv.cli import main

    code = main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "unknown trace set 'shared28'" in err[0] and "shared-28" in err[0], err
    assert not (tmp_path / "out").exists()


def test_hf_prefix_reads_the_hub(monkeypatch):
    """`hf:NAME` goes to the hub loader under NAME's settings; a bare name never does."""
    import epikv.eval.datasets as dsm

    calls = []
    row = {"id": "h", "problem": "p", "answer": "7"}
    monkeypatch.setattr(dsm, "_hub", lambda name, info: calls.append(name) or [row])
    ds = load_dataset("hf:aime2024")
    assert (ds.name, ds.source, ds.integer, calls) == ("aime2024", "hf:Maxwell-Jia/AIME_2024", True, ["aime2024"])
    assert load_dataset("aime2024").source == str(SHIPPED / "aime2024.jsonl") and calls == ["aime2024"]
