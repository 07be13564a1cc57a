"""Where local data lives: $EPIKV_DATA_DIR, else the copy shipped inside the package (`epikv/datasets/`: MATH-500,
AIME 2024/2025, GSM8K test and the 28 reasoning traces as JSONL; sources and licences in its SOURCES.md), so a
named dataset or trace set works from any directory after install."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import EpiKVError

SHIPPED = Path(__file__).resolve().parent / "datasets"  # package data (pyproject's package-data), never cwd-relative

# named trace sets (`--traces NAME`): the file each reads in the data folder
TRACES = {"shared-28": "reasoning_traces.jsonl"}


def data_dir() -> Path:
    """$EPIKV_DATA_DIR when set (an override: the same file names), else the shipped copy."""
    env = os.environ.get("EPIKV_DATA_DIR")
    return Path(env) if env else SHIPPED


def traces_path(spec: str | None) -> Path:
    """A `--traces` value: a name in TRACES (None: the default, shared-28) read from data_dir(), else a file path."""
    if spec is None or spec in TRACES:
        return data_dir() / TRACES[spec or "shared-28"]
    path = Path(spec)
    if not path.exists() and "/" not in spec and not spec.endswith(".jsonl"):
        raise EpiKVError(f"unknown trace set {spec!r}; known: {', '.join(TRACES)}, or a path to a .jsonl file")
    return path


def read_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    """Read a JSONL file; a malformed line or a missing field is an EpiKVError naming the line number."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise EpiKVError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EpiKVError(f"cannot read {path}: {e}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise EpiKVError(f"{path}:{i}: malformed JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise EpiKVError(f"{path}:{i}: expected a JSON object")
        missing = [k for k in required if k not in row]
        if missing:
            raise EpiKVError(f"{path}:{i}: missing field(s) {', '.join(missing)}")
        rows.append(row)
    return rows
