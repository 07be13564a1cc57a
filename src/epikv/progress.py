"""Progress for long commands: a live tqdm bar on a terminal, plain periodic lines otherwise.

When stderr is not a terminal (`2> log`, a batch scheduler, a pipe) a background thread prints one line every
`interval` seconds (default 20, `$EPIKV_PROGRESS_SECONDS` overrides; 0 = one line per update instead), e.g.

    eval: 12/60 cells, 3.1 min elapsed, ~12 min left (epikv K=512 s0)

so a log shows the run is alive even while one item takes minutes. The time left is extrapolated from the items
this process ran (items found done or taken by another process count as progress but not as speed).

    with Progress("trace", total=None, unit="tokens") as p:   # total unknown: counts and elapsed time only
        ...; p.update(1)
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _dur(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def live_rate(n: int, seconds: float, min_n: int = 8, min_seconds: float = 0.5) -> float | None:
    """Items per second so far, or None until at least `min_n` items and `min_seconds` have passed: an early
    reading times a step or two against a clock that barely moved (the first decode step read 3,359 tok/s) and
    means nothing."""
    if n < min_n or seconds < min_seconds:
        return None
    return n / seconds


def rate_text(rate: float | None, unit: str = "tok/s") -> str:
    """'12.3 tok/s', or '... tok/s' while the rate is not yet meaningful."""
    return f"... {unit}" if rate is None else f"{rate:.1f} {unit}"


def default_interval() -> float:
    try:
        return float(os.environ.get("EPIKV_PROGRESS_SECONDS", "20"))
    except ValueError:
        return 20.0


class Progress:
    """`update(n)` after n items ran, `skip(n)` after n items turned out done or taken elsewhere, `set_status(s)`
    for what runs now, `note(line)` to print a message without breaking the bar, `close()` (or a `with` block).

    bar=False: no tqdm bar on a terminal (the caller prints its own lines there); the plain lines still appear
    when stderr is not a terminal."""

    def __init__(self, label: str, total: int | None = None, unit: str = "items", done: int = 0,
                 quiet: bool = False, interval: float | None = None, stream=None, bar: bool = True):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.n = done  # items finished (by anyone)
        self.ran = 0  # items this process ran
        self.status = ""
        self.quiet = quiet
        self._printed = False
        self.t0 = time.monotonic()
        self.interval = default_interval() if interval is None else interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._bar = None
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        if quiet:
            return
        if self.tty:
            if bar:
                from tqdm import tqdm

                self._bar = tqdm(total=total, initial=done, unit=unit.rstrip("s") or unit, desc=label,
                                 file=self.stream, dynamic_ncols=True)
            return
        if self.interval > 0:  # the first line after `interval` seconds: short runs and early errors stay quiet
            self._thread = threading.Thread(target=self._beat, name=f"progress-{label}", daemon=True)
            self._thread.start()

    @property
    def plain(self) -> bool:
        """True when progress goes out as plain lines (not quiet, not a terminal)."""
        return not self.quiet and not self.tty

    def line(self) -> str:
        el = time.monotonic() - self.t0
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        parts = [f"{count} {self.unit}", f"{_dur(el)} elapsed"]
        if self.total is not None and self.n < self.total:
            if self.ran and el > 0:
                parts.append(f"~{_dur((self.total - self.n) * el / self.ran)} left")
        elif self.total is not None:
            parts.append("done")
        text = f"{self.label}: " + ", ".join(parts)
        return f"{text} ({self.status})" if self.status else text

    def _emit(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._printed = True

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                try:
                    self._emit()
                except (OSError, ValueError):  # the stream is gone (closed pipe, finished test capture)
                    return

    def set_status(self, text: str) -> None:
        self.status = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:  # tqdm-compatible name
        self.set_status(text)

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            self.ran += n
            if self._bar is not None:
                self._bar.update(n)
            elif self.plain and self.interval <= 0:
                self._emit()

    def skip(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
            if self._bar is not None:
                self._bar.update(n)

    def note(self, text: str) -> None:
        """A message line (per-item results): above the bar on a terminal, a plain line otherwise."""
        if self.quiet:
            return
        with self._lock:
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
            self._thread = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.plain and not getattr(self, "_closed", False) and (self._printed or self.ran):
            with self._lock:
                self._emit()  # the final count, when anything was reported or run
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
