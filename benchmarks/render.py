"""Render every generated block of the README and the docs from its source, so no page restates a number by hand.

A page marks a generated block with a pair of comments::

    <!-- render:NAME -->
    ...                      (written by this script; edit the renderer, not the page)
    <!-- /render:NAME -->

NAME is one of RENDERERS below: measured tables from committed raw files under benchmarks/results/ (each followed
by a line naming its raw file, the date of the commit that last changed it and the command that measured it), the
CLI reference from the argparse parsers (`cli:COMMAND`), and the policy table from the registry (`policies`).

    python benchmarks/render.py            # rewrite the blocks of README.md and docs/*.md in place
    python benchmarks/render.py --check    # exit 1 naming each stale block, write nothing (tests/test_docs.py)
    python benchmarks/render.py --figure   # also redraw docs/img/long-generation.png from its raw file

Bad input (an unknown block name, an unclosed marker, a missing raw file, a page that does not exist) is one line
on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIGURE = ROOT / "docs" / "img" / "long-generation.png"
MARKER = re.compile(r"<!-- render:(?P<name>[\w:.-]+) -->\n(?P<body>.*?)<!-- /render:(?P=name) -->", re.S)
OPEN = re.compile(r"<!-- render:([\w:.-]+) -->")


class RenderError(Exception):
    """A bad input: reported in one line, exit 2."""


# --------------------------------------------------------------------------------------------------- raw files


def raw(rel: str) -> Path:
    path = RESULTS / rel
    if not path.is_file():
        raise RenderError(f"raw file benchmarks/results/{rel} is missing")
    return path


def load_json(rel: str) -> dict:
    try:
        return json.loads(raw(rel).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RenderError(f"benchmarks/results/{rel} is not JSON: {e}") from None


def load_jsonl(rel: str) -> list[dict]:
    out = []
    for i, line in enumerate(raw(rel).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise RenderError(f"benchmarks/results/{rel} line {i} is not JSON") from None
    return out


DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


@functools.lru_cache(maxsize=None)
def shallow() -> bool:
    """Whether this clone lacks history (git clone --depth): its `git log` dates every file by the newest commit."""
    try:
        r = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.stdout.strip() == "true"


def committed(rel: str) -> str:
    """The date (YYYY-MM-DD) of the last commit that changed benchmarks/results/REL."""
    try:
        r = subprocess.run(["git", "log", "-1", "--format=%cs", "--", f"benchmarks/results/{rel}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RenderError(f"cannot ask git for the date of benchmarks/results/{rel}: {e}") from None
    if r.returncode != 0 or not r.stdout.strip():
        raise RenderError(f"benchmarks/results/{rel} is not committed (git log has no date for it)")
    return r.stdout.strip()


def source_line(files: list[str], command: str) -> str:
    names = ", ".join(f"`benchmarks/results/{f}` ({committed(f)})" for f in files)
    return f"Rendered by `python benchmarks/render.py` from {names}; measured with `{command}`."


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def f1(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def f2(x) -> str:
    return "-" if x is None else f"{x:.2f}"


# -------------------------------------------------------------------------------------------- measured tables


def llamacpp_split(files: list[str]) -> str:
    """Where a step's time goes (llamacpp_speed.py split): per configuration the time inside llama_decode and
    outside it, medians of the repeats; one table per file (one code version each), the first file's rows first."""
    parts = []
    for f in files:
        d = load_json(f)
        plain = d["rows"][0]
        rows = [[r["config"], f"{r['ms_per_token']:.2f}", f"{r['decode_ms']:.2f}", f"{r['outside_ms']:.2f}",
                 f"{r['outside_ms'] - plain['outside_ms']:+.2f}", f"{r['ms_per_token'] / plain['ms_per_token']:.3f}",
                 "-" if r["evictions"] is None else r["evictions"]] for r in d["rows"]]
        head = [f"{d.get('label', 'this code')}: K = {d['budget']}, {d['tokens']} tokens, {d['threads']} thread",
                "ms a token", "inside llama_decode", "outside", "outside, over plain", "time vs plain held",
                "evictions"]
        loads = ", ".join(f"{r['load_before'][0]:.2f}" for r in d["repeats"])
        parts.append(table(head, rows) + f"\n\nMedians of {len(d['repeats'])} repeats (load before each: "
                     f"{loads}; {d['cpus']} cores). " + source_line([f], d["command"]))
    return "\n\n".join(parts)


def llamacpp_step(f: str = "llamacpp/step.json") -> str:
    d = load_json(f)
    rows = [[r["config"], f"{r['tokens_per_s']:.2f}", f"{r['time_vs_plain_whole']:.3f}",
             f"{r['time_vs_plain_held']:.3f}"] for r in d["rows"]]
    head = ["decode, K = %d, %d new tokens, %d thread" % (d["budget"], d["rows"][0]["tokens"], d["threads"]),
            "tok/s", "time vs plain, whole cache", "time vs plain held at K"]
    load = ", ".join(f"{x:.2f}" for x in d["load_average"])
    reps = d.get("repeats") or []
    if len(reps) > 1:  # each row is the median of the repeats' paired ratios
        spread = "; ".join(f"{r['config']}: {min(r['time_vs_plain_held_repeats']):.3f} to "
                           f"{max(r['time_vs_plain_held_repeats']):.3f}" for r in d["rows"]
                           if "time_vs_plain_held_repeats" in r and r["config"].startswith(d["policy"]))
        load = (f"medians of {len(reps)} repeats, each from fresh decoders (time against plain llama.cpp held at K, "
                f"range over the repeats: {spread}); load average before the repeats "
                + ", ".join(f"{r['load_before'][0]:.2f}" for r in reps) + f", at the end {load}")
        return table(head, rows) + f"\n\nRows are {load} on {d['cpus']} cores.\n\n" + source_line([f], d["command"])
    return (table(head, rows) + f"\n\nLoad average at the end of the run: {load} on {d['cpus']} cores.\n\n"
            + source_line([f], d["command"]))


def llamacpp_capture() -> str:
    f = "llamacpp/capture.json"
    d = load_json(f)
    rows = [[r["config"], f"{r['tokens_per_s']:.2f}", f"{r['time_vs_no_callback']:.4f}"] for r in d["rows"]]
    head = [f"bare loop, whole cache, {d['gen']} tokens", "tok/s", "time vs no callback"]
    return (table(head, rows) + f"\n\nThe scheduler asks the callback about {d['asks_per_forward']:.0f} graph nodes "
            "a forward.\n\n" + source_line([f], d["command"]))


def llamacpp_celltypes() -> str:
    """Issue 56: eviction on q8_0 / q4_0 cells against F16 cells at the same K, interleaved rounds, per policy."""
    files = ["llamacpp/celltypes-epikv-seg-q.json", "llamacpp/celltypes-epikv-learned-mean.json"]
    rows = []
    for f in files:
        d = load_json(f)
        for t, v in d["summary"].items():
            lo, hi = v["time_vs_f16_range"]
            rows.append([d["policy"], d["budget"], t, f"{v['tokens_per_s_median']:.2f}",
                         f"{v['time_vs_f16_median']:.3f} ({lo:.3f}-{hi:.3f})", len(d["repeats"]),
                         " / ".join(f"{x:.1f}" for x in d["load_average"])])
    head = ["policy", "K", "cells", "tok/s (median)", "time vs F16 cells, median (range)", "repeats",
            "load after"]
    d = load_json(files[0])
    return (table(head, rows) + f"\n\n{d['tokens']} new tokens a repeat, rounds of {d['round']} interleaved, "
            f"flash attention on, {d['threads']} thread.\n\n" + source_line(files, d["command"]))


def _segments(n: int, seg: int) -> list[str]:
    return [f"{i * seg + 1}-{(i + 1) * seg}" for i in range(n)]


def llamacpp_long() -> str:
    f = "llamacpp/long.json"
    d = load_json(f)
    names = {("llama.cpp", "epikv"): "epikv in llama.cpp, K = %s",
             ("llama.cpp", "full"): "plain llama.cpp, whole cache",
             ("torch", "epikv"): "epikv, torch engine (float32), K = %s"}
    n = len(d["rows"][0]["segments_tok_s"])
    head = ["tok/s per %d tokens" % d["segment"]] + _segments(n, d["segment"]) + ["KV bytes", "peak RSS (MiB)"]
    rows = []
    for r in d["rows"]:
        name = names[(r["engine"], r["policy"])]
        name = name % r["budget"] if "%s" in name else name
        rows.append([name] + [f1(x) for x in r["segments_tok_s"]] + [f"{r['kv_bytes'] / 1e6:.1f} MB",
                                                                     f1(r["peak_rss_mib"])])
    rows.append(["epikv llama.cpp / plain"] + [f2(x) for x in d["epikv_over_full_per_segment"]] + ["", ""])
    return (table(head, rows) + "\n\nEach configuration in its own process, one after the other.\n\n"
            + source_line([f], d["command"]))


def llamacpp_interleaved() -> str:
    f = "llamacpp/interleaved.json"
    d = load_json(f)
    seg = d["segments_tok_s"]
    n = len(next(iter(seg.values())))
    head = ["tok/s per %d tokens" % d["segment"]] + _segments(n, d["segment"])
    rows = [[k + (f", K = {d['budget']}" if k.startswith("epikv") else "")] + [f2(x) for x in v]
            for k, v in seg.items()]
    ep, pl = (next(v for k, v in seg.items() if k.startswith(w)) for w in ("epikv", "plain"))
    rows.append(["epikv / plain"] + [f"{round(a, 2) / round(b, 2):.2f}" for a, b in zip(ep, pl)])  # of the rates shown
    return (table(head, rows) + "\n\nThe two configurations alternate segment by segment in one process"
            + _repeats_note(d) + ".\n\n" + source_line([f], d["command"]))


