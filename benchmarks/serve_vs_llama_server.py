"""`epikv serve --engine llama.cpp` against llama.cpp's own `llama-server`, fair by construction (issue 50).

Both servers are started by this script the same way and loaded by the same client (`epikv bench serve --url`: 8
MATH-500 chat requests at once, templated prompt <= 160 tokens, greedy, forced length). Same GGUF (the embedded
SmolLM2 Q4_1), same llama.cpp (the source llama-cpp-python vendors, built by benchmarks/build_llama_server.sh),
2 threads, 256-token batches, F16 K and V and flash attention given explicitly to both (`-fa`, `-ctk/-ctv`; epikv
`--flash-attn`, F16 its only KV type). --flash-attn takes off, on and auto (llama-server's default), one or several:
every row runs once for each, and is paired only with llama-server rows of the same setting. Each repeat runs every
row once, llama-server and epikv rows alternating, in reverse order on odd repeats; each row records its flash
attention, the machine's load before it, the CPU model and SIMD flags, `llama-server --version`, epikv's commit, the
server's peak RSS (VmHWM), its KV cells and bytes, tokens/s over the run and per quarter of its tokens, and time to
first token. Resumable: a (length, row, flash attention, repeat) already in results.jsonl is skipped.

KV bytes: llama-server's are its cells (it keeps nothing else per sequence). epikv's are its cells plus every buffer
its sequences keep for the policy, as the server measured them on its arrays at every step (`/stats`'
kv_bytes_with_buffers_peak: the most held at once of the key/value mirror, the rows waiting for their statistic, the
query window, the scores and the policy's state, by kind in buffer_peak_bytes); rows of this version say so
("kv_counts": "cells+buffers"). Older files counted the mirror alone (polled once a second), and render as such.

The summary gives each ratio to llama-server (and to `--context-shift` at equal cells) as the median of the ratios
paired by repeat (each row over the llama-server row of its own repeat) with a 95 % t interval over the logs of those
per-repeat ratios (`interval95`: ratios multiply, so their logs are the scale on which a mean and a symmetric
interval make sense, and a t interval is honest about 5 repeats, where a percentile bootstrap has only 126 distinct
resamples and comes out too narrow).

Rows (--rows, comma-separated):
  llama-server      llama-server given every cell its requests need (--parallel 8, 8 slots of prompt + tokens)
  llama-server-shift llama-server with --context-shift on the cells an epikv stream holds (--shift-cells)
  llama-server-shift@POLICY:K  llama-server with --context-shift on exactly the cells a stream of the row POLICY:K
                    holds (K + tau - 1 + a 256-token chunk, rounded up to 256 as llama.cpp does: its peak, as the
                    stream is allocated whole); epikv's row is paired with it by repeat
  full              epikv `full` on 8 streams of every cell its requests need
  POLICY:K          epikv POLICY at budget K on 8 streams (cells derived by epikv serve)

  PYTHONPATH=src .venv/bin/python benchmarks/serve_vs_llama_server.py run --tokens 1024 --flash-attn off,auto \
      --rows llama-server,full,epikv-seg-q:256,llama-server-shift@epikv-seg-q:256 --out DIR
  PYTHONPATH=src .venv/bin/python benchmarks/serve_vs_llama_server.py summary --out DIR   # writes DIR/summary.md
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SEQUENCES = 8
PROMPT_TOKENS = 160  # --max-prompt-tokens: the longest templated prompt of the 8 requests
BATCH = 256
THREADS = 2
FLASH = ("off", "on", "auto")
SHIFT_AT = "llama-server-shift@"
SCHEMA = 2  # rows with per-row flash attention, equal-cell context-shift rows and 95 % intervals in the summary
KV_COUNTS = "cells+buffers"  # an epikv row's KV bytes: its cells and every buffer (older rows: cells and the mirror)
# t(0.975, df) for df = 1..30; past 30, the Cornish-Fisher expansion below is within 0.001 of it
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def fail(msg: str) -> None:
    print(f"serve_vs_llama_server: {msg}", file=sys.stderr)
    sys.exit(2)


def round_up(n: int, k: int = 256) -> int:
    return -(-n // k) * k


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu() -> dict:
    info = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    simd = sorted(f for f in (flags.group(1).split() if flags else []) if re.match(r"(avx|fma|f16c|sse4|amx)", f))
    return {"model": model.group(1).strip() if model else "?", "cores": os.cpu_count(), "simd": simd}


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


@functools.lru_cache(maxsize=None)
def gguf() -> str:
    from epikv.models import _GGUF_NAME, _gguf_folder

    return str(_gguf_folder() / _GGUF_NAME)


def peak_rss_mib(pid: int) -> float | None:
    try:
        m = re.search(r"^VmHWM:\s*(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
        return int(m.group(1)) / 1024 if m else None
    except OSError:
        return None


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server was not healthy in time")


def stream_cells(policy: str, k: int) -> int:
    """The cells `epikv serve --kv streams` gives a stream of POLICY at budget K (derived as the engine does)."""
    from epikv.policies import get_policy

    return round_up(k + get_policy(policy).tau - 1 + BATCH)


def row_spec(name: str, tokens: int, shift_cells: int, flash: str, llama_server: str, cache: str = "f16") -> dict:
    """How to start the server of one row: argv, label, and what is fixed about its cells (cache: both servers' K and
    V cell type, llama.cpp's names)."""
    every = round_up(PROMPT_TOKENS + tokens)  # a slot / stream that holds its request whole
    fa = ["-fa", flash, "-ctk", cache, "-ctv", cache]
    common_ls = [llama_server, "-m", gguf(), "--parallel", str(SEQUENCES), "-t", str(THREADS), "-tb", str(THREADS),
                 "-b", str(BATCH), "-ub", str(BATCH), "--host", "127.0.0.1", "--no-webui", *fa]
    epikv = [PY, "-m", "epikv.cli", "serve", "--engine", "llama.cpp", "--model", "smollm2", "--host", "127.0.0.1",
             "--sequences", str(SEQUENCES), "--kv", "streams", "--threads", str(THREADS), "--max-batch-tokens",
             str(BATCH), "--flash-attn", flash, "--max-tokens", str(tokens), "--cache-type-k", cache,
             "--cache-type-v", cache]
    if name == "llama-server":
        return {"label": name, "server": "llama-server", "argv": common_ls + ["-c", str(SEQUENCES * every)],
                "cells_per_sequence": every}
    if name == "llama-server-shift":
        return {"label": f"llama-server --context-shift ({shift_cells} cells)", "server": "llama-server",
                "argv": common_ls + ["-c", str(SEQUENCES * shift_cells), "--context-shift"],
                "cells_per_sequence": shift_cells}
    if name == "full":
        return {"label": "epikv full", "server": "epikv", "argv": epikv + ["--policy", "full", "--ctx",
                                                                            str(SEQUENCES * every)],
                "cells_per_sequence": every}
    if name.startswith(SHIFT_AT):
        policy, _, k = name.removeprefix(SHIFT_AT).partition(":")
        if not k.isdigit() or int(k) < 1:
            fail(f"row {name!r}: give {SHIFT_AT}POLICY:K, the epikv row whose cells it takes")
        try:
            cells = stream_cells(policy, int(k))
        except Exception as e:  # an unknown policy: its own message, in one line
            fail(f"row {name!r}: {e}")
        return {"label": f"llama-server --context-shift at {policy} K={k}'s cells ({cells})", "server": "llama-server",
                "argv": common_ls + ["-c", str(SEQUENCES * cells), "--context-shift"], "cells_per_sequence": cells,
                "equal_cells_to": name.removeprefix(SHIFT_AT)}
    policy, _, k = name.partition(":")
    if not k.isdigit():
        fail(f"row {name!r}: give llama-server, llama-server-shift, full or POLICY:K")
    return {"label": f"epikv {policy} K={k}", "server": "epikv",
            "argv": epikv + ["--policy", policy, "--budget", k], "cells_per_sequence": None}


_PER_CELL: list[int] = []


CACHE = ["f16"]  # the run's --cache-type (main sets it)


def kv_bytes_per_cell() -> int:
    """K and V bytes of one cell at the run's cell type over every layer of the GGUF, as llama.cpp allocates them
    (the figure epikv's /stats reports for its own cells); llama-server's log does not print its KV size at the
    default verbosity."""
    if not _PER_CELL:
        from epikv.llamacpp.model import load_gguf

        _PER_CELL.append(load_gguf("smollm2").kv_bytes_per_cell(CACHE[0]))
    return _PER_CELL[0]


def kv_of_llama_server(log: str) -> dict:
    """Cells and KV bytes from llama-server's log line `n_slots = 8, n_ctx_slot = N, kv_unified = ...`."""
    m = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'", log)
    if not m:
        return {"kv_mib": None, "cells": None, "kv_unified": None}
    cells = int(m.group(1)) * int(m.group(2))
    return {"kv_mib": round(cells * kv_bytes_per_cell() / 2**20, 1), "cells": cells,
            "cells_per_sequence": int(m.group(2)), "kv_unified": m.group(3)}


def flash_settings(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(x not in FLASH for x in out):
        fail(f"--flash-attn {text!r}: give one or more of {', '.join(FLASH)}, comma-separated")
    return list(dict.fromkeys(out))


def order(specs: dict[str, dict], flashes: list[str], repeat: int) -> list[tuple[str, str]]:
    """(row, flash attention) in the order one repeat runs them: llama-server and epikv rows alternating, one flash
    setting after the other, the whole order backwards on odd repeats."""
    lsr = [n for n in specs if specs[n]["server"] == "llama-server"]
    epr = [n for n in specs if specs[n]["server"] == "epikv"]
    names = []
    for i in range(max(len(lsr), len(epr))):
        names += lsr[i:i + 1] + epr[i:i + 1]
    out = [(n, fa) for fa in flashes for n in names]
    return out if repeat % 2 == 0 else out[::-1]


def run_row(spec: dict, tokens: int, logdir: Path, tag: str) -> dict:
    port = free_port()
    argv = spec["argv"] + ["--port", str(port)]
    log = logdir / f"{tag}.log"
    load = os.getloadavg()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    out = Path(tempfile.mkdtemp(prefix="epikv-fair-"))
    try:
        wait_health(url, proc)
        client = [PY, "-m", "epikv.cli", "bench", "serve", "--model", "smollm2", "--max-batch-tokens", str(BATCH),
                  "--requests", str(SEQUENCES), "--concurrency", str(SEQUENCES), "--max-prompt-tokens",
                  str(PROMPT_TOKENS), "--threads", str(THREADS), "--timeout", "7200", "--max-tokens", str(tokens),
                  "--policies", "full", "--url", url, "--label", spec["label"], "--out", str(out)]
        peaks = {"cells_in_use": 0}
        stop = threading.Event()

        def poll():  # epikv's cells in use are a figure of the running sequences: its peak
            while spec["server"] == "epikv" and not stop.wait(1.0):
                try:
                    with urllib.request.urlopen(url + "/stats", timeout=5) as s:
                        eng = json.loads(s.read()).get("engine") or {}
                except (OSError, ValueError):
                    continue
                for k in peaks:
                    peaks[k] = max(peaks[k], eng.get(k) or 0)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            r = subprocess.run(client, env=env, cwd=ROOT, capture_output=True, text=True)
        finally:
            stop.set()
            poller.join()
        if r.returncode != 0:
            raise RuntimeError(f"the client failed: {r.stderr.strip().splitlines()[-1:]}")
        res = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines() if x.strip()][-1]
        stats = None
        if spec["server"] == "epikv":
            with urllib.request.urlopen(url + "/stats", timeout=10) as s:
                stats = json.loads(s.read())
        rss = peak_rss_mib(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)
    text = log.read_text(errors="replace")
    model = gguf()
    row = {"label": spec["label"], "server": spec["server"], "argv": [a for a in argv if a != model],
           "load_before": [round(x, 2) for x in load], "peak_rss_mib": rss,
           **{k: res.get(k) for k in ("tokens_per_s", "generated_tokens", "wall_s", "ttft_p50_s", "ttft_p95_s",
                                      "completed", "failed", "errors", "tokens_by_second")}}
    row["quarters"] = quarters(res.get("tokens_by_second") or [])
    if spec["server"] == "llama-server":
        row.update({"cells_per_sequence": spec["cells_per_sequence"], **kv_of_llama_server(text)})
    else:
        eng = (stats or {}).get("engine") or {}
        row.update(**epikv_kv(eng), peak_cells_in_use=peaks["cells_in_use"],
                   cells=eng.get("cells_allocated"),
                   cells_per_sequence=eng.get("stream_cells"), evictions=eng.get("evictions"),
                   llama_cpp=(stats or {}).get("server", {}).get("llama_cpp"))
    return row


def epikv_kv(eng: dict) -> dict:
    """An epikv row's KV figures from its server's final `/stats` ("engine"): kv_mib the cells' bytes plus the most
    its sequences' buffers held at once (kv_bytes_with_buffers_peak), with the parts (cells, buffers, by kind)."""
    buffers = eng.get("buffer_peak_bytes")
    if not buffers or eng.get("kv_bytes_with_buffers_peak") is None:
        raise RuntimeError("epikv's /stats gives no buffer_peak_bytes / kv_bytes_with_buffers_peak")
    kv = eng.get("kv_bytes") or 0
    return {"kv_mib": round(eng["kv_bytes_with_buffers_peak"] / 2**20, 1), "kv_cells_mib": round(kv / 2**20, 1),
            "kv_buffers_peak_mib": round(buffers["total"] / 2**20, 1), "kv_buffer_peak_bytes": buffers,
            "kv_mirror_peak_mib": round(buffers.get("mirror", 0) / 2**20, 1), "kv_counts": KV_COUNTS}


def quarters(by_second: list[int]) -> list[float | None]:
    """Tokens/s over each quarter of the row's tokens: the time the running count takes to pass each quarter
    (whole-second resolution, as the client counts)."""
    total = sum(by_second)
    if total == 0:
        return []
    out, t_prev, acc, q = [], 0.0, 0, 1
    for sec, n in enumerate(by_second):
        while n and acc + n >= q * total / 4 and q <= 4:
            t = sec + (q * total / 4 - acc) / n  # interpolated within the second
            out.append(round((total / 4) / (t - t_prev), 2) if t > t_prev else None)
            t_prev, q = t, q + 1
        acc += n
    return out


def run(args) -> int:
    ls = args.llama_server or str(Path(os.environ.get("EPIKV_CACHE_DIR", Path.home() / ".cache" / "epikv"))
                                  / "llama-server" / "build" / "bin" / "llama-server")
    if not os.access(ls, os.X_OK):
        fail(f"no llama-server at {ls}: run benchmarks/build_llama_server.sh")
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not names:
        fail("--rows is empty")
    ks = [int(n.partition(":")[2]) for n in names if n.partition(":")[2].isdigit()]
    shift = args.shift_cells or round_up(min(ks, default=256) + args.tau - 1 + BATCH)
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    flashes = flash_settings(args.flash_attn)
    done = set()
    if results.exists():
        for line in results.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done.add((r["tokens"], r["row"], r.get("flash_attn", "off"), r["repeat"]))
    version = subprocess.run([ls, "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    machine = {"cpu": cpu(), "llama_server_version": " / ".join(version), "epikv_commit": commit(),
               "schema": SCHEMA, "kv_type": args.cache_type, "threads": THREADS, "sequences": SEQUENCES,
               "max_batch_tokens": BATCH, "max_prompt_tokens": PROMPT_TOKENS}
    specs = {(n, fa): row_spec(n, args.tokens, shift, fa, ls, args.cache_type) for fa in flashes for n in names}
    for n in names:  # an equal-cells row needs its epikv row in the same run, to be paired with it
        if n.startswith(SHIFT_AT) and n.removeprefix(SHIFT_AT) not in names:
            fail(f"row {n!r}: add the row {n.removeprefix(SHIFT_AT)} it is paired with to --rows")
    for rep in range(args.repeats):
        for name, fa in order({n: specs[n, flashes[0]] for n in names}, flashes, rep):
            what = f"{name} x {args.tokens}, flash attention {fa}, repeat {rep}"
            if (args.tokens, name, fa, rep) in done:
                print(f"{what}: done, skipped", file=sys.stderr)
                continue
            print(f"{what} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            tag = f"{args.tokens}-{name.replace(':', '-').replace('@', '-at-')}-fa-{fa}-r{rep}"
            try:
                row = run_row(specs[name, fa], args.tokens, logs, tag)
            except RuntimeError as e:
                fail(f"{what}: {e}")
            row.update(tokens=args.tokens, row=name, repeat=rep, time=time.strftime("%Y-%m-%d %H:%M:%S"),
                       flash_attn=fa, **machine)
            if specs[name, fa].get("equal_cells_to"):
                row["equal_cells_to"] = specs[name, fa]["equal_cells_to"]
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"  {row['tokens_per_s']} tok/s, quarters {row['quarters']}, TTFT p50 {row['ttft_p50_s']} s, "
                  f"peak RSS {row['peak_rss_mib']:.0f} MiB, KV {row['kv_mib']} MiB", file=sys.stderr, flush=True)
            shift = specs.get((SHIFT_AT + name, fa))
            if shift and row.get("cells_per_sequence") != shift["cells_per_sequence"]:  # the derivation went stale
                print(f"  warning: epikv's streams hold {row.get('cells_per_sequence')} cells, {SHIFT_AT}{name} runs "
                      f"on {shift['cells_per_sequence']}: not equal cells", file=sys.stderr, flush=True)
    return summary(args)


def _fmt(vals: list[float], digits: int = 1) -> str:
    if not vals:
        return "-"
    med = statistics.median(vals)
    return f"{med:.{digits}f}" + (f" ({min(vals):.{digits}f}-{max(vals):.{digits}f})" if len(vals) > 1 else "")


def interval95(ratios: list[float]) -> tuple[float, float] | None:
    """The 95 % t interval of per-repeat ratios, on their logs: exp(mean +- t(0.975, n - 1) s / sqrt(n)) of
    log(ratio) (an interval for their geometric mean); None under 2 ratios."""
    n = len(ratios)
    if n < 2:
        return None
    logs = [math.log(x) for x in ratios]
    df, z = n - 1, 1.959964
    t = _T975[df - 1] if df <= len(_T975) else z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    half = t * statistics.stdev(logs) / math.sqrt(n)
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def paired(mine: list[dict], base: list[dict], key: str = "tokens_per_s") -> list[float]:
    """Each of `mine`'s rates over the `base` row's of the same repeat, in repeat order (a repeat either side lacks is
    left out): the two rows of a pair ran minutes apart on the same machine, so the machine's drift cancels."""
    by = {b["repeat"]: b for b in base}
    return [r[key] / by[r["repeat"]][key] for r in sorted(mine, key=lambda r: r["repeat"]) if r["repeat"] in by]


def row_key(r: dict) -> str:
    """A row's name in the summary: the row, with its flash attention unless off (the only setting of older files)."""
    fa = r.get("flash_attn", "off")
    return r["row"] if fa == "off" else f"{r['row']}@fa-{fa}"


def medians(rows: list[dict]) -> dict[int, dict[str, dict]]:
    """{tokens: {row: figures}}: each row's medians over its repeats, and its ratios to llama-server's (given every
    cell, same flash attention) paired by repeat, over the run and in the first quarter of the tokens, with the 95 %
    interval of the paired ratios; for an epikv row measured beside `llama-server-shift@` it, the same against
    context shift at equal cells; KV bytes as a fraction of llama-server's."""
    out: dict[int, dict[str, dict]] = {}
    for tokens in sorted({r["tokens"] for r in rows}):
        rs = [r for r in rows if r["tokens"] == tokens]
        ref_kv = next((r["kv_mib"] for r in rs if r["row"] == "llama-server" and r.get("kv_mib")), None)
        per = out.setdefault(tokens, {})
        for name in dict.fromkeys(row_key(r) for r in rs):
            mine = [r for r in rs if row_key(r) == name]
            fa = mine[0].get("flash_attn", "off")
            same = [r for r in rs if r.get("flash_attn", "off") == fa]
            base = [r for r in same if r["row"] == "llama-server"]
            shift = [r for r in same if r["row"] == SHIFT_AT + mine[0]["row"]]
            ratios = paired(mine, base)
            with_q = [r for r in mine if r["quarters"]]
            shift_ratios = paired(mine, shift)
            per[name] = {
                "label": mine[0]["label"], "row": mine[0]["row"], "flash_attn": fa, "repeats": len(mine),
                "schema": min(r.get("schema", 1) for r in mine), "rates": [r["tokens_per_s"] for r in mine],
                "ratios": ratios, "ci": interval95(ratios),
                "q1_ratios": [x[0] / y[0] for x, y in zip(*_pair_quarters(with_q, base)) if x and y],
                "shift_ratios": shift_ratios, "shift_ci": interval95(shift_ratios),
                "quarters": [statistics.median(r["quarters"][i] for r in mine if len(r["quarters"]) > i)
                             for i in range(min(len(r["quarters"]) for r in mine))],
                "ttft": [r["ttft_p50_s"] for r in mine if r["ttft_p50_s"] is not None],
                "rss": [r["peak_rss_mib"] for r in mine if r["peak_rss_mib"]],
                "kv_mib": max((r["kv_mib"] or 0) for r in mine) or None, "kv_counts": kv_counts(mine),
                "kv_fraction": (max((r["kv_mib"] or 0) for r in mine) / ref_kv) if ref_kv else None,
                "cells_per_sequence": mine[0]["cells_per_sequence"],
                "generated": [r["generated_tokens"] for r in mine], "load": max(r["load_before"][0] for r in mine)}
    return out


def kv_counts(rows: list[dict]) -> str:
    """What a row's KV bytes count: "cells" (llama-server), "cells+buffers" (epikv, every buffer: this version),
    "cells+mirror" (epikv rows of older files), "mixed" where its repeats differ."""
    got = {"cells" if r["server"] == "llama-server" else r.get("kv_counts", "cells+mirror") for r in rows}
    return got.pop() if len(got) == 1 else "mixed"


def kv_head(rows: list[dict]) -> str:
    """The KV column's head: what the epikv rows' bytes count (older files: the mirror; this version: every buffer;
    a file with both marks this version's with *)."""
    got = {kv_counts([r]) for r in rows if r["server"] == "epikv"}
    if got <= {"cells+mirror"}:
        return "KV MiB (cells + mirror)"
    if got == {KV_COUNTS}:
        return "KV MiB (cells + every buffer)"
    return "KV MiB (cells + mirror; * cells + every buffer)"


def _pair_quarters(mine: list[dict], base: list[dict]) -> tuple[list, list]:
    """The quarters of `mine` and of the base row of the same repeat, side by side in repeat order."""
    by = {b["repeat"]: b for b in base if b["quarters"]}
    ms = [r for r in sorted(mine, key=lambda r: r["repeat"]) if r["repeat"] in by]
    return [r["quarters"] for r in ms], [by[r["repeat"]]["quarters"] for r in ms]


def _ratio_ci(ratios: list[float], ci: tuple[float, float] | None) -> str:
    if not ratios:
        return "-"
    med = f"{statistics.median(ratios):.2f}"
    return med + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "")


def tables(rows: list[dict]) -> str:
    """The markdown tables of `medians`, one a length, with the machine line first. Rows of this version of the script
    (schema 2) get the flash attention, 95 % interval and context-shift columns; older files render as they did."""
    if all(r.get("schema", 1) >= SCHEMA for r in rows):
        return _tables_v2(rows)
    cpus = sorted({r["cpu"]["model"] for r in rows})
    simd = sorted({f for r in rows for f in r["cpu"].get("simd", [])})
    lines = [f"CPU: {', '.join(cpus)} ({rows[0]['cpu'].get('cores')} cores; {' '.join(simd) or 'no AVX'}); "
             f"llama-server {rows[0]['llama_server_version'].split(' / ')[0]}; epikv "
             f"{', '.join(sorted({r['epikv_commit'] for r in rows}))}; flash attention {rows[0]['flash_attn']} and "
             f"F16 K/V on both; {rows[0]['threads']} threads; {rows[0]['sequences']} requests at once.", ""]
    for tokens, per in medians(rows).items():
        head = kv_head([r for r in rows if r["tokens"] == tokens])
        lines += [f"{SEQUENCES} x {tokens:,} tokens | repeats | tok/s: median (min-max) | x llama-server (paired) | "
                  "tok/s per quarter of the tokens | first quarter x llama-server | TTFT p50 (s) | peak RSS (MiB) | "
                  f"{head} | x llama-server's KV | cells a sequence | tokens generated | max load before",
                  "|".join(["---"] * 13)]
        for name, m in per.items():
            base = name == "llama-server"
            lines.append(" | ".join([
                m["label"], str(m["repeats"]), _fmt(m["rates"]), "1" if base else _fmt(m["ratios"], 2),
                *_row_tail(m, base, "*" in head)]))
        lines.append("")
    return "\n".join("| " + x + " |" if x and not x.startswith(("CPU", "|")) else x for x in lines).strip()


def _row_tail(m: dict, base: bool, mark: bool = False) -> list[str]:
    """The columns both table layouts end with: quarters, first quarter's ratio, TTFT, RSS, KV, cells, tokens, load.
    mark: star the KV of a row that counts every buffer (a file mixing those with older rows)."""
    gen = m["generated"]
    star = "*" if mark and m["kv_counts"] == KV_COUNTS else ""
    return [", ".join(f"{q:.1f}" for q in m["quarters"]), "1" if base else _fmt(m["q1_ratios"], 2),
            _fmt(m["ttft"], 2), _fmt(m["rss"], 0), (f"{m['kv_mib']:.1f}" + star) if m["kv_mib"] else "-",
            f"{m['kv_fraction']:.2f}" if m["kv_fraction"] is not None else "-", f"{m['cells_per_sequence']:,}",
            f"{min(gen):,}" + ("" if min(gen) == max(gen) else f"-{max(gen):,}"), f"{m['load']:.2f}"]


def _tables_v2(rows: list[dict]) -> str:
    cpus = sorted({(r["cpu"]["model"], r["cpu"].get("cores"), " ".join(r["cpu"].get("simd", [])) or "no AVX")
                   for r in rows})
    lines = [f"CPU: {'; '.join(f'{m} ({c} cores; {f})' for m, c, f in cpus)}"
             + (" (rows from several CPUs: their ratios mix machines)" if len(cpus) > 1 else "")
             + f"; llama-server {rows[0]['llama_server_version'].split(' / ')[0]}; epikv "
             f"{', '.join(sorted({r['epikv_commit'] for r in rows}))}; "
             f"{'/'.join(sorted({r.get('kv_type', 'f16').upper() for r in rows}))} K/V and the flash attention of "
             f"its row on both; {rows[0]['threads']} threads; {rows[0]['sequences']} requests at once. Ratios: the median of the "
             "ratios paired by repeat [their 95 % t interval, on the logs of the per-repeat ratios].", ""]
    for tokens, per in medians(rows).items():
        head = kv_head([r for r in rows if r["tokens"] == tokens])
        lines += [f"{SEQUENCES} x {tokens:,} tokens | flash attention | repeats | tok/s: median (min-max) | "
                  "x llama-server [95 %] | x context shift at equal cells [95 %] | tok/s per quarter of the tokens | "
                  f"first quarter x llama-server | TTFT p50 (s) | peak RSS (MiB) | {head} | "
                  "x llama-server's KV | cells a sequence | tokens generated | max load before",
                  "|".join(["---"] * 15)]
        for name, m in per.items():
            base = m["row"] == "llama-server"
            lines.append(" | ".join([
                m["label"], m["flash_attn"], str(m["repeats"]), _fmt(m["rates"]),
                "1" if base else _ratio_ci(m["ratios"], m["ci"]), _ratio_ci(m["shift_ratios"], m["shift_ci"]),
                *_row_tail(m, base, "*" in head)]))
        lines.append("")
    return "\n".join("| " + x + " |" if x and not x.startswith(("CPU", "|")) else x for x in lines).strip()


# issue 50's goals: (length, row, what, bound, at least?) on medians of paired ratios
GOALS = [(1024, "full", "ratio", 0.97, True), (1024, "epikv-seg-q:256", "ratio", 1.2, True),
         (1024, "epikv-seg-q:256", "q1", 1.0, True), (4096, "epikv-seg-q:512", "ratio", 2.0, True),
         (4096, "epikv-seg-q:512", "q1", 1.0, True), (4096, "epikv-seg-q:512", "kv", 0.25, False)]


def goals(rows: list[dict]) -> list[str]:
    """One line per goal whose row was measured: the median, the bound, met or missed."""
    med = medians(rows)
    out = []
    for tokens, name, what, bound, at_least in GOALS:
        m = med.get(tokens, {}).get(name)
        if m is None:
            continue
        v = {"ratio": statistics.median(m["ratios"]) if m["ratios"] else None,
             "q1": statistics.median(m["q1_ratios"]) if m["q1_ratios"] else None, "kv": m["kv_fraction"]}[what]
        if v is None:
            continue
        ok = v >= bound if at_least else v <= bound
        counted = {KV_COUNTS: "cells + every buffer", "mixed": "cells + mirror or every buffer"}.get(
            m["kv_counts"], "cells + mirror")
        say = {"ratio": "x llama-server's tokens/s over the run", "q1": "x llama-server's in the first quarter",
               "kv": f" of llama-server's KV bytes ({counted})"}[what]
        out.append(f"{SEQUENCES} x {tokens:,}, {m['label']}: {v:.2f}{say} (goal {'>=' if at_least else '<='} "
                   f"{bound:g}: {'met' if ok else 'missed'})")
    return out


def summary(args) -> int:
    out = Path(args.out)
    path = out / "results.jsonl"
    if not path.exists():
        fail(f"no results at {path}")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    text = ("# epikv serve (llama.cpp) against llama-server: medians of interleaved repeats\n\n" + tables(rows)
            + "\n\n" + "".join(f"- {g}\n" for g in goals(rows)))
    (out / "summary.md").write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the rows (resumable), then write the summary")
    r.add_argument("--tokens", type=int, required=True, help="tokens generated per request (forced)")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--rows", default="llama-server,llama-server-shift,full,epikv-seg-q:256,epikv-seg-q:512,"
                                     "epikv-seg-q:1024,streaming:256")
    r.add_argument("--shift-cells", type=int, default=None,
                   help="cells a slot for llama-server-shift (default: an epikv stream's for the smallest K: "
                        "K + tau - 1 + a 256-token chunk, rounded up to 256 as llama.cpp does)")
    r.add_argument("--tau", type=int, default=128, help="the tau of the smallest-K row (for --shift-cells)")
    r.add_argument("--flash-attn", default="off,auto",
                   help="both servers; off, on, auto, comma-separated: every row runs at each (default off,auto: "
                        "off, under which a stream's answer is batch-invariant, and llama-server's own default)")
    r.add_argument("--cache-type", default="f16",
                   help="both servers' K and V cell type, llama.cpp's names (f16, q8_0, q4_0, ...; a quantized type "
                        "needs flash attention: --flash-attn on or auto)")
    r.add_argument("--llama-server", default=None, help="the binary (default: where build_llama_server.sh puts it)")
    r.add_argument("--out", required=True)
    s = sub.add_parser("summary", help="write DIR/summary.md from DIR/results.jsonl")
    s.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "run" and (args.tokens < 1 or args.repeats < 1):
        fail("--tokens and --repeats must be positive")
    if args.cmd == "run":
        from epikv.llamacpp.kvtypes import CACHE_TYPES

        if args.cache_type not in CACHE_TYPES:
            fail(f"--cache-type {args.cache_type!r}: llama.cpp's types are {', '.join(CACHE_TYPES)}")
        if CACHE_TYPES[args.cache_type][1] > 1 and "off" in flash_settings(args.flash_attn):
            fail(f"--cache-type {args.cache_type} needs flash attention, on or auto (llama.cpp refuses a quantized V "
                 "cache without it)")
        CACHE[0] = args.cache_type
    return run(args) if args.cmd == "run" else summary(args)


if __name__ == "__main__":
    sys.exit(main())
