"""The output directory: config.json (what the run is) and append-only JSONL records, one line per generation.

A record is written with one O_APPEND write and flushed, so a killed run loses at most the generations in flight;
a torn last line (killed mid-write) is cut off before the next append. Shards write records-<i>of<n>.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import EpiKVError

CONFIG = "config.json"

# Fields of a record that depend on the machine and the moment rather than on the model's output.
VOLATILE = ("wall_seconds", "seconds_per_1k_tokens", "peak_memory_bytes", "peak_memory_kind", "executor", "worker",
            "finished_at")


def cell_key(rec: dict) -> tuple:
    return (rec["id"], rec["policy"], rec["budget"], rec["sample"])


def ensure_config(out: Path, config: dict) -> None:
    """Write config.json, or check that the directory holds the same configuration (refuse to mix)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONFIG
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EpiKVError(f"{path} is unreadable ({e}); use another --out") from None
        diff = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
        if diff:
            k = diff[0]
            raise EpiKVError(f"{out} holds another configuration ({', '.join(diff)} differ, e.g. {k}: "
                             f"{old.get(k)!r} there vs {config.get(k)!r} now); use another --out")
        return
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # shards may start at the same moment
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_config(out: Path) -> dict:
    path = Path(out) / CONFIG
    if not path.exists():
        raise EpiKVError(f"{out} is not an evaluation directory (no {CONFIG})")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EpiKVError(f"{path} is unreadable ({e})") from None


def record_files(out: Path) -> list[Path]:
    return sorted(Path(out).glob("records*.jsonl"))


def read_records(out: Path) -> list[dict]:
    """All complete records of a directory (every shard); a torn last line is ignored."""
    recs = []
    for f in record_files(out):
        lines = f.read_text(encoding="utf-8").split("\n")
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines):  # torn final line of a killed run
                    continue
                raise EpiKVError(f"{f}:{i}: malformed record") from None
    return recs


def done_cells(out: Path) -> set[tuple]:
    return {cell_key(r) for r in read_records(out)}


class RecordWriter:
    """Appends records to one file; each record reaches the OS before `write` returns."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._repair()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _repair(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        data = self.path.read_bytes()
        if not data.endswith(b"\n"):  # a write cut short by a kill
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def write(self, rec: dict) -> None:
        line = (json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
        view = memoryview(line)
        while view:  # os.write may write less than asked for a very long line
            view = view[os.write(self.fd, view):]

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
