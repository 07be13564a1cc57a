"""Append-only JSONL results: one flushed line per record, resumable, tolerant of a run killed mid-write."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import EpiKVError


def read_records(path: str | Path) -> list[dict]:
    """Every complete record; a torn last line (a killed write) is dropped from the file so appends stay valid."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    records, good_end = [], 0
    pos = 0
    for line in raw.splitlines(keepends=True):
        pos += len(line)
        text = line.decode("utf-8", errors="replace").strip()
        if not text:
            good_end = pos
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            if pos == len(raw) and not line.endswith(b"\n"):  # torn tail: drop it
                break
            raise EpiKVError(f"{path}: malformed record at byte {pos - len(line)}; fix or move the file") from None
        if line.endswith(b"\n"):
            records.append(rec)
            good_end = pos
        else:  # complete JSON but no newline: keep it, and add the newline
            records.append(rec)
            good_end = pos
            with path.open("ab") as f:
                f.write(b"\n")
            return records
    if good_end < len(raw):
        with path.open("r+b") as f:
            f.truncate(good_end)
    return records


def append_record(path: str | Path, record: dict) -> None:
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