def _repeats_note(d: dict) -> str:
    """How many interleaved repeats a row's medians come from, and the machine's load before each (from the file)."""
    reps = d.get("repeats") or []
    if len(reps) < 2:
        return f" (one run, load {d['load_average'][0]:.2f} at its end)" if d.get("load_average") else ""
    loads = ", ".join(f"{r['load_before'][0]:.2f}" for r in reps)
    return (f"; each figure is the median of {len(reps)} repeats from a fresh prefill, the pair's order alternating, "
            f"on {d['cpus']} cores with a load of {loads} before each")


def _serve_rows(rel: str) -> list[dict]:
    return [r for r in load_jsonl(rel) if r.get("kind") == "serve"]


def _window(rows: list[dict]) -> int:
    """The whole seconds every row covers: the shortest row's."""
    return min(int(r["wall_s"]) for r in rows)


def _in_window(r: dict, win: int) -> float:
    return sum(r["tokens_by_second"][:win]) / win


def _pct(r: dict, key: str, lb: str) -> str:
    """A percentile, marked >= when a request cut by the row's timeout lies at or below it (a lower bound)."""
    v = r.get(key)
    return "-" if v is None else (">= " if (r.get("lower_bound") or {}).get(lb) else "") + f"{v:.1f}"


def _mib(b) -> str:
    return "-" if not b else f"{b / 2**20:.0f} MiB"


STREAMS = {"streams": "serve/engines-streams/streams/results.jsonl",
           "unified": "serve/engines-streams/unified/results.jsonl",
           "torch": "serve/engines-streams/torch/results.jsonl"}


def _streams_rows() -> dict[str, dict]:
    return {k: _serve_rows(f)[-1] for k, f in STREAMS.items()}


def serve_streams() -> str:
    """Issue 40's engines load at equal KV bytes: llama.cpp with a stream per sequence, llama.cpp with one unified
    cache, and the torch server; tokens/s over the window every row covers."""
    rows = _streams_rows()
    win = _window(list(rows.values()))
    st, un, to = rows["streams"], rows["unified"], rows["torch"]
    head = [f"{st['requests']} x {st['max_tokens']:,} tokens, epikv K = {st['budget']}",
            "llama.cpp, a stream per sequence", "llama.cpp, one unified cache", "torch server"]
    n = st["settings"]["sequences"]
    cache = [f"{st['cells']:,} cells: {n} streams of {st['cells'] // n:,}",
             f"{un['cells']:,} cells, shared", f"{to['num_blocks']} pages of {to['settings']['page']} tokens"]
    body = [["KV cache", *cache],
            ["KV bytes (K and V)", _mib(st["kv_bytes"]), _mib(un["kv_bytes"]), _mib(to["kv_bytes"])],
            [f"tokens/s over the first {win} s (every row)", *(f2(_in_window(r, win)) for r in (st, un, to))],
            ["tokens/s over the whole row", *(f2(r["tokens_per_s"]) for r in (st, un, to))],
            ["completed (of %d)" % st["requests"], *(str(r["completed"]) for r in (st, un, to))],
            ["requests in flight: max / mean", *(f"{r['max_in_flight']} / {f1(r['in_flight_mean'])}"
                                                 for r in (st, un, to))],
            ["latency p50 / p95 (s)", *(f"{_pct(r, 'latency_p50_s', 'latency_p50')} / "
                                        f"{_pct(r, 'latency_p95_s', 'latency_p95')}" for r in (st, un, to))],
            ["time to first token p50 (s)", *(_pct(r, "ttft_p50_s", "ttft_p50") for r in (st, un, to))],
            ["preemptions", *(str(r["preemptions"]) for r in (st, un, to))],
            ["row (s)", *(f"{f1(r['wall_s'])}" + (" (cut)" if r["unfinished"] else " (whole)")
                          for r in (st, un, to))]]
    w = {k: _in_window(r, win) for k, r in rows.items()}
    note = (f"\n\nOver the first {win} s: streams {w['streams'] / w['torch']:.2f}x the torch server's tokens/s and "
            f"{w['streams'] / w['unified']:.2f}x the unified cache's. A percentile marked >= is a lower bound (a "
            "request cut by the row's timeout counts with its time so far).")
    return table(head, body) + note + "\n\n" + source_line(list(STREAMS.values()),
                                                            "bash benchmarks/results/serve/engines-streams/run.sh")


LLAMA_SERVER = ["serve/llama-server/r8x1024/results.jsonl", "serve/llama-server/r8x1024-streams/results.jsonl",
                "serve/llama-server/r8x3072/results.jsonl"]
LLAMA_SERVER_WHAT = ["epikv on one unified cache", "epikv on a stream per sequence, llama-server run again",
                     "requests that outgrow llama-server's slot"]


def _llama_server_cells() -> str:
    """llama-server's cells, from the command that started it in the run's committed script (its rows record none)."""
    rel = "serve/llama-server/run.sh"
    m = re.search(r'"\$LS" .*?-c (\d+) --parallel (\d+)', raw(rel).read_text(encoding="utf-8"))
    if not m:
        raise RenderError(f"benchmarks/results/{rel}: no llama-server command with -c and --parallel")
    cells, slots = int(m.group(1)), int(m.group(2))
    return f"{cells:,} ({slots} slots of {cells // slots:,})"


def serve_llama_server() -> str:
    """llama.cpp's own llama-server beside epikv serve --engine llama.cpp, the same GGUF, threads and client."""
    out = []
    for f, what in zip(LLAMA_SERVER, LLAMA_SERVER_WHAT):
        rows = _serve_rows(f)
        win = _window(rows)

        def cells(r):
            if r["engine"] == "external":
                return _llama_server_cells()
            return f"{r['cells']:,}" + (f" (8 streams of {r['cells'] // 8:,})" if r.get("kv") == "streams" else
                                        " (unified)")

        body = [[r["label"], cells(r), f"{r['completed']} of {r['requests']}",
                 f"{r['generated_tokens'] / r['requests']:,.0f}", f2(r["tokens_per_s"]), f2(_in_window(r, win)),
                 f"{_pct(r, 'latency_p50_s', 'latency_p50')} / {_pct(r, 'latency_p95_s', 'latency_p95')}",
                 _pct(r, "ttft_p50_s", "ttft_p50"), f1(r["wall_s"])] for r in rows]
        head = [f"{rows[0]['requests']} x {rows[0]['max_tokens']:,} tokens asked: {what}", "KV cells", "completed",
                "tokens a request got", "tokens/s", f"tokens/s, first {win} s", "latency p50 / p95 (s)",
                "TTFT p50 (s)", "row (s)"]
        out.append(table(head, body))
    return "\n\n".join(out) + "\n\n" + source_line(LLAMA_SERVER, "bash benchmarks/results/serve/llama-server/run.sh")


FAIR = "serve/llama-server/fair/results.jsonl"
_FAIR_RUN = "PYTHONPATH=src .venv/bin/python benchmarks/serve_vs_llama_server.py run --repeats 3 "
FAIR_COMMAND = (f"{_FAIR_RUN}--tokens 1024 --out benchmarks/results/serve/llama-server/fair` and then `{_FAIR_RUN}"
                "--tokens 4096 --rows llama-server,llama-server-shift,epikv-seg-q:512 --out "
                "benchmarks/results/serve/llama-server/fair")


@functools.lru_cache(maxsize=None)
def _bench_module(name: str):
    """benchmarks/<name>.py as a module, so a page renders with the same code that measured (or summarised)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fair():
    """benchmarks/serve_vs_llama_server.py: its medians(), tables() and goals() render what it measured."""
    return _bench_module("serve_vs_llama_server")


def _fair_block(rel: str, command: str) -> str:
    """An interleaved run's tables and issue 50's goals on its medians, from its raw file."""
    rows = load_jsonl(rel)
    try:
        text = _fair().tables(rows)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise RenderError(f"benchmarks/results/{rel}: a row lacks what the table needs ({type(e).__name__}: {e})") \
            from None
    met = "".join(f"- {g}\n" for g in _fair().goals(rows))
    return text + "\n\n" + (f"Issue 50's goals, on these medians:\n\n{met}\n" if met else "") + \
        source_line([rel], command)


EQUAL_BYTES = "equal-bytes"
EQUAL_BYTES_COMMAND = ("bash benchmarks/results/equal-bytes/run.sh (two copies, one a core), then python "
                       "benchmarks/equal_bytes.py --write")


def equal_bytes() -> str:
    """Issue 56's equal-memory rows: eviction on F16 / q8_0 / q4_0 cells, the whole cache quantized, context shift;
    benchmarks/equal_bytes.py's own tables on the three folders' records."""
    mod = _bench_module("equal_bytes")
    files = [f"{EQUAL_BYTES}/{t}/results.jsonl" for t in mod.TYPES if (RESULTS / EQUAL_BYTES / t / "results.jsonl").is_file()]
    raw(f"{EQUAL_BYTES}/f16/results.jsonl")  # the reference folder must exist: a one-line error otherwise
    memories = [mod.parse_size(x) for x in ("12MiB", "24MiB")]
    try:
        s = mod.summarise(mod.collect(mod.load(RESULTS / EQUAL_BYTES), memories), memories)
    except (KeyError, TypeError, ValueError) as e:
        raise RenderError(f"benchmarks/results/{EQUAL_BYTES}: a record lacks what the table needs "
                          f"({type(e).__name__}: {e})") from None
    return mod.tables(s) + "\n" + source_line(files, EQUAL_BYTES_COMMAND)


def serve_llama_server_fair() -> str:
    """epikv serve (llama.cpp) against llama-server, interleaved repeats: medians, paired ratios, quarters."""
    return _fair_block(FAIR, FAIR_COMMAND)


FAIR_4096 = "serve/llama-server/fair-4096/results.jsonl"
FAIR_4096_COMMAND = (f"{_FAIR_RUN}--tokens 4096 --rows llama-server,epikv-seg-q:512 --out "
                     "benchmarks/results/serve/llama-server/fair-4096")


def serve_llama_server_fair_4096() -> str:
    """The 8 x 4,096 goal rows again, after Seg-Q's key mirror went to the one layer its keep rule reads."""
    return _fair_block(FAIR_4096, FAIR_4096_COMMAND)


