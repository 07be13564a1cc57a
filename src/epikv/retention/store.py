"""Retention results: `results.jsonl` through the shared JSONL store (`epikv.store`).

`read_records` never modifies the file (a torn last line is ignored); `append_record` repairs a torn tail and appends
one flushed, fsynced line. `run_retention` itself appends through `epikv.store.Store`, under the folder's lock and
with per-record claims, so several processes may fill one folder."""

from __future__ import annotations

from ..store import append_record, read_records

__all__ = ["append_record", "read_records"]
