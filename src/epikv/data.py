"""Where local data lives: $EPIKV_DATA_DIR, else ../shared/data next to the repository (tests and offline runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import EpiKVError

_REPO = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    env = os.environ.get("EPIKV_DATA_DIR")
    return Path(env) if env else _REPO.parent / "shared" / "data"


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