FAIR_DEFAULT = "serve/llama-server/fair-epyc-1024/results.jsonl"
FAIR_DEFAULT_COMMAND = ("PYTHONPATH=src .venv/bin/python benchmarks/serve_vs_llama_server.py run --tokens 1024 "
                        "--flash-attn auto --repeats 5 --rows llama-server,full,epikv-learned-decay:512,"
                        "llama-server-shift@epikv-learned-decay:512 --out "
                        "benchmarks/results/serve/llama-server/fair-epyc-1024")


def serve_llama_server_fair_default() -> str:
    """Issue 58's fair rows for the default at 8 x 1,024: flash attention as llama-server runs it (auto), 5 interleaved
    repeats with paired 95 % intervals, llama-server --context-shift on the default row's own cells, every buffer
    counted in the KV bytes."""
    return _fair_block(FAIR_DEFAULT, FAIR_DEFAULT_COMMAND)


PROFILE = "serve/llama-server/profile"
PROFILE_COMMAND = ("bash benchmarks/profile_serve.sh epikv-seg-q 256 1024 benchmarks/results/serve/llama-server/"
                   "profile/{before,after}")


def serve_profile() -> str:
    """Where the engine thread of `epikv serve --engine llama.cpp` spends its busy time, before and after a change."""
    mod = _bench_module("profile_summary")
    body, files = [], []
    for run in ("before", "after"):
        rel = f"{PROFILE}/{run}/samples.txt.gz"
        if not (RESULTS / rel).exists():
            raise RenderError(f"benchmarks/results/{rel} is missing")
        try:
            sh = mod.engine_shares(str(RESULTS / rel))
        except ValueError as e:
            raise RenderError(str(e)) from None
        top = ", ".join(f"{fn} {100 * v:.1f} %" for fn, v in list(sh["outside"].items())[:4])
        body.append([run, f"{sh['busy']:,}", f"{100 * sh['llama_decode']:.1f} %", f"{100 - 100 * sh['llama_decode']:.1f} %",
                     top])
        files.append(rel)
    head = ["run", "busy samples", "in llama_decode", "Python outside it", "largest parts outside it (inclusive)"]
    return table(head, body) + "\n\n" + source_line(files, PROFILE_COMMAND)


AB = "serve/llama-server/ab-issue50"
AB_COMMAND = ("bash benchmarks/ab_serve_commits.sh a8fc81f epikv-seg-q:256 1024 3 "
              "benchmarks/results/serve/llama-server/ab-issue50")


def serve_ab() -> str:
    """One row at two commits, alternating on the same machine: the paired ratios new / old."""
    rate = {side: [r["tokens_per_s"] for r in load_jsonl(f"{AB}/{side}/results.jsonl")] for side in ("old", "new")}
    commits = {side: sorted({str(r.get("epikv_commit")) for r in load_jsonl(f"{AB}/{side}/results.jsonl")})
               for side in ("old", "new")}
    if len(rate["old"]) != len(rate["new"]) or not rate["old"]:
        raise RenderError(f"benchmarks/results/{AB}: old and new need the same number of repeats")
    pairs = [n / o for o, n in zip(rate["old"], rate["new"])]
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    return (f"8 x 1,024 tokens, `epikv-seg-q` K = 256, tokens/s in run order: old ({', '.join(commits['old'])}) "
            f"{fmt(rate['old'])}; new ({', '.join(commits['new'])}) {fmt(rate['new'])}; new / old paired "
            f"{', '.join(f'{p:.2f}' for p in pairs)}, median {statistics.median(pairs):.2f}x.\n\n"
            + source_line([f"{AB}/old/results.jsonl", f"{AB}/new/results.jsonl"], AB_COMMAND))


def _fair_latest() -> list[dict]:
    """The interleaved rows the README states: the first run's, with its lengths that a later run measured again
    (fair-4096) replaced by the later run's."""
    new = load_jsonl(FAIR_4096)
    again = {r["tokens"] for r in new}
    return [r for r in load_jsonl(FAIR) if r["tokens"] not in again] + new


def _serve_table(rel: str, command: str, what: str) -> str:
    rows = sorted(_serve_rows(rel), key=lambda r: (r["budget"] is not None, r["budget"] or 0))

    def in_flight(r):
        if not r.get("cache_full_steps"):
            return f"never full: {r['max_in_flight']}"
        return f"{r['in_flight_cache_full_mean']:.2f}"

    body = [[r["label"], f"{r['completed']} of {r['requests']}", f2(r["tokens_per_s"]), in_flight(r),
             str(r["preemptions"]), f"{r['peak_pages']} / {r['num_blocks']}", f1(r["wall_s"])] for r in rows]
    head = [what, "completed", "aggregate tokens/s", "in flight while the cache was full", "preemptions",
            "peak pages / pages", "wall (s)"]
    return table(head, body) + "\n\n" + source_line([rel], command)


def serve_h200() -> str:
    return _serve_table("serve/gpu-h200/results.jsonl",
                        "ROW_TIMEOUT=370 EQ_BATCH=8 EQ_TOKENS=64 bash benchmarks/results/serve/gpu-h200/run.sh"
                        " (its README)",
                        "SmolLM2 bf16 on one H200, 808 pages of 16, 32 x 3072 tokens, rows cut at 370 s")


def serve_sampled() -> str:
    return _serve_table("serve/sampled/results.jsonl", "bash benchmarks/results/serve/sampled/run.sh",
                        "SmolLM2 on the CPU, 232 pages of 16, 12 x 768 tokens, sampled (T 0.6, top-p 0.95)")


def serve_load() -> str:
    rel = "serve/load/load.json"
    d = load_json(rel)
    head = ["config", "users (~req/s offered)", "answered", "answered/s", "p50 s", "p95 s", "p99 s", "TTFT p50 s",
            "TTFT p95 s", "tokens/s", "429", "errors"]
    rows = [[r["config"], s["users"], s["ok"], s["ok_per_s"], s["p50_s"], s["p95_s"], s["p99_s"], s["ttft_p50_s"],
             s["ttft_p95_s"], s["tokens_per_s"], s["429"], s["errors"]] for r in d["results"] for s in r["stages"]]
    onset = ", ".join(f"{r['config']} at {r['429_from_users']} users" for r in d["results"])
    return (table(head, rows) + f"\n\n429s begin: {onset}. A machine with os.cpu_count() {d['nproc']}, shared with "
            "other agents' work during the run.\n\n" + source_line([rel], d["command"]))


def serve_fuzz() -> str:
    files = ["serve/fuzz/torch.json", "serve/fuzz/llamacpp.json"]
    t, l = load_json(files[0]), load_json(files[1])
    head = ["schemathesis from /openapi.json", "torch engine", "llama.cpp engine"]

    def statuses(d, route):
        return ", ".join(f"{k}: {v}" for k, v in d["statuses"][route].items())

    rows = [["examples per route and mode", t["examples"], l["examples"]], ["requests sent", t["cases"], l["cases"]],
            ["POST /v1/completions", statuses(t, "POST /v1/completions"), statuses(l, "POST /v1/completions")],
            ["POST /v1/chat/completions", statuses(t, "POST /v1/chat/completions"),
             statuses(l, "POST /v1/chat/completions")],
            ["failed checks", len(t["failures"]), len(l["failures"])],
            ["slowest answer (s)", t["slowest_s"], l["slowest_s"]],
            ["in flight / held when idle", f"{t['idle']['in_flight']} / {t['idle']['held']}",
             f"{l['idle']['in_flight']} / {l['idle']['held']}"],
            ["health after", t["health"]["status"], l["health"]["status"]], ["exit", t["server_exit"], l["server_exit"]]]
    return table(head, rows) + "\n\n" + source_line(files, t["command"] + "; " + l["command"])


