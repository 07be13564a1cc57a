"""Append-only JSONL results shared by `eval`, `retention`, `anatomy label` and `bench`: one JSON object per line.

Rules, the same for every command:
- a writer appends a record with one write of `json + "\\n"`, then flushes and fsyncs it: a killed run loses only
  what was in flight;
- readers never modify a file: a torn last line (a write cut by a kill, or still being written) is ignored; a last
  line that is complete JSON without its newline counts as a record;
- a torn line is repaired (cut back to the last newline, or given its missing newline) only by a writer holding the
  folder's lock, right before it appends: every append happens under that lock, so a torn line seen by the lock
  holder belongs to a dead writer;
- several processes may work on one folder: `Store.claim` takes cells under the lock (not finished, not claimed by a
  live process) by creating a claim file with O_CREAT | O_EXCL holding pid, host and process start time; a claim of
  a dead process on the same host is taken over; claims are removed when their records are written or the writer
  exits. Claims of other hosts are honoured (their owners cannot be checked from here).

The lock is `fcntl.flock` on `FOLDER/.epikv.lock` (claims live in `FOLDER/.epikv-claims/`). Without fcntl (Windows)
claim files alone keep concurrent writers apart, with a small race between reading the finished set and claiming.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Hashable, Iterable

from .errors import EpiKVError

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK = ".epikv.lock"
CLAIMS = ".epikv-claims"

# claim files held by live Store objects of this process (a same-pid claim outside it is left over, hence stale)
_HELD: set[str] = set()
_HELD_MUTEX = threading.Lock()


# -- reading (never modifies anything) ----------------------------------------------------------------------------------
def _parse(raw: bytes, where: str, final: bool, strict: bool = True) -> tuple[list[dict], int]:
    """Records of the complete lines of `raw`, and how many bytes they span (up to the last newline). With `final`,
    an unterminated last line that parses is a record too (a torn one is ignored). A malformed complete line is an
    error, or skipped when not `strict`."""
    records = []
    end = raw.rfind(b"\n") + 1
    for i, line in enumerate(raw[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if not strict:
                continue
            raise EpiKVError(f"{where}: malformed record at line {i} (not the last line: not a torn write); "
                             "fix or move the file") from None
    if final and end < len(raw) and raw[end:].strip():
        try:
            records.append(json.loads(raw[end:]))
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # torn tail: ignored, left as it is
    return records, end


def read_records(path: str | Path, strict: bool = True) -> list[dict]:
    """Every complete record of one JSONL file ([] if it does not exist). Never writes. `strict=False` skips
    malformed lines anywhere (journals written before these rules may hold a torn line glued to the next)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    return _parse(raw, str(path), final=True, strict=strict)[0]


class Tail:
    """Incremental reader of an append-only file: `poll()` returns the records of lines completed since the last
    call (newline-terminated lines only)."""

    def __init__(self, path: str | Path):
        self.path, self.offset, self.lines = Path(path), 0, 0

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                raw = f.read()
        except FileNotFoundError:
            return []
        recs, end = _parse(raw, f"{self.path} (after byte {self.offset})", final=False)
        self.offset += end
        return recs


# -- writing -----------------------------------------------------------------------------------------------------------
def _repair(path: Path) -> None:
    """Make the file end at a record boundary (call only with the lock held, or as the only writer)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "r+b") as f:
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return
        # find the last newline without reading a large file whole
        pos, step, last_nl = size, 1 << 16, -1
        while pos > 0 and last_nl < 0:
            start = max(0, pos - step)
            f.seek(start)
            chunk = f.read(pos - start)
            k = chunk.rfind(b"\n")
            if k >= 0:
                last_nl = start + k
            pos = start
        f.seek(last_nl + 1)
        tail = f.read()
        try:
            json.loads(tail)
            f.seek(size)
            f.write(b"\n")  # a complete record that only lost its newline
        except (json.JSONDecodeError, UnicodeDecodeError):
            f.truncate(last_nl + 1)  # a torn record: cut it off
        f.flush()
        os.fsync(f.fileno())


def _write_line(fd: int, rec: dict) -> None:
    line = (json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
    view = memoryview(line)
    while view:  # os.write may write less than asked for a very long line
        view = view[os.write(fd, view):]


def append_records(path: str | Path, records: Iterable[dict]) -> None:
    """Append records to a file that has one writer (a journal): repair a torn tail, then write + fsync each."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the file itself is the lock: two journal writers take turns
        _repair(path)
        for rec in records:
            _write_line(fd, rec)
            os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock


