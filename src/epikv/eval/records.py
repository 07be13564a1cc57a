"""The output directory: config.json (what the run is) and append-only JSONL records, one line per generation.

Records go through `epikv.store` (one write + fsync per record; readers never modify a file and ignore a torn last
line; a writer repairs it under the folder's lock before appending; per-cell claims keep concurrent processes on one
folder from running a cell twice). Shards write records-<i>of<n>.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from ..errors import EpiKVError
from ..store import Store, folder_lock, read_records as _read_file

CONFIG = "config.json"
PATTERN = "records*.jsonl"

# Fields of a record that depend on the machine and the moment rather than on the model's output.
VOLATILE = ("wall_seconds", "seconds_per_1k_tokens", "peak_memory_bytes", "peak_memory_kind", "kv_cache_peak_bytes",
            "executor", "worker", "finished_at")


def cell_key(rec: dict) -> tuple:
    return (rec["id"], rec["policy"], rec["budget"], rec["sample"])


def _first_diff(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def ensure_config(out: Path, config: dict, normalise: Callable[[dict], dict] | None = None) -> dict:
    """Write config.json, or check that the directory holds the same configuration (refuse to mix); returns the
    configuration the directory holds. `normalise` maps a configuration to a canonical form before comparing (the
    same run written differently, e.g. a default given explicitly, is the same configuration)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONFIG
    with folder_lock(out):  # two processes starting together agree on one configuration
        if path.exists():
            old = read_config(out)
            a, b = (normalise(old), normalise(config)) if normalise else (old, config)
            diff = _first_diff(a, b)
            if diff:
                k = diff[0]
                raise EpiKVError(f"{out} holds another configuration ({', '.join(diff)} differ, e.g. {k}: "
                                 f"{a.get(k)!r} there vs {b.get(k)!r} now); use another --out")
            return old
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return config


def read_config(out: Path) -> dict:
    path = Path(out) / CONFIG
    if not path.exists():
        raise EpiKVError(f"{out} is not an evaluation directory (no {CONFIG})")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EpiKVError(f"{path} is unreadable ({e}); use another --out") from None


def record_files(out: Path) -> list[Path]:
    return sorted(Path(out).glob(PATTERN))


def read_records(out: Path) -> list[dict]:
    """All complete records of a directory (every shard); a torn last line is ignored. Never writes."""
    return [r for f in record_files(out) for r in _read_file(f)]


def done_cells(out: Path) -> set[tuple]:
    return {cell_key(r) for r in read_records(out)}


def open_store(out: Path, filename: str = "records.jsonl") -> Store:
    """The directory's store, appending to `filename`; cells are (id, policy, budget, sample)."""
    return Store(out, filename, cell_key, PATTERN)


class RecordWriter:
    """Appends records to one file of a directory through its store (no claims): each record is on disk before
    `write` returns."""

    def __init__(self, path: Path):
        path = Path(path)
        self.store = open_store(path.parent, path.name)
        self.path = path

    def write(self, rec: dict) -> None:
        self.store.append([rec])

    def close(self) -> None:
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