def soak() -> str:
    files = ["serve/soak/figures.json", "serve/soak/llamacpp.json"]
    t, l = load_json(files[0]), load_json(files[1])
    head = ["soak (random lengths, a third streamed, dropped and malformed requests)", "torch engine",
            "llama.cpp engine"]

    def g(d, *keys):
        for k in keys:
            if k in d:
                return d[k]
        return None

    rows = []
    for label, keys, fmt in [("requests after warm-up", ("requests",), str), ("warm-up requests", ("warmup",), str),
                             ("seconds for the soak", ("soak_seconds",), f1), ("failed", ("failed",), str),
                             ("RSS after warm-up (MiB)", ("rss_after_warmup_mib",), f1),
                             ("RSS after the soak (MiB)", ("rss_after_soak_mib",), f1),
                             ("RSS ratio", ("rss_ratio",), lambda x: f"{x:.3f}"),
                             ("health-check failures", ("health_failures",), str)]:
        a, b = g(t, *keys), g(l, *keys)
        rows.append([label, "-" if a is None else fmt(a), "-" if b is None else fmt(b)])
    return table(head, rows) + "\n\n" + source_line(files, "bash benchmarks/results/serve/soak/run.sh")


def bench_long() -> str:
    f = "bench/long_smollm2_8192_cpu.json"
    d = load_json(f)
    pts = [p for p in d["long"] if p.get("status") == "ok"]
    by = {}
    for p in pts:
        by.setdefault((p["policy"], p["budget"]), []).append(p)
    lengths = sorted({p["generated"] for p in pts})
    head = ["SmolLM2, float32, CPU: tok/s of the segment ending at"] + [str(n) for n in lengths] + ["KV buffers (MiB)"]
    rows = []
    for (pol, k), ps in sorted(by.items(), key=lambda kv: kv[0][0]):
        seg = {p["generated"]: p for p in ps}
        rows.append([pol if k is None else f"{pol}, K = {k}"]
                    + [f2(seg[n]["segment_tokens_per_s"]) if n in seg else "-" for n in lengths]
                    + [f1(max(p["kv_buffer_mib"] for p in ps))])
    cmd = ("epikv bench speed --model smollm2 --threads 1 --policies full --gen-tokens 32 --round-steps 32 "
           "--budgets 1024 --long-policies epikv,full --long-budget 1024 --long-lengths 1024,2048,4096,8128 "
           "--cap-gib 6 "
           "--out benchmarks/results/bench/long_smollm2_8192_cpu.json")
    prompt = d["budgets"][0]["prompt_tokens"]
    return (table(head, rows) + f"\n\nA {prompt}-token prompt; tokens/s of each segment between checkpoints.\n\n"
            + source_line([f], cmd))


def bench_overhead() -> str:
    f = "bench/overhead/speed_smollm2_k512_k2048_final.json"
    d = load_json(f)
    budgets = d["budgets"]
    labels = [c["label"] for c in budgets[0]["configs"]]
    head = [f"SmolLM2-135M, CPU, float32, {_threads(d['settings']['threads'])}: ms / token (vs full; vs transformers)"] + [
        f"K = {b['budget']}" for b in budgets]
    rows = []
    for lab in labels:
        row = [lab]
        for b in budgets:
            ms = {c["label"]: c["ms_per_token"] for c in b["configs"]}
            x, full, tf = ms[lab], ms["full"], ms["transformers"]
            row.append(f"{x:.1f} ({(x / full - 1) * 100:+.1f} %; {(x / tf - 1) * 100:+.1f} %)")
        rows.append(row)
    b0 = budgets[0]
    cmd = ("epikv bench speed --model smollm2 --policies full,epikv,streaming --budgets 512,2048 --taus 1,128 "
           "--gen-tokens 1024 --no-long --threads 1 --out " + d["settings"]["out"])
    return (table(head, rows) + f"\n\nMedians over {b0['rounds']} rounds of {b0['round_steps']} steps, "
            "configurations taking turns in one process; `full` and `transformers` (its `generate` continuing a "
            "`DynamicCache`) grow from K - 512 to K + 512, the evicting rows hold K.\n\n" + source_line([f], cmd))


def pages_cost() -> str:
    f = "pages/results.jsonl"
    recs = [r for r in load_jsonl(f) if r.get("kind") == "retention" and r.get("budget") is not None]
    by: dict[str, dict[str, dict]] = {}
    for r in recs:
        by.setdefault(r["policy"], {})[r["trace_id"]] = r
    ref = by.get("epikv")
    if not ref:
        raise RenderError(f"benchmarks/results/{f} has no epikv records")
    names = {"epikv": "tokens (`epikv`)"}
    order = ["epikv"] + sorted((p for p in by if p != "epikv"), key=lambda p: int(re.sub(r"\D", "", p) or 0))
    rows = []
    for p in order:
        mine = by[p]
        both = sorted(set(mine) & set(ref))
        nll = statistics.fmean(mine[t]["answer_nll_increase"] for t in both)
        top1 = statistics.fmean(mine[t]["top1_agreement"] for t in both) * 100
        ev = statistics.fmean(mine[t]["evictions"] for t in both)
        if p == "epikv":
            d_nll = d_top = ""
        else:
            dn = statistics.fmean(mine[t]["answer_nll_increase"] - ref[t]["answer_nll_increase"] for t in both)
            wins = sum(mine[t]["answer_nll_increase"] < ref[t]["answer_nll_increase"] for t in both)
            dt = statistics.fmean(mine[t]["top1_agreement"] - ref[t]["top1_agreement"] for t in both) * 100
            d_nll, d_top = f"{dn:+.3f}, better on {wins}/{len(both)}", f"{dt:+.1f}"
        rows.append([names.get(p, p.replace("epikv-page", "pages of ")), f"{nll:.3f}", d_nll, f"{top1:.1f}", d_top,
                     f"{ev:.0f}"])
    k = recs[0]["budget"]
    head = [f"K = {k}, tau {recs[0]['tau']}, {len(ref)} traces", "answer-NLL increase over full (nats/token)",
            "paired vs tokens", "top-1 agreement %", "paired vs tokens (points)", "evictions / trace"]
    return table(head, rows) + "\n\n" + source_line([f], "bash benchmarks/results/pages/run.sh")


def bench_memory() -> str:
    f = "bench/memory_tiny_cpu.json"
    d = load_json(f)
    modes = {"eager+attn": "eager attention + attention weights", "sdpa+hidden": "SDPA + hidden states at two blocks"}
    by = {(p["mode"], p["n"]): p for p in d["points"]}

    def cell(p):
        if p is None:
            return "-"
        if p["status"] == "ok":
            return f"{p['peak_gib']:.3f} GiB"
        return p["status"]

    head = [f"one forward pass of n tokens, {d['model']}, cap {d['cap_gib']:.0f} GiB: peak memory"] + [
        str(n) for n in d["lengths"]]
    rows = [[modes.get(m, m)] + [cell(by.get((m, n))) for n in d["lengths"]] for m in modes]
    cmd = ("epikv bench memory --model random:tiny --threads 1 --lengths " + ",".join(map(str, d["lengths"]))
           + f" --cap-gib {d['cap_gib']:.0f} --out benchmarks/results/bench/memory_tiny_cpu.json")
    return (table(head, rows) + "\n\nEach point in a child process under a hard cap; `oom`: the allocation was "
            "refused, `skipped`: a shorter length already failed.\n\n" + source_line([f], cmd))


def bench_throughput() -> str:
    f = "bench/throughput/smollm2_cpu.json"
    d = load_json(f)
    pts = [p for p in d["points"] if p.get("full_request_set")]
    full = next(p for p in pts if p["policy"] == "full")
    head = [f"{d['requests']} requests x {d['new_tokens']} tokens, KV cap {d['cap_mib']:.0f} MiB, {d['model']}, CPU",
            "largest batch under the cap", "aggregate tokens/s", "time for all requests (s)", "vs full's time",
            "KV peak (MiB)"]
    rows = [[p["label"], str(p["batch"]), f2(p["aggregate_tokens_per_s"]), f1(p["time_all_requests_s"]),
             f"{p['time_all_requests_s'] / full['time_all_requests_s']:.2f}x", f1(p["kv_peak_bytes"] / 2**20)]
            for p in pts]
    cmd = raw("bench/throughput/command.txt").read_text(encoding="utf-8").strip().removeprefix("exec ")
    return (table(head, rows) + "\n\nStatic batches (a request keeps its slot until its batch ends); the machine "
            "was loaded during this run: `benchmarks/results/bench/throughput/README.md`.\n\n"
            + source_line([f], cmd))


def serve_equal_batch() -> str:
    f = "serve/cpu-equal-batch-evicting/results.jsonl"
    recs = load_jsonl(f)
    repeats = sorted({r["repeat"] for r in recs})
    labels = list(dict.fromkeys(r["label"] for r in recs))
    by = {(r["label"], r["repeat"]): r for r in recs}
    r0 = recs[0]
    head = [f"batch {r0['batch']}, {r0['prompt']} + {r0['new']} tokens, {r0['preset']}, CPU: ms / step (vs full)"] + [
        f"repeat {k + 1}" for k in repeats] + ["peak pages"]
    rows = []
    for lab in labels:
        engine = by[(lab, repeats[0])]["engine"]
        row = [lab if "generate" in lab else f"{lab} ({engine})"]
        for k in repeats:
            r, full = by[(lab, k)], by[("full", k)]
            row.append(f"{r['ms_per_step']:.1f} ({r['ms_per_step'] / full['ms_per_step']:.3f}x)")
        row.append(str(by[(lab, repeats[0])].get("peak_pages") or "-"))
        rows.append(row)
    cmd = ("OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_equal_batch.py --preset smollm2-135m --device cpu "
           "--dtype float32 --batch 4 --prompt 64 --new 448 --budgets 128,256 --page 16 --max-batch-tokens 256 "
           "--repeats 2 --out benchmarks/results/serve/cpu-equal-batch-evicting/results.jsonl")
    return (table(head, rows) + "\n\nThe two repeats ran under a varying load and disagree by more than the "
            "differences between policies: read no step-cost conclusion from them beyond that.\n\n"
            + source_line([f], cmd))