def append_record(path: str | Path, record: dict) -> None:
    append_records(path, [record])


@contextlib.contextmanager
def folder_lock(folder: str | Path):
    """Exclusive lock of a results folder (every append, claim and config write happens under it)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(folder) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- claims ------------------------------------------------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid from the claimant."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2:].split()[0] == "Z":  # killed, not yet reaped
            return False
    except (OSError, ValueError, IndexError):
        pass
    now = _start_time(pid)
    return start is None or now is None or now == start


def _claim_name(key) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24] + ".claim"


class Store:
    """A results folder: JSONL files named by `pattern`, this process appending to `filename`.

    `key(record)` names the cell a record belongs to (None: the record is not one of this store's cells). The
    finished set is read incrementally; `claim` / `append` keep concurrent writers from doing a cell twice."""

    def __init__(self, folder: str | Path, filename: str, key: Callable[[dict], Hashable | None],
                 pattern: str | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / filename
        self.pattern = pattern or filename
        self.key = key
        self.done: set = set()
        self._tails: dict[Path, Tail] = {}
        self.held: dict = {}  # key -> claim path
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._start = _start_time(self.pid)
        self._lock_fd: int | None = None
        self.claimed_elsewhere: dict = {}  # key -> "host pid N" of the last claim check
        self.refresh()

    # reading
    def files(self) -> list[Path]:
        return sorted(self.folder.glob(self.pattern))

    def refresh(self) -> set:
        """Add the cells of records written since the last call (by any process) to `done`."""
        for f in self.files():
            tail = self._tails.setdefault(f, Tail(f))
            for rec in tail.poll():
                k = self.key(rec)
                if k is not None:
                    self.done.add(k)
        return self.done

    def records(self) -> list[dict]:
        return [r for f in self.files() for r in read_records(f)]

    # locking
    def lock(self):
        return folder_lock(self.folder)

    def _repair_all(self) -> None:
        for f in self.files():
            _repair(f)

    # claims
    def claim(self, keys: Iterable) -> list:
        """The keys this process now holds: those neither finished nor claimed by a live process (stale claims of
        dead processes on this host are taken over). Keys it already holds are returned too."""
        keys = list(keys)
        got = []
        claims = self.folder / CLAIMS
        claims.mkdir(exist_ok=True)
        self.claimed_elsewhere = {}
        with self.lock():
            self._repair_all()  # under the lock: a torn line is a dead writer's
            self.refresh()
            for k in keys:
                if k in self.held:
                    got.append(k)
                    continue
                if k in self.done:
                    continue
                path = claims / _claim_name(k)
                if self._take(path, k):
                    self.held[k] = path
                    with _HELD_MUTEX:
                        _HELD.add(str(path))
                    got.append(k)
        return got

    def _take(self, path: Path, key) -> bool:
        body = json.dumps({"pid": self.pid, "host": self.host, "start": self._start, "key": key,
                           "time": round(time.time(), 3)}, default=str).encode()
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if not self._stale(path, key):
                    return False
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            return True
        return False

    def _stale(self, path: Path, key) -> bool:
        try:
            info = json.loads(path.read_text())
            pid, host = int(info["pid"]), str(info["host"])
        except (OSError, ValueError, KeyError, TypeError):
            # unreadable: a claimant killed between creating and writing it (it is written right after creation)
            try:
                return time.time() - path.stat().st_mtime > 60
            except FileNotFoundError:
                return True
        if host != self.host:
            self.claimed_elsewhere[key] = f"{host} pid {pid}"
            return False
        if pid == self.pid:
            with _HELD_MUTEX:
                return str(path) not in _HELD  # left over by an earlier run in this process
        if _alive(pid, info.get("start")):
            self.claimed_elsewhere[key] = f"pid {pid}"
            return False
        return True

    def release(self, keys: Iterable | None = None) -> None:
        """Drop claims (all held ones by default) without writing records."""
        for k in list(self.held) if keys is None else list(keys):
            path = self.held.pop(k, None)
            if path is None:
                continue
            with _HELD_MUTEX:
                _HELD.discard(str(path))
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # writing
    def append(self, records: Iterable[dict]) -> None:
        """Append records (write + fsync each) under the lock, mark their cells done and release their claims."""
        records = list(records)
        if not records:
            return
        with self.lock():
            self._repair_all()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                for rec in records:
                    _write_line(fd, rec)
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.refresh()
            keys = [self.key(r) for r in records]
            self.done.update(k for k in keys if k is not None)
            self.release(k for k in keys if k is not None)

    def close(self) -> None:
        self.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
