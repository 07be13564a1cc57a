"""Summarise py-spy's raw samples (`py-spy record --threads --idle --format raw`, plain or gzipped) by thread and, within the thread
that ran llama_decode, by function (inclusive: the share of that thread's samples with the function on the stack)
and by leaf (exclusive). Usage: python benchmarks/profile_summary.py SAMPLES [--top N]"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
import sys

FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse(path: str):
    """(thread, [frames root first], count) per line."""
    opener = gzip.open if path.endswith(".gz") else open
    for line in opener(path, "rt", encoding="utf-8", errors="replace"):
        line = line.rstrip("\n")
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        parts = stack.split(";")
        thread = next((p for p in parts if p.startswith("thread ")), "?")
        frames = [p for p in parts if not p.startswith(("thread ", "process "))]
        yield thread, frames, int(n)


def short(frame: str) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    return f"{m['func']} ({m['file'].rsplit('/', 1)[-1]}{':' + m['line'] if m['line'] else ''})"


def func(frame: str) -> str:
    m = FRAME.match(frame)
    return f"{m['func']} ({m['file'].rsplit('/', 1)[-1]})" if m else frame


def engine_shares(path: str) -> dict:
    """The engine thread's busy samples (idle: waiting for work in `_commands`), the share of them inside
    llama_decode (py-spy's leaf is then the Python line that calls it: the most common leaf line of `_decode`) and
    the share of each engine-loop function outside it (inclusive)."""
    rows = list(parse(path))
    engine = [(f, n) for t, f, n in rows if "epikv-llamacpp" in t]
    busy = [(f, n) for f, n in engine if not any("_commands" in x for x in f)]
    m = sum(n for _, n in busy)
    leaves = collections.Counter()
    for f, n in busy:
        if f and f[-1].startswith("LlamaBackend._decode "):
            leaves[f[-1]] += n
    if not m or not leaves:
        raise ValueError(f"{path}: no busy sample of the engine thread (epikv-llamacpp) inside LlamaBackend._decode")
    call, in_decode = leaves.most_common(1)[0]
    loop = ("Thread", "LlamaBackend._loop", "LlamaBackend._step", "LlamaBackend._decode")
    outside = collections.Counter()
    for f, n in busy:
        if not f or f[-1] == call:
            continue
        if f[-1].startswith(loop):  # a line of the loop itself
            outside[func(f[-1]) + ", its own lines"] += n
        for fn in {func(x) for x in f if not x.startswith(loop)}:
            outside[fn] += n
    return {"busy": m, "llama_decode": in_decode / m, "call": short(call),
            "outside": {fn: n / m for fn, n in outside.most_common()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("samples")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    rows = list(parse(a.samples))
    if not rows:
        print(f"no samples in {a.samples}", file=sys.stderr)
        return 2
    per_thread = collections.Counter()
    for t, _, n in rows:
        per_thread[t] += n
    engine = max(per_thread, key=lambda t: sum(n for th, f, n in rows if th == t and any("_decode" in x for x in f)))
    total = sum(per_thread.values())
    print(f"samples: {total} over {len(per_thread)} threads (idle included)")
    for t, n in per_thread.most_common():
        print(f"  {n:7d}  {t}{'   <- the engine thread' if t == engine else ''}")
    eng = [(f, n) for t, f, n in rows if t == engine]
    m = sum(n for _, n in eng)
    incl, leaf = collections.Counter(), collections.Counter()
    for frames, n in eng:
        for fn in {func(x) for x in frames}:
            incl[fn] += n
        if frames:
            leaf[short(frames[-1])] += n
    print(f"\nengine thread, {m} samples: functions on the stack (inclusive)")
    for fn, n in incl.most_common(a.top):
        print(f"  {100 * n / m:5.1f} %  {fn}")
    print("\nengine thread: leaf frames (exclusive)")
    for fn, n in leaf.most_common(a.top):
        print(f"  {100 * n / m:5.1f} %  {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