def _retention_records() -> tuple[list[str], dict]:
    files = ["retention-full/tau16/results.jsonl", "retention-full/tau128/results.jsonl"]
    cells: dict[tuple[str, int], dict[str, float]] = {}
    for f in files:
        for r in load_jsonl(f):
            if r.get("kind") != "retention" or r.get("budget") is None:
                continue
            label = r["policy"]
            if r.get("settings"):
                label += "[" + ",".join(f"{k}={v}" for k, v in sorted(r["settings"].items())) + "]"
            if r["tau"] != 16 and r["policy"] in ("epikv",):
                label += f"@tau={r['tau']}"
            cells.setdefault((label, r["budget"]), {})[r["trace_id"]] = r["answer_nll_increase"]
    return files, cells


def default_whole_traces() -> str:
    """The README's sentence on the default from issue 57's whole-trace run through llama.cpp: its answer-NLL change
    against random and against streaming at each budget, with the problem-bootstrap interval and whether it survives
    Holm's correction over the table (benchmarks/whole_traces.py), and the ranking it was chosen from."""
    from epikv.policies import DEFAULT_POLICY, FALLBACK_POLICY

    mod = _bench_module("whole_traces")
    data = {e: mod.load(e, RESULTS) for e in mod.SOURCES}
    s = mod.summarise(data)
    rows = {r["budget"]: r for r in s["rows"] if r["engine"] == "llama.cpp" and r["policy"] == DEFAULT_POLICY}
    if not rows:
        raise RenderError(f"benchmarks/results/{mod.SOURCES['llama.cpp'][0]} has no row of the default "
                          f"{DEFAULT_POLICY}")

    def vs(ref):
        out = []
        for k in sorted(rows):
            d = rows[k]["vs"].get(ref)
            if d is None:
                continue
            ci = "" if math.isnan(d["low"]) else f" [{d['low']:+.3f}, {d['high']:+.3f}]"
            held = "survives" if d.get("p_holm", 1) < 0.05 else "does not survive"
            out.append(f"{d['mean']:+.3f}{ci} at K = {k:,} ({d['wins']} of {d['n']} traces; {held} Holm's correction)")
        return "; ".join(out)

    n = max(r["n"] for r in rows.values())
    problems = len({mod.problem_of(t) for v in data["llama.cpp"].values() for t in v})
    def order(k):
        return ", ".join(f"`{r['policy']}` {r['mean']:+.3f}" for r in s["ranking_by_budget"][k])

    (rank_k,) = mod.RANK_BUDGETS
    others = "; ".join(f"at K = {k:,} the order is {order(k)}" for k in mod.BUDGETS if k != rank_k)
    files = [rel for rel in mod.SOURCES["llama.cpp"] if (RESULTS / rel).is_file()]
    return (f"On {n} whole reasoning traces ({problems} problems) through llama.cpp, its answer-NLL change against "
            f"random eviction is {vs('random')}; against `streaming`, which reads nothing: {vs('streaming')} "
            f"(nats/token, 95 % problem-bootstrap intervals). It was chosen as the least answer-NLL increase at "
            f"K = {rank_k:,} among the per-token policies on the traces all have ({order(rank_k)}); {others}. Where no "
            f"weights fit the model it falls back to `{FALLBACK_POLICY}` with one warning line.\n\n"
            + source_line(files, WHOLE_TRACES_COMMAND))


def retention_vs_random() -> str:
    files, cells = _retention_records()
    budgets = sorted({k for _, k in cells})
    labels = sorted({p for p, _ in cells} - {"random"})
    out = []
    for p in labels:
        row, key = [p], None
        for k in budgets:
            mine, ref = cells.get((p, k)), cells.get(("random", k))
            if not mine or not ref:
                row.append("-")
                continue
            both = sorted(set(mine) & set(ref))
            diff = statistics.fmean(mine[t] - ref[t] for t in both)
            wins = sum(mine[t] < ref[t] for t in both)
            row.append(f"{statistics.fmean(mine.values()):.3f} ({diff:+.3f}; {wins}/{len(both)})")
            if k == 1024:
                key = diff
        out.append((key if key is not None else 9.0, row))
    rows = [r for _, r in sorted(out, key=lambda x: x[0])]
    rows.append(["random"] + [f"{statistics.fmean(cells[('random', k)].values()):.3f}" if ("random", k) in cells
                              else "-" for k in budgets])
    head = ["answer-NLL increase over the whole cache, nats/token (vs random; traces better than random)"] + [
        f"K = {k}" for k in budgets]
    return (table(head, rows) + "\n\nMean over the traces; in brackets the mean paired difference from `random` at "
            "the same budget (negative: less answer likelihood lost than random) and on how many traces the policy "
            "lost less. Sorted by the difference at K = 1024. `epikv@tau=128` is `epikv` on the Seg family's "
            "schedule.\n\n" + source_line(files, "bash benchmarks/results/retention-full/run.sh A; ... C; ... D"))


# Issue 47's policies on the shared traces cut to 1,024 reasoning + 64 answer tokens, tau 16, and the reference rows
# of the same cut (benchmarks/results/retention: random, h2o, tova, snapkv, streaming).
ATTNFREE_RETENTION = ["retention-attnfree/traces-1-16/results.jsonl", "retention-attnfree/traces-17-28/results.jsonl",
                      "retention-learned/results.jsonl", "retention-learned/traces-15-28/results.jsonl",
                      "retention-learned/seg-q-1-14/results.jsonl", "retention-learned/seg-q-15-28/results.jsonl"]
CUT_REFERENCES = ["retention/results.jsonl", "retention/traces-17-28/results.jsonl",
                  "retention/rerun-1-16/results.jsonl", "retention/rerun-17-28/results.jsonl"]
ATTNFREE_POLICIES = ["epikv-learned", "epikv-learned-mean", "triattention", "expected-attention", "random-head"]
ATTNFREE_REFS = ["tova", "snapkv", "h2o", "streaming", "epikv-seg-q"]


def retention_attnfree() -> str:
    """The attention-free policies of issue 47 against random and per-head h2o: paired differences of the answer-NLL
    increase over the traces both have, with epikv's own bootstrap intervals (retention.bootstrap.paired)."""
    from epikv.retention.bootstrap import paired

    files = ATTNFREE_RETENTION + CUT_REFERENCES
    recs, seen = [], set()
    for f in files:
        for r in load_jsonl(f):
            key = (r.get("trace_id"), r.get("policy"), r.get("budget"))
            own_tau = 128 if r.get("policy") == "epikv-seg-q" else 16  # Seg-Q on its shipped schedule
            if r.get("kind") != "retention" or r.get("settings") or r.get("tau") != own_tau or key in seen:
                continue
            seen.add(key)  # a trace rerun in a second folder counts once
            recs.append(r)
    budgets = [512, 1024]
    refs = ("random", "h2o", "epikv-seg-q")
    vs = {ref: {(row["policy"], row["budget"]): row for row in paired(recs, ref)} for ref in refs}

    def cell(ref, p, k):
        row = vs[ref].get((p, k))
        if row is None:
            return "-"
        m, lo, hi = row["diff"]
        return f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}] {row['better']}/{row['n']}"

    rows = [[f"`{p}`"] + [cell(ref, p, k) for ref in refs for k in budgets]
            for p in ATTNFREE_POLICIES + ATTNFREE_REFS]
    head = ["answer-NLL increase, paired difference (95 % CI) and traces better"] + [
        f"vs {ref}, K = {k}" for ref in refs for k in budgets]
    return (table(head, rows) + "\n\nNegative: the policy lost less answer likelihood than the reference on the same "
            "traces (1,024 reasoning and 64 answer tokens of each, SmolLM2, tau 16 except `epikv-seg-q` at its own 128, "
            "CPU). The first five read no attention weights (`random-head` is random eviction drawn per KV head; "
            "`random` one draw for all heads); `tova`, `snapkv` and `h2o` read them; `streaming` keeps the newest; "
            "`epikv-seg-q`, the default, recomputes q.K at one block. Of the new ones only `epikv-learned-mean` keeps "
            "one set per token, as llama.cpp and the servers need.\n\n"
            + source_line(files, "epikv retention --model smollm2 --tau 16 --budgets 512,1024 --max-reasoning-tokens "
                                 "1024 --max-answer-tokens 64 ... (each folder's README has its exact commands)"))


WHOLE_TRACES_COMMAND = ("bash benchmarks/results/whole-traces/run.sh (two copies, traces split by ORDER), then python "
                        "benchmarks/whole_traces.py --write")


def whole_traces() -> str:
    """Issue 57: the per-token policies (the learned scores that age among them) on whole traces through llama.cpp,
    beside torch's rows, paired against random, streaming and per-head h2o; the ranking that picks the default."""
    mod = _bench_module("whole_traces")
    raw(mod.SOURCES["llama.cpp"][0])
    data = {e: mod.load(e, RESULTS) for e in mod.SOURCES}
    files = [rel for e in mod.SOURCES for rel in mod.SOURCES[e] if (RESULTS / rel).is_file()]
    s = mod.summarise(data)
    n_problems = len({mod.problem_of(t) for v in data["llama.cpp"].values() for t in v})
    return (mod.tables(s) + "\n" + "Each row against its own engine's whole cache on the same trace; differences "
            "paired by trace, 95 % interval from a bootstrap that resamples problems (none under "
            f"{mod.MIN_PROBLEMS} problems; the llama.cpp rows cover {n_problems} so far), bold where it survives "
            f"Holm's correction over the table's {s['holm_m']} differences with p (bootstrap, two-sided); `w/n`: "
            "traces where the row lost less. ᵗ: paired with torch's row on the same trace (llama.cpp runs no h2o, "
            "which reads attention weights).\n\n" + source_line(files, WHOLE_TRACES_COMMAND))


# llama.cpp's retention runs and the torch rows they repeat: (llama.cpp store, torch store, tau, policies)
LLAMACPP_RETENTION = [("llamacpp/retention", "retention-full/tau16", 16, ["random", "streaming"]),
                      ("llamacpp/retention-seg", "retention-full/tau128", 128, ["epikv-seg-q", "epikv-seg", "epikv"])]


def _retention_by(rel: str, budget: int) -> dict[tuple[str, str], dict]:
    """(policy, trace) -> record at this budget (full: its reference), default settings only."""
    return {(r["policy"], r["trace_id"]): r for r in load_jsonl(rel)
            if r.get("kind") == "retention" and r["budget"] in (None, budget) and not r.get("settings")}


def llamacpp_retention(budget: int = 1024) -> str:
    """Each policy's whole-trace retention through llama.cpp beside the torch engine's on the same traces (each engine
    against its own full cache): mean answer-NLL increase, top-1 agreement, answer KL; and the order of the policies
    by answer-NLL increase in each engine."""
    rows, means, files = [], {}, []
    for lrel, trel, tau, pols in LLAMACPP_RETENTION:
        lf, tf = f"{lrel}/results.jsonl", f"{trel}/results.jsonl"
        files += [lf, tf]
        lc, tc = _retention_by(lf, budget), _retention_by(tf, budget)
        for p in pols:
            pairs = [(lc[k], tc[k]) for k in sorted(lc) if k[0] == p and k in tc]
            if not pairs:
                continue
            m = {k: (statistics.fmean(x[k] for x, _ in pairs), statistics.fmean(y[k] for _, y in pairs))
                 for k in ("answer_nll_increase", "answer_top1_agreement", "answer_kl")}
            name = p if tau == 16 or p != "epikv" else f"epikv@tau={tau}"
            means[name] = m["answer_nll_increase"]
            nll, top1, kl = m["answer_nll_increase"], m["answer_top1_agreement"], m["answer_kl"]
            rows.append([name, tau, len(pairs), f"{nll[0]:+.3f}", f"{nll[1]:+.3f}", f"{nll[0] - nll[1]:+.3f}",
                         f"{100 * top1[0]:.1f} %", f"{100 * top1[1]:.1f} %", f"{kl[0]:.3f}", f"{kl[1]:.3f}"])
    head = ["policy", "tau", "traces", "answer-NLL increase, llama.cpp", "torch", "difference", "top-1, llama.cpp",
            "torch", "answer KL, llama.cpp", "torch"]
    ev = [p for p in means if p != "full"]
    order_l = sorted(ev, key=lambda p: means[p][0])
    order_t = sorted(ev, key=lambda p: means[p][1])
    worst = max(abs(means[p][0] - means[p][1]) for p in means)
    partial = len({r[2] for r in rows}) > 1
    return (table(head, rows) + f"\n\nK = {budget}, paired by trace, each engine against its own full cache. "
            f"Order by answer-NLL increase: llama.cpp {', '.join(order_l)}; torch {', '.join(order_t)} "
            f"({'the same' if order_l == order_t else 'different'}); the largest difference between the engines is "
            f"{worst:.3f} nats/token."
            + (" The rows cover different numbers of traces (a run not finished): the order across them compares "
               "the engines, not the policies." if partial else "") + "\n\n"
            + source_line(files, "bash benchmarks/results/llamacpp/retention/run.sh; "
                                 "bash benchmarks/results/llamacpp/retention-seg/run.sh (the torch rows: "
                                 "benchmarks/results/retention-full/run.sh A, C)"))


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _ratio(a: float, b: float) -> str:
    """a / b as printed beside the two rates: computed from the values shown (rounded as shown), never read from a
    stored ratio, so a rate edited in the raw file moves its ratio too."""
    return f"{round(a, 2) / round(b, 2):.2f}x"


def _fair_headline(rows: list[dict], first_run: list[dict] | None = None) -> list[str]:
    """The README's llama-server row: each epikv row's tokens/s against llama-server's given every cell, the median
    of ratios paired by repeat, per length; the KV bytes where the row holds fewer; the CPU and threads."""
    med = _fair().medians(rows)
    parts = []
    for tokens, per in med.items():
        rs = []
        for name, m in per.items():
            # the yardstick itself is not a row; its context-shift rows are (llama.cpp's own bounded-memory answer,
            # beside epikv's evicting rows at equal cells)
            if name.split("@fa-")[0] == "llama-server" or not m["ratios"]:
                continue
            # every row's KV fraction, above 1 too (issue 58: K = 512 and 1,024 at 8 x 1,024 hold more than llama-server)
            kv = f" on {100 * m['kv_fraction']:.0f} % of llama-server's KV bytes" if m.get("kv_fraction") else ""
            ci = f" [95 %: {m['ci'][0]:.2f}-{m['ci'][1]:.2f}]" if m.get("schema", 1) >= 2 and m.get("ci") else ""
            fa = f" (flash attention {m['flash_attn']})" if m.get("flash_attn", "off") != "off" else ""
            rs.append(f"{m['label'].removeprefix('epikv ')}{fa} {statistics.median(m['ratios']):.2f}x{ci}{kv}")
        n = min(m["repeats"] for name, m in per.items() if not name.startswith("llama-server-shift"))  # rows stated
        parts.append(f"{rows[0]['sequences']} x {tokens:,} tokens ({n} repeats): " + ", ".join(rs))
    if first_run:  # a length measured again later: the first run's context-shift row beside its own epikv rows
        parts.append("the first run at the same length, with its context-shift row: "
                     + _fair_headline(first_run)[1].split(": ", 1)[1])
    cpu = rows[0]["cpu"]
    return [f"`epikv serve --engine llama.cpp` beside llama.cpp's own `llama-server`, {rows[0]['sequences']} requests "
            f"at once ({_threads(rows[0]['threads'])}, {cpu['model']}, {cpu['cores']} cores)",
            "tokens/s against llama-server given every cell, medians of interleaved repeats: " + "; ".join(parts),
            "[serving](docs/benchmarks.md#interleaved-repeats)"]


def _fair_default_headline() -> list[str]:
    """The README's row for issue 58's fair run of the default: one code version, flash attention as llama-server
    runs it, paired intervals, the context-shift row on the default's own cells."""
    what, measured, link = _fair_headline(load_jsonl(FAIR_DEFAULT))
    return [what.replace("beside llama.cpp's own `llama-server`", "with the default policy, beside llama.cpp's own "
                         "`llama-server` (one code version, every buffer counted)"), measured,
            "[serving](docs/benchmarks.md#the-default-against-llama-server-and-context-shift)"]


# the default policy's newest single-sequence step measurement (its code version: issue 50's one-layer mirror)
DEFAULT_STEP = "llamacpp/step-learned-decay.json"  # the default's step as it ships (tau 16, every block's hidden state)


def _whole_headline() -> list[str]:
    """The README's row for issue 57's run: the default against random and streaming at K = 1,024, through llama.cpp."""
    from epikv.policies import DEFAULT_POLICY

    mod = _bench_module("whole_traces")
    s = mod.summarise({e: mod.load(e, RESULTS) for e in mod.SOURCES})
    row = next(r for r in s["rows"] if (r["engine"], r["policy"], r["budget"]) == ("llama.cpp", DEFAULT_POLICY, 1024))
    r, st = row["vs"]["random"], row["vs"]["streaming"]
    return [f"retention on whole reasoning traces through llama.cpp, K = 1024 (answer NLL against random eviction "
            "and against streaming)",
            f"the default `{DEFAULT_POLICY}` {r['mean']:+.3f} nats/token against random (better on {r['wins']} of "
            f"{r['n']}), {st['mean']:+.3f} against streaming ({st['wins']} of {st['n']})",
            "[choosing a policy](docs/choosing.md#scores-that-age-on-whole-traces-through-llamacpp)"]


def headline() -> str:
    """The README's few headline figures, each from its raw file, each linking to its page."""
    inter = load_json("llamacpp/interleaved.json")
    step = load_json(DEFAULT_STEP)
    from epikv.policies import DEFAULT_POLICY

    step.setdefault("policy", "epikv")  # files before --policy measured the flat score
    if step["policy"] != DEFAULT_POLICY:  # the row states the default's step cost, not another policy's
        raise RenderError(f"benchmarks/results/{DEFAULT_STEP} measured {step['policy']}, not the default "
                          f"{DEFAULT_POLICY}: measure the default's step and point DEFAULT_STEP at it")
    srv = _streams_rows()
    fair_rows = _fair_latest()
    win = _window(list(srv.values()))
    w = {k: _in_window(r, win) for k, r in srv.items()}
    _, cells = _retention_records()
    long8k = load_json("bench/long_smollm2_8192_cpu.json")

    long_rows = load_json("llamacpp/long.json")["rows"]
    long_ep = next(r for r in long_rows if (r["engine"], r["policy"]) == ("llama.cpp", "epikv"))["segments_tok_s"]
    long_pl = next(r for r in long_rows if (r["engine"], r["policy"]) == ("llama.cpp", "full"))["segments_tok_s"]
    long_d = load_json("llamacpp/long.json")
    if len(inter.get("repeats") or []) < 2 and (long_d["segment"], len(long_ep)) != (
            inter["segment"], inter["gen"] // inter["segment"]):  # one run: long.json is cited beside it
        raise RenderError("llamacpp/long.json and interleaved.json time different segments: no like-for-like ratio")
    seg = inter["segments_tok_s"]
    ep_v = next(v for k, v in seg.items() if k.startswith("epikv"))
    pl_v = next(v for k, v in seg.items() if not k.startswith("epikv"))
    held = next(r for r in step["rows"] if r["config"].startswith(f"{step['policy']} llama.cpp (C"))

    def paired(p, k=1024):
        mine, ref = cells[(p, k)], cells[("random", k)]
        both = sorted(set(mine) & set(ref))
        return statistics.fmean(mine[t] - ref[t] for t in both), sum(mine[t] < ref[t] for t in both), len(both)

    e_d, e_w, e_n = paired("epikv")
    q_d, q_w, q_n = paired("epikv-seg-q")
    last = {p["policy"]: p for p in long8k["long"] if p["status"] == "ok" and p["generated"] == max(
        q["generated"] for q in long8k["long"] if q["status"] == "ok")}
    rows = [
        [f"llama.cpp, {inter['gen']:,}-token generation (SmolLM2 Q4_1, CPU, {_threads(inter['threads'])})",
         f"tokens {inter['gen'] - inter['segment'] + 1}-{inter['gen']}: {ep_v[-1]:.2f} tok/s with "
         f"`{inter.get('policy', 'epikv')}` at K = {inter['budget']} against {pl_v[-1]:.2f} with the whole cache "
         + (f"({_ratio(ep_v[-1], pl_v[-1])}; one run on {inter['cpus']} shared cores: another, `long.json`, measured "
            f"{_ratio(long_ep[-1], long_pl[-1])})" if len(inter.get("repeats") or []) < 2 else
            f"({_ratio(ep_v[-1], pl_v[-1])}; medians of {len(inter['repeats'])} interleaved repeats, load "
            f"{max(r['load_before'][0] for r in inter['repeats']):.2f} or less before each)"),
         "[llama.cpp engine](docs/llamacpp.md#speed)"],
        [f"llama.cpp, cost of an evicting step of the default `{step['policy']}` (K = {step['budget']}, "
         f"{_threads(step['threads'])}, load {step['load_average'][0]:.2f})",
         f"{held['time_vs_plain_held']:.3f}x the time of plain llama.cpp held at the same cache size"
         + (f" (median of {len(step['repeats'])} repeats, {min(held['time_vs_plain_held_repeats']):.3f} to "
            f"{max(held['time_vs_plain_held_repeats']):.3f})" if len(step.get("repeats") or []) > 1 else ""),
         "[llama.cpp engine](docs/llamacpp.md#speed)"],
        [f"`epikv serve --engine llama.cpp`, {srv['streams']['requests']} x {srv['streams']['max_tokens']:,} tokens, "
         f"K = {srv['streams']['budget']}, a KV stream per sequence ({_threads(srv['streams']['server']['threads'])})",
         f"{w['streams']:.1f} tok/s over the first {win} s: {w['streams'] / w['torch']:.2f}x the torch server and "
         f"{w['streams'] / w['unified']:.2f}x llama.cpp's unified cache, at equal KV bytes",
         "[serving](docs/benchmarks.md#both-engines-one-load)"],
        _fair_headline(fair_rows, [r for r in load_jsonl(FAIR) if r["tokens"] in {x["tokens"] for x in
                                                                           load_jsonl(FAIR_4096)}]),
        _fair_default_headline(),
        [f"torch engine, generation to {max(long8k['settings']['long_lengths']) + long8k['settings']['prompt_tokens']:,}"
         " positions (SmolLM2, CPU)",
         f"last segment: {last['epikv']['segment_tokens_per_s']:.2f} tok/s at K = {last['epikv']['budget']} against "
         f"{last['full']['segment_tokens_per_s']:.2f} for the whole cache",
         "[benchmarks](docs/benchmarks.md#generation-to-the-context-limit-torch-engine)"],
        _whole_headline(),
        [f"retention on {e_n} whole reasoning traces through torch, K = 1024 (answer NLL vs random eviction)",
         f"`epikv` {e_d:+.3f} nats/token (better on {e_w} of {e_n}); `epikv-seg-q` {q_d:+.3f} ({q_w} of {q_n})",
         "[choosing a policy](docs/choosing.md#what-the-whole-trace-retention-run-says)"],
    ]
    files = ["llamacpp/interleaved.json", "llamacpp/long.json", DEFAULT_STEP, *STREAMS.values(), FAIR,
             FAIR_4096, FAIR_DEFAULT, "bench/long_smollm2_8192_cpu.json", "retention-full/tau16/results.jsonl",
             "retention-full/tau128/results.jsonl"]
    dates = sorted({committed(f) for f in files})
    return (table(["what", "measured", "details"], rows)
            + f"\n\nRendered by `python benchmarks/render.py` from `benchmarks/results/` (raw files committed "
            f"{dates[0]} to {dates[-1]}); each page names its file and command.")


# ---------------------------------------------------------------------------------------- parsers and registry


def _escape(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _sub(parser: argparse.ArgumentParser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a
    return None


def _command_parser(path: list[str]) -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT / "src"))
    from epikv.cli import build_parser

    p = build_parser()
    for word in path:
        sub = _sub(p)
        if sub is None or word not in sub.choices:
            raise RenderError(f"render:cli:{' '.join(path)}: `epikv` has no command {' '.join(path)}")
        p = sub.choices[word]
    return p


def _option_rows(p: argparse.ArgumentParser) -> list[list[str]]:
    rows = []
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if a.option_strings:
            name = ", ".join(f"`{o}`" for o in a.option_strings)
            if a.nargs != 0:
                meta = a.metavar or ("{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.dest.upper())
                name += f" `{meta if isinstance(meta, str) else ' '.join(meta)}`"
        else:
            name = f"`{a.metavar or a.dest}` (positional)"
        default = "" if a.default in (None, argparse.SUPPRESS) or a.nargs == 0 else f"`{a.default}`"
        if a.required and a.option_strings:
            default = "required"
        help_text = (a.help or "") if a.help != argparse.SUPPRESS else ""
        try:
            help_text = help_text % {**vars(a), "default": a.default, "prog": p.prog}
        except (KeyError, TypeError, ValueError):
            pass
        rows.append([name, default, _escape(help_text)])
    return rows


def cli(path: list[str]) -> str:
    p = _command_parser(path)
    sub = _sub(p)
    out = []
    if p.description:
        out.append(_escape(p.description) + "\n")
    if sub is not None:
        helps = {c.dest: c.help for c in sub._choices_actions}
        out.append(table(["subcommand", "what it does"],
                         [[f"`epikv {' '.join(path)} {n}`", _escape(helps.get(n, ""))] for n in sub.choices]) + "\n")
    rows = _option_rows(p)
    if rows:
        out.append(table(["option", "default", "help"], rows) + "\n")
    out.append(f"Rendered by `python benchmarks/render.py` from `epikv {' '.join(path)} --help`'s parser.")
    return "\n".join(out)


def policies() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "epikv.cli", "policies", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=_env())
    if r.returncode != 0:
        raise RenderError(f"`epikv policies --json` failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    items = json.loads(r.stdout)
    items = items if isinstance(items, list) else items.get("policies", items)
    rows = []
    for it in items:
        doc = (it.get("doc") or "").strip().splitlines()
        tau = (it.get("defaults") or {}).get("tau")
        rows.append([f"`{it['name']}`", "yes" if it.get("attention_free") else "no", it.get("granularity", ""),
                     _escape(it.get("observes", "")), "" if tau is None else str(tau), _escape(doc[0] if doc else ""),
                     _escape(it.get("paper") or "")])
    return table(["policy", "attention-free", "keep sets", "observes (30-block model)", "default tau", "what it does",
                  "from"], rows) + \
        "\n\nRendered by `python benchmarks/render.py` from `epikv policies --json` (the registry, no plugins)."


def policy_matrix() -> str:
    """Policy x entry point, from the registry and each engine's own refusal check (epikv.support), the default of
    each entry point marked; refused cells point at the engine's message."""
    sys.path.insert(0, str(ROOT / "src"))
    from epikv.policies import REGISTRY, default_policy, get_policy
    from epikv.support import ENTRY_POINTS

    notes: list[str] = []
    rows = []
    for name in REGISTRY:
        pol = get_policy(name)
        kernel = "no: eager attention" if pol.observes(32).attention_layers else "yes"
        row = [f"`{name}`", kernel]
        for e in ENTRY_POINTS:
            why = e.refusal(pol)
            if why is None:
                row.append("**yes, default**" if e.has_default and default_policy(e.key) == name else "yes")
                continue
            why = re.sub(r" \((supported|served policies)[^)]*\)$", "", why.replace(f"policy {name} ", "the policy "))
            why = re.sub(r"\s+\(.*?\)", "", why) if len(why) > 240 else why
            if why not in notes:
                notes.append(why)
            row.append(f"no [{notes.index(why) + 1}]")
        rows.append(row)
    head = ["policy", "attention kernel untouched"] + [e.label for e in ENTRY_POINTS]
    return (table(head, rows) + "\n\nRefused, in the engine's own words:\n\n"
            + "\n".join(f"{i}. {_escape(n)}" for i, n in enumerate(notes, 1))
            + "\n\nRendered by `python benchmarks/render.py` from the registry and the engines' refusal checks "
              "(`epikv.support`); **default**: the policy the entry point runs when none is named "
              "(`epikv.policies.default_policy`).")


def serve_fields() -> str:
    """The request fields `epikv serve` accepts, from the sets its parser checks against and their notes."""
    sys.path.insert(0, str(ROOT / "src"))
    from epikv.serving import app

    names = sorted(app._COMPLETION_FIELDS | app._CHAT_FIELDS, key=lambda n: (app.FIELD_NOTES.get(n, ("?",))[0] != "openai", n))
    missing = [n for n in names if n not in app.FIELD_NOTES]
    if missing:
        raise RenderError(f"epikv.serving.app.FIELD_NOTES has no note for accepted field(s) {', '.join(missing)}")
    rows = [[f"`{n}`", "yes" if n in app._COMPLETION_FIELDS else "-", "yes" if n in app._CHAT_FIELDS else "-",
             app.FIELD_NOTES[n][0], _escape(app.FIELD_NOTES[n][1])] for n in names]
    return (table(["field", "/v1/completions", "/v1/chat/completions", "kind", "here"], rows)
            + "\n\nAny other field is refused: 400 with an OpenAI-style error naming it (a silently ignored option "
              "would be a wrong answer). Rendered by `python benchmarks/render.py` from `epikv.serving.app`'s field "
              "sets and `FIELD_NOTES`.")


def _env() -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k != "EPIKV_POLICIES"}  # the registry as shipped, no plugins
    env["PYTHONPATH"] = str(ROOT / "src") + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def calibrate_speed() -> str:
    """docs/policies.md: `epikv calibrate` through llama.cpp against transformers, from the interleaved rows."""
    f = "calibrate-speed/speed.json"
    d = json.loads((RESULTS / f).read_text(encoding="utf-8"))
    rows = [[f"{r['max_tokens']:,}", r["texts"], f"{r['torch_s_per_text']:.2f}", f"{r['llama_cpp_s_per_text']:.2f}",
             f"{r['llama_cpp_over_torch']:.2f}x"] for r in d["summary"]]
    return (table(["tokens a text", "texts", "transformers s / text", "llama.cpp s / text", "llama.cpp / transformers"],
                  rows)
            + f"\n\nMedians of {max(r['round'] for r in d['runs']) + 1} interleaved rounds, one thread each, "
              f"{d['cpu']} ({d['cpus']} cores), the fit loop of a fresh `epikv calibrate` on the embedded SmolLM2.\n\n"
            + source_line([f], d["command"]))


RENDERERS = {
    "calibrate-speed": calibrate_speed,
    "headline": headline,
    "retention-vs-random": retention_vs_random,
    "default-whole-traces": default_whole_traces,
    "retention-attnfree": retention_attnfree,
    "whole-traces": whole_traces,
    "llamacpp-step": llamacpp_step,
    "llamacpp-capture": llamacpp_capture,
    "llamacpp-celltypes": llamacpp_celltypes,
    "llamacpp-long": llamacpp_long,
    "llamacpp-interleaved": llamacpp_interleaved,
    "serve-streams": serve_streams,
    "llamacpp-retention": llamacpp_retention,
    "serve-llama-server": serve_llama_server,
    "serve-llama-server-fair": serve_llama_server_fair,
    "equal-bytes": equal_bytes,
    "serve-llama-server-fair-4096": serve_llama_server_fair_4096,
    "serve-llama-server-fair-default": serve_llama_server_fair_default,
    "serve-profile": serve_profile,
    "llamacpp-step-seg-q-issue50": lambda: llamacpp_step("llamacpp/step-seg-q-issue50.json"),
    "llamacpp-step-seg-q-issue56": lambda: llamacpp_step("llamacpp/step-seg-q-issue56.json"),
    "llamacpp-step-learned-decay": lambda: llamacpp_step("llamacpp/step-learned-decay.json"),
    "llamacpp-split-learned-decay": lambda: llamacpp_split(["llamacpp/split-learned-decay-before.json",
                                                            "llamacpp/split-learned-decay.json"]),
    "serve-ab-issue50": serve_ab,
    "soak": soak,
    "serve-load": serve_load,
    "serve-fuzz": serve_fuzz,
    "serve-h200": serve_h200,
    "serve-sampled": serve_sampled,
    "bench-long": bench_long,
    "bench-overhead": bench_overhead,
    "pages": pages_cost,
    "bench-memory": bench_memory,
    "bench-throughput": bench_throughput,
    "serve-equal-batch": serve_equal_batch,
    "policies": policies,
    "policy-matrix": policy_matrix,
    "serve-fields": serve_fields,
}


def render_block(name: str) -> str:
    if name.startswith("cli:"):
        return cli(name[4:].split(".")) if name != "cli:" else cli([])
    if name == "cli":
        return cli([])
    if name not in RENDERERS:
        raise RenderError(f"unknown block render:{name} (known: {', '.join(RENDERERS)}, cli, cli:COMMAND)")
    return RENDERERS[name]()


def render_page(text: str, page: str, cache: dict) -> str:
    opened = OPEN.findall(text)
    closed = re.findall(r"<!-- /render:([\w:.-]+) -->", text)
    if sorted(opened) != sorted(closed):
        raise RenderError(f"{page}: unbalanced render markers ({len(opened)} open, {len(closed)} closed)")

    def sub(m):
        name = m.group("name")
        if name not in cache:
            cache[name] = render_block(name)
        return f"<!-- render:{name} -->\n{cache[name]}\n<!-- /render:{name} -->"

    out = MARKER.sub(sub, text)
    if len(MARKER.findall(out)) != len(opened):
        raise RenderError(f"{page}: a render marker is nested or malformed")
    return out


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


FIGURE_SOURCE = "llamacpp/interleaved.json"  # the file the README's caption names
FIGURE_KEY = "epikv-data"  # the PNG text chunk that says which raw file (and which bytes) a figure was drawn from


def _stamp(rel: str) -> str:
    import hashlib

    return f"benchmarks/results/{rel} sha256:{hashlib.sha256(raw(rel).read_bytes()).hexdigest()}"


def figure_problem(png: Path = FIGURE, rel: str = FIGURE_SOURCE) -> str | None:
    """Why the figure does not show the raw file its caption names (None when it does): the stamp figure() writes
    into the PNG must name that file and its current bytes, so a figure drawn from another or an older file fails."""
    from PIL import Image

    if not png.is_file():
        return f"{png.relative_to(ROOT) if png.is_relative_to(ROOT) else png} is missing"
    with Image.open(png) as im:
        got = (getattr(im, "text", None) or {}).get(FIGURE_KEY)
    want = _stamp(rel)
    if got != want:
        name = png.relative_to(ROOT) if png.is_relative_to(ROOT) else png
        return f"{name} was drawn from {got or 'an unstamped source'}, not {want}: run python benchmarks/render.py --figure"
    return None


def figure(out: Path = FIGURE, rel: str = FIGURE_SOURCE) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = load_json(rel)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for name, v in d["segments_tok_s"].items():
        xs = [(i + 1) * d["segment"] for i in range(len(v))]
        label = f"{name}, K = {d['budget']}" if name.startswith("epikv") else name
        ax.plot(xs, v, marker="o", label=label)
    ax.set_xlabel(f"generated tokens (end of each {d['segment']:,}-token segment)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"SmolLM2-135M Q4_1 in llama.cpp, {_threads(d['threads'])} ({Path(rel).name})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Software": None, FIGURE_KEY: _stamp(rel)})
    plt.close(fig)
    return out


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"render.py: {message}\n")


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description="Render the generated blocks of README.md and docs/*.md from their sources.")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each page that differs")
    ap.add_argument("--figure", action="store_true", help="also redraw docs/img/long-generation.png")
    ap.add_argument("pages", nargs="*", help="pages to render (default: README.md and docs/**/*.md)")
    args = ap.parse_args(argv)
    try:
        targets = [Path(p).resolve() for p in args.pages] or pages()
        for t in targets:
            if not t.is_file():
                raise RenderError(f"no such page: {t}")
        cache: dict[str, str] = {}
        stale = []
        for t in targets:
            try:
                text = t.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise RenderError(f"{t} is not UTF-8") from None
            new = render_page(text, str(t.relative_to(ROOT) if t.is_relative_to(ROOT) else t), cache)
            # a shallow clone cannot date the raw files: --check then compares everything but the dates
            if new != text and not (args.check and shallow() and DATE.sub("D", new) == DATE.sub("D", text)):
                stale.append(t)
                if not args.check:
                    t.write_text(new, encoding="utf-8")
        if args.figure and not args.check:
            figure()
        if args.check and not args.pages and (why := figure_problem()):
            stale.append(FIGURE)
            print(f"render.py: {why}", file=sys.stderr)
    except RenderError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2
    if args.check and stale:
        print("render.py: stale generated blocks in " + ", ".join(str(s.relative_to(ROOT)) for s in stale)
              + ": run python benchmarks/render.py", file=sys.stderr)
        return 1
    for s in stale:
        print(f"rendered {s.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
