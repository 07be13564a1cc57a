"""`epikv bench serve`: load on `epikv serve` over HTTP, one server process per policy, run in sequence.

Each policy row: R chat requests (real reasoning prompts from the shared data) sent by the `openai` client at
concurrency C, streamed, each forced to max_tokens (`ignore_eos`) so that every policy does equal work; bounded by
--timeout for the whole row. Reported: requests completed, requests in flight in the engine (max / mean / median
over forward passes, from /stats), aggregate tokens/s, median / p95 latency and time to first token, peak KV pages,
evictions, preemptions (offloads + soft resets).

An optional equal-batch part (--equal-batch B) times, in this process, B requests run together through the engine
(`run_batch`) under full and under each evicting policy, and through padded `model.generate` with a DynamicCache:
per-step time ratios at equal batch and the engine's throughput against plain generate.
"""

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EpiKVError

READY = re.compile(r"listening on (http://\S+)")


@dataclass
class Row:
    """One policy run: the server's flags, and the label the table prints."""

    policy: str
    budget: int | None
    sets: list = field(default_factory=list)  # ["epikv.window=8", ...]
    name: str | None = None  # the table's label when given (a server loaded by --url: what it is)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return self.policy if self.budget is None else f"{self.policy} K={self.budget}"


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# ---------------------------------------------------------------------- the server process
class ServerProcess:
    """`epikv serve` in a child process on a free port; stopped with SIGTERM."""

    def __init__(self, argv: list[str], log: Path | None, startup_timeout: float):
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the same epikv as this process
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.log_path = log
        self.log = open(log, "w") if log else None
        self.proc = subprocess.Popen([sys.executable, "-m", "epikv.cli", "serve", *argv, "--port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.url = None
        self.lines: list[str] = []
        got = threading.Event()

        def read():  # keep draining stderr so the child never blocks on a full pipe
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                if self.log:
                    self.log.write(line)
                    self.log.flush()
                m = READY.search(line)
                if m and self.url is None:
                    self.url = m.group(1)
                    got.set()
            got.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        got.wait(startup_timeout)
        if self.url is None:
            self.stop()
            tail = next((x for x in reversed(self.lines) if x.strip()), "no output")
            raise EpiKVError(f"epikv serve {' '.join(argv)} did not start: {tail}")

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        if self.log:
            self.log.close()
            self.log = None
        return self.proc.returncode


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------------- load
async def _one(client, model: str, messages: list[dict], max_tokens: int, ignore_eos: bool, seen: dict,
               sampling: dict | None = None, external: bool = False) -> dict:
    """One streamed chat request (greedy, or `sampling`: temperature, top_p and this request's seed); `seen["tokens"]`
    follows the tokens received, so a request cut by the row's timeout still counts what it streamed.
    Tokens are counted from each chunk's `token_ids` (epikv serve). An external server (`external`: llama.cpp's
    `llama-server`, which sends text only) is asked for `timings_per_token` and usage: a chunk's
    `timings.predicted_n` is the tokens generated so far (a chunk may carry several, e.g. a character split over
    tokens), and the closing usage chunk's completion_tokens the total; a server sending neither counts a token per
    chunk with text."""
    t0 = time.perf_counter()
    first = None
    n = 0
    finish = None
    seen["tokens"] = 0
    seen["t0"] = t0  # sent: a request cut by the timeout counts its time from here (censored)
    extra = {"ignore_eos": True} if ignore_eos else {}
    if external:
        extra.update(timings_per_token=True, stream_options={"include_usage": True})
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  stream=True, **(sampling or {"temperature": 0}),
                                                  extra_body=extra or None)

    def got(k: int) -> None:  # k more tokens received now
        nonlocal n, first
        if k <= 0:
            return
        if first is None:
            first = time.perf_counter() - t0
            seen["ttft_s"] = first
        n += k
        seen["tokens"] = n
        # tokens received by each whole second of the row (tokens/s of rows over a common window)
        sec = int(time.perf_counter() - seen["row_t0"])
        seen["by_second"][sec] = seen["by_second"].get(sec, 0) + k

    async for chunk in stream:
        more = chunk.model_extra or {}
        usage = getattr(chunk, "usage", None)
        if usage is not None and getattr(usage, "completion_tokens", None) is not None:
            got(usage.completion_tokens - n)  # the server's own total (a usage-only chunk closes the stream)
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        ids = (c.model_extra or {}).get("token_ids")
        if ids:
            got(len(ids))
        elif external and isinstance(more.get("timings"), dict) and more["timings"].get("predicted_n") is not None:
            got(int(more["timings"]["predicted_n"]) - n)  # cumulative
        elif external and c.delta is not None and c.delta.content:
            got(1)  # epikv serve's tokens are its token_ids only (a text chunk without them carries none)
        finish = c.finish_reason or finish
    return {"latency_s": time.perf_counter() - t0, "ttft_s": first, "tokens": n, "finish": finish}


async def drive(base_url: str, model: str, prompts: list[list[dict]], concurrency: int, max_tokens: int,
                timeout: float, ignore_eos: bool = True, on_done=None, sampling: dict | None = None,
                external: bool = False) -> dict:
    """Send every prompt (chat messages) at `concurrency`, all within `timeout` seconds; per-request records.
    sampling: {temperature, top_p, seed}: request i is sampled with seed + i (None: greedy). external: a server
    other than epikv serve (see _one)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="epikv", max_retries=0, timeout=timeout)
    sem = asyncio.Semaphore(concurrency)
    records: list[dict | None] = [None] * len(prompts)
    t_row = time.perf_counter()
    by_second: dict[int, int] = {}
    seen = [{"tokens": 0, "row_t0": t_row, "by_second": by_second} for _ in prompts]

    async def worker(i: int, msgs: list[dict]):
        async with sem:
            try:
                own = None if sampling is None else {**sampling, "seed": sampling["seed"] + i}
                records[i] = await _one(client, model, msgs, max_tokens, ignore_eos, seen[i], own, external)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one failed request is a row entry, not the end of the run
                records[i] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            if on_done:
                on_done(i, records[i])

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(worker(i, m)) for i, m in enumerate(prompts)]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    t_end = time.perf_counter()
    wall = t_end - t0
    for i, r in enumerate(records):
        if r is None:  # cut by the timeout (or never started): what it streamed, and its time so far (censored:
            # from when it was sent, or from the row's start when it never was)
            s = seen[i]
            records[i] = {"unfinished": True, "tokens": s["tokens"], "censored": True,
                          "latency_s": t_end - s.get("t0", t0), "ttft_s": s.get("ttft_s", t_end - s.get("t0", t0)),
                          "ttft_censored": "ttft_s" not in s}
    await client.close()
    n = max(by_second, default=-1) + 1
    return {"records": records, "wall_s": wall, "timed_out": len(pending),
            "tokens_by_second": [by_second.get(k, 0) for k in range(n)]}


def censored_percentile(values: list[tuple[float, bool]], q: float) -> tuple[float | None, bool]:
    """The q-th percentile of (value, censored) pairs, where a censored value is a lower bound (a request cut
    while it ran: its time so far); and whether the result is itself only a lower bound (some censored value lies
    at or below it, so the true percentile may be higher)."""
    p = percentile([v for v, _ in values], q)
    if p is None:
        return None, False
    s = sorted(v for v, _ in values)
    pos = q * (len(s) - 1)
    top = s[min(int(pos) + (pos > int(pos)), len(s) - 1)]  # the larger of the values it interpolates
    return p, any(c and v <= top for v, c in values)


def tokens_in_window(res: dict, seconds: float) -> int | None:
    """Tokens the row received within its first `seconds` (whole seconds), from its per-second counts."""
    by = res.get("tokens_by_second")
    if by is None:
        return None
    return sum(by[: int(seconds)])


def summarize(row: Row, res: dict, stats: dict, requests: int, concurrency: int, max_tokens: int) -> dict:
    recs = res["records"]
    ok = [r for r in recs if r and "error" not in r and not r.get("unfinished") and r["tokens"] > 0]
    # percentiles over every request that did not fail: an unfinished one counts with its time so far (censored)
    timed = [r for r in recs if r and "error" not in r and (r.get("unfinished") or r["tokens"] > 0)
             and r.get("latency_s") is not None]
    lat_c = [(r["latency_s"], bool(r.get("censored"))) for r in timed]
    ttft_c = [(r["ttft_s"], bool(r.get("ttft_censored"))) for r in timed if r.get("ttft_s") is not None]
    (l50, l50c), (l95, l95c) = censored_percentile(lat_c, 0.5), censored_percentile(lat_c, 0.95)
    (t50, t50c), (t95, t95c) = censored_percentile(ttft_c, 0.5), censored_percentile(ttft_c, 0.95)
    tokens = sum(r["tokens"] for r in recs if r and "error" not in r)
    eng = stats.get("engine", {})
    rnd = lambda x, n=3: None if x is None else round(x, n)  # noqa: E731
    return {
        "label": row.label, "policy": row.policy, "budget": row.budget, "sets": row.sets,
        "requests": requests, "concurrency": concurrency, "max_tokens": max_tokens,
        "completed": len(ok), "complete_length": sum(1 for r in ok if r["tokens"] == max_tokens),
        "failed": sum(1 for r in recs if r and "error" in r),
        "unfinished": sum(1 for r in recs if r is None or r.get("unfinished")),
        "unfinished_tokens": sum(r["tokens"] for r in recs if r and r.get("unfinished")),
        "errors": sorted({r["error"] for r in recs if r and "error" in r})[:3],
        "wall_s": rnd(res["wall_s"], 1), "generated_tokens": tokens,
        "tokens_per_s": rnd(tokens / res["wall_s"] if res["wall_s"] else None, 2),
        "latency_p50_s": rnd(l50, 1), "latency_p95_s": rnd(l95, 1),
        "ttft_p50_s": rnd(t50, 2), "ttft_p95_s": rnd(t95, 2),
        # True: that percentile is a lower bound (a request cut by the timeout lies at or below it)
        "censored": sum(1 for _, c in lat_c if c),
        "lower_bound": {"latency_p50": l50c, "latency_p95": l95c, "ttft_p50": t50c, "ttft_p95": t95c},
        "tokens_by_second": res.get("tokens_by_second"),
        "kv_bytes": eng.get("kv_bytes"), "kv": eng.get("kv"), "cells_allocated": eng.get("cells_allocated"),
        "max_in_flight": eng.get("max_in_flight"), "in_flight_mean": rnd(eng.get("in_flight_mean"), 2),
        "in_flight_p50": eng.get("in_flight_p50"), "http_max_in_flight": stats.get("http", {}).get("max_in_flight"),
        "in_flight_cache_full_mean": rnd(eng.get("in_flight_cache_full_mean"), 2),
        "cache_full_steps": eng.get("cache_full_steps"),
        "peak_pages": eng.get("peak_pages"), "num_blocks": eng.get("num_blocks"),
        "engine": eng.get("engine", "torch"), "peak_cells": eng.get("peak_cells"), "cells": eng.get("cells"),
        "evictions": eng.get("evictions"), "pages_freed": eng.get("pages_freed"),
        "preemptions": eng.get("preemptions"), "offloads": eng.get("offloads"), "soft_resets": eng.get("soft_resets"),
        "steps": eng.get("steps"), "max_batch": eng.get("max_batch"),
        "ms_per_step": rnd(1000 * res["wall_s"] / eng["steps"] if eng.get("steps") else None, 1),
    }


# ---------------------------------------------------------------------- prompts
def chat_prompts(data: str, data_dir: str | None, n: int, tokenizer=None,
                 max_prompt_tokens: int | None = None) -> tuple[list[list[dict]], str]:
    """n chat prompts (system: the evaluation instruction; user: the problem) in dataset order, skipping those whose
    templated prompt is longer than max_prompt_tokens (counted with `tokenizer`)."""
    from ..eval.datasets import load_dataset
    from ..eval.prompts import INSTRUCTION

    ds = load_dataset(data, data_dir=data_dir)
    msgs = []
    for r in ds.rows:
        m = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": r["problem"]}]
        if max_prompt_tokens is not None:
            text = tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
                continue
        msgs.append(m)
        if len(msgs) == n:
            break
    if len(msgs) < n:
        limit = f" of at most {max_prompt_tokens} tokens" if max_prompt_tokens is not None else ""
        raise EpiKVError(f"{ds.name} has only {len(msgs)} prompts{limit}; --requests is {n}")
    return msgs, ds.source


def tokenizer_of(model: str):
    """The tokenizer `epikv serve --model <model>` uses, without loading the model."""
    from transformers import AutoTokenizer

    from ..models import smollm2_folder

    if model == "smollm2" or model.startswith("random:"):
        return AutoTokenizer.from_pretrained(smollm2_folder())
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise EpiKVError(f"cannot load the tokenizer of {model!r}: {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------------- one row, resumable
def row_key(row: Row, common: dict) -> str:
    named = {"label": row.name} if row.name else {}  # only when given, so rows recorded before stay reusable
    return json.dumps({"policy": row.policy, "budget": row.budget, "sets": row.sets, **named, **common},
                      sort_keys=True)


def read_done(path: Path) -> dict[str, dict]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed run
            if rec.get("kind") == "serve" and rec.get("key"):
                done[rec["key"]] = rec
            elif rec.get("kind") == "equal_batch" and rec.get("key"):
                done[rec["key"]] = rec
    return done


def run_row(row: Row, server_argv: list[str], prompts: list[list[dict]], concurrency: int, max_tokens: int,
            timeout: float, log: Path | None, url: str | None = None, model_name: str = "",
            startup_timeout: float = 600, say=print, sampling: dict | None = None) -> dict:
    srv = None
    if url is None:
        argv = list(server_argv) + ["--policy", row.policy]
        if row.budget is not None:
            argv += ["--budget", str(row.budget)]
        for s in row.sets:
            argv += ["--set", s]
        srv = ServerProcess(argv, log, startup_timeout)
        url = srv.url
    try:
        model = model_name or get_json(url + "/v1/models")["data"][0]["id"]
        # a server without epikv's /stats (llama.cpp's llama-server) is loaded as an external one: no engine
        # counts, tokens from its timings and usage (see _one)
        external = server_stats(url) is None
        n = [0]

        def done(i, rec):
            n[0] += 1
            what = rec.get("error") or f"{rec['tokens']} tokens in {rec['latency_s']:.1f} s"
            say(f"  {row.label}: request {i} done ({n[0]}/{len(prompts)}): {what}")

        res = asyncio.run(drive(url, model, prompts, concurrency, max_tokens, timeout, on_done=done,
                                sampling=sampling, external=external))
        stats = {} if external else get_json(url + "/stats")
    finally:
        if srv is not None:
            rc = srv.stop()
            if rc not in (0, None):
                say(f"  {row.label}: server exited {rc}")
    out = summarize(row, res, stats, len(prompts), concurrency, max_tokens)
    out["server"] = stats.get("server")
    if external:
        out.update(engine="external", url=url)
    return out


def server_stats(url: str) -> dict | None:
    """epikv serve's /stats, or None when the server has none (not epikv: llama-server answers 404)."""
    try:
        return get_json(url + "/stats")
    except urllib.error.HTTPError:
        return None


# ---------------------------------------------------------------------- equal batch, in process
def equal_batch(model, tokenizer, rows: list[Row], settings_of, prompts_ids: list[list[int]], max_new: int,
                page: int, max_batch_tokens: int, repeats: int = 1, say=print) -> list[dict]:
    """B requests through the engine under each row's policy and through padded model.generate; forced length."""
    import torch
    from transformers import GenerationConfig

    from ..engine import left_pad
    from ..serving import ServeSpec, run_batch
    from ..serving.checks import check_serving

    b = len(prompts_ids)
    pages = sum(-(-(len(p) + max_new) // page) + 1 for p in prompts_ids)  # every request at full length fits
    specs = [ServeSpec(policy=row.policy, settings=settings_of(row), budget=row.budget, page=page, num_blocks=pages,
                       max_batch_tokens=max_batch_tokens) for row in rows]
    for spec in specs:  # every refusal before any timing, not after the rows before it have run
        pol = check_serving(model, spec)
        if pol.evicts:
            why = pol.protected_overflow(spec.budget, pol.recent_window(spec.budget), max(map(len, prompts_ids)))
            if why:
                raise EpiKVError(why)
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1, pad_token_id=0)
    device = model.get_input_embeddings().weight.device
    ids, n_pad = left_pad([list(p) for p in prompts_ids], 0)  # [batch, width]
    mask = torch.ones_like(ids)
    for i, n in enumerate(n_pad):
        mask[i, :n] = 0
    ids, mask = ids.to(device), mask.to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # untimed warm-up of both engines (first kernel launches, allocator, lazy imports), so that the row timed
    # first does not pay them
    run_batch(model, ServeSpec(policy="full", page=page, num_blocks=pages, max_batch_tokens=max_batch_tokens),
              prompts_ids[:2], 4, generation_config=GenerationConfig(do_sample=False, max_new_tokens=4,
                                                                     eos_token_id=-1, pad_token_id=0), timeout=600)
    with torch.no_grad():
        model.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    sync()
    out = []
    for rep in range(repeats):
        for row, spec in zip(rows, specs):
            sync()
            t0 = time.perf_counter()
            toks, st = run_batch(model, spec, prompts_ids, max_new, generation_config=gc, timeout=3600)
            sync()
            wall = time.perf_counter() - t0
            n = sum(len(t) for t in toks)
            steps = st.get("steps") or max_new
            out.append({"engine": "continuous batching", "label": row.label, "batch": b, "new_tokens": max_new,
                        "repeat": rep, "wall_s": round(wall, 2), "tokens": n, "tokens_per_s": round(n / wall, 2),
                        "steps": steps, "ms_per_step": round(1000 * wall / steps, 2),
                        "max_batch": st.get("max_batch"), "peak_pages": st.get("peak_pages")})
            say(f"  equal batch {b}: {row.label} (engine) {out[-1]['tokens_per_s']} tok/s, "
                f"{out[-1]['ms_per_step']} ms/step")
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        sync()
        wall = time.perf_counter() - t0
        n = (seq.shape[1] - ids.shape[1]) * b
        out.append({"engine": "padded model.generate", "label": "full (generate)", "batch": b, "new_tokens": max_new,
                    "repeat": rep, "wall_s": round(wall, 2), "tokens": n, "tokens_per_s": round(n / wall, 2),
                    "steps": max_new, "ms_per_step": round(1000 * wall / max_new, 2)})
        say(f"  equal batch {b}: padded model.generate {out[-1]['tokens_per_s']} tok/s, "
            f"{out[-1]['ms_per_step']} ms/step")
    return out


# ---------------------------------------------------------------------- reporting
def table(rows: list[dict], eq: list[dict]) -> str:
    if not rows:  # the equal-batch part alone
        return "\n".join(_eq_lines(eq)).lstrip("\n") + "\n"
    cells = all(r.get("engine") == "llama.cpp" for r in rows)  # llama.cpp's cache is cells, not pages
    # tokens/s of every row over the same window: the shortest row's whole seconds (rows recorded before the
    # per-second counts have none: "-")
    win = min((int(r["wall_s"]) for r in rows if r.get("tokens_by_second") is not None), default=0)
    kvb = any(r.get("kv_bytes") for r in rows)
    lines = ["| policy | completed | in flight max / mean / median | in flight, cache full | tokens/s | "
             f"tokens/s, first {win} s | "
             f"tokens per forward | latency p50 / p95 (s) | TTFT p50 (s) | "
             f"{'peak cells / cells' if cells else 'peak pages / blocks'} | {'KV MiB | ' if kvb else ''}"
             "preemptions | evictions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if kvb else "")]
    for r in rows:
        lb = r.get("lower_bound") or {}
        ge = lambda k: ">= " if lb.get(k) else ""  # noqa: E731  a percentile reached by a cut request
        w = tokens_in_window({"tokens_by_second": r.get("tokens_by_second")}, win) if win else None
        inf = "-" if r.get("max_in_flight") is None else \
            f"{r['max_in_flight']} / {r['in_flight_mean']} / {r['in_flight_p50']}"
        lines.append(f"| {r['label']} | {r['completed']}/{r['requests']} | {inf} | {_cache_full(r)} | "
                     f"{r['tokens_per_s']} | "
                     f"{'-' if w is None else round(w / win, 2)} | "
                     f"{_v(_per_forward(r))} | "
                     f"{ge('latency_p50')}{r['latency_p50_s']} / {ge('latency_p95')}{r['latency_p95_s']} | "
                     f"{ge('ttft_p50')}{r['ttft_p50_s']} | {peak_kv(r)} | "
                     + (f"{round(r['kv_bytes'] / 2**20, 1) if r.get('kv_bytes') else '-'} | " if kvb else "")
                     + f"{_v(r['preemptions'])} | {_v(r['evictions'])} |")
    if any(r.get("censored") for r in rows):
        lines += ["", "Latency and TTFT percentiles are over every request; a request cut by --timeout counts with "
                      "its time so far (censored: 'unfinished' in results.jsonl), so a percentile marked >= is a "
                      "lower bound."]
    if kvb:
        by = {r.get("kv_bytes") for r in rows if r.get("kv_bytes")}
        lines += ["", "KV MiB: the KV cache the server allocated (llama.cpp: cells x every layer's K and V rows); "
                      + ("equal for every row." if len(by) == 1 else "NOT equal across rows: compare with care.")]
    full = next((r for r in rows if r["policy"] == "full"), None)
    if full and full.get("max_in_flight"):
        lines.append("")
        for r in rows:
            if r is full or not r.get("tokens_per_s") or not full.get("tokens_per_s"):
                continue
            lines.append(f"- {r['label']}: {(r['in_flight_mean'] or 0) / (full['in_flight_mean'] or 1):.2f}x full's "
                         f"mean in flight ({(r['in_flight_p50'] or 0) / (full['in_flight_p50'] or 1):.2f}x its "
                         f"median, {r['max_in_flight'] / full['max_in_flight']:.2f}x its max), "
                         f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x its tokens/s"
                         + (f", {_per_forward(r) / _per_forward(full):.2f}x its tokens per forward"
                            if _per_forward(r) and _per_forward(full) else "")
                         + _cache_full_ratio(r, full))
        kv = "cells" if cells else "pages"
        lines += ["", f"In flight, cache full: the mean number of requests holding {kv} over the forwards in which "
                      f"a request waited for {kv} (the forward had room for its tokens); what the cache holds when "
                      "it is the limit, without the ramp-up and the tail. 'never full': every request fitted at once "
                      "(that many is a lower bound on what the cache holds)."]
    return "\n".join(lines + _eq_lines(eq)) + "\n"


def _eq_lines(eq: list[dict]) -> list[str]:
    lines: list[str] = []
    if eq:
        lines += ["", "Equal batch (in process, forced length):", "",
                  "| engine | policy | batch | tokens/s | ms per step |", "|---|---|---|---|---|"]
        for e in _median_eq(eq):
            lines.append(f"| {e['engine']} | {e['label']} | {e['batch']} | {e['tokens_per_s']} | {e['ms_per_step']} |")
        med = {e["label"]: e for e in _median_eq(eq)}
        f = med.get("full")
        if f:
            lines.append("")
            for lab, e in med.items():
                if lab != "full":
                    lines.append(f"- {lab}: per-step time {e['ms_per_step'] / f['ms_per_step']:.2f}x the engine's "
                                 f"full at batch {f['batch']}" if e["engine"] == "continuous batching" else
                                 f"- padded model.generate: {e['tokens_per_s'] / f['tokens_per_s']:.2f}x the "
                                 f"engine's full tokens/s at batch {f['batch']}")
    return lines


def _v(x) -> str:
    return "-" if x is None else str(x)


def peak_kv(r: dict) -> str:
    """The peak KV held and the capacity: cells for llama.cpp, pages for the torch engine."""
    if r.get("engine") == "external":
        return "-"  # not reported by a server other than epikv serve
    if r.get("engine") == "llama.cpp":
        return f"{r['peak_cells']} / {r['cells']}"
    return f"{r['peak_pages']} / {r['num_blocks']}"


def _cache_full(r: dict) -> str:
    """The table's 'in flight, cache full' cell: the mean over the forwards in which the cache held a request back,
    with how many forwards that was; 'never full' (lower bound: all requests) when it never did."""
    if "cache_full_steps" not in r or r.get("engine") == "external":
        return "-"  # a row recorded before this measure existed, or a server that does not report it
    if not r.get("cache_full_steps"):
        return f"never full (>= {r['max_in_flight']})"
    return f"{r['in_flight_cache_full_mean']} ({r['cache_full_steps']} fwd)"


def _held(r: dict):
    """What the cache held when it was the limit: the cache-full mean, or every request (max in flight) when it
    never was; None for a row recorded before the measure."""
    if "cache_full_steps" not in r:
        return None
    return r["in_flight_cache_full_mean"] if r["cache_full_steps"] else r["max_in_flight"]


def _cache_full_ratio(r: dict, full: dict) -> str:
    f = full.get("in_flight_cache_full_mean")
    if not f or _held(r) is None:
        return ""
    ratio = f"{_held(r) / f:.2f}x full's in flight when"
    return f"; {ratio} the cache was full" if r["cache_full_steps"] else \
        f"; the cache never held it back: >= {ratio} its cache was full"


def _per_forward(r: dict):
    """Tokens generated per forward pass: throughput that does not depend on the machine's load."""
    return round(r["generated_tokens"] / r["steps"], 2) if r.get("steps") else None


def _median_eq(eq: list[dict]) -> list[dict]:
    by: dict[str, list[dict]] = {}
    for e in eq:
        by.setdefault(e["label"], []).append(e)
    out = []
    for lab, es in by.items():
        m = dict(es[0])
        m["tokens_per_s"] = round(statistics.median(x["tokens_per_s"] for x in es), 2)
        m["ms_per_step"] = round(statistics.median(x["ms_per_step"] for x in es), 2)
        m["repeats"] = len(es)
        out.append(m)
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in rows]
    fig, ax = plt.subplots(1, 4, figsize=(15, 3.6))
    x = range(len(rows))
    ax[0].bar(x, [r["max_in_flight"] or 0 for r in rows], color="#bbb", label="max")
    ax[0].bar([i - 0.13 for i in x], [r["in_flight_mean"] or 0 for r in rows], color="#3a7", width=0.25,
              label="mean")
    ax[0].bar([i + 0.13 for i in x], [_held(r) or 0 for r in rows], color="#37a", width=0.25,
              label="cache full (never full: all)")
    ax[0].set_title("requests in flight (engine)")
    ax[0].legend(fontsize=7, loc="lower left", framealpha=0.9)
    ax[1].bar(x, [r["tokens_per_s"] or 0 for r in rows], color="#37a")
    ax[1].set_title("aggregate tokens/s")
    ax[2].bar(x, [_per_forward(r) or 0 for r in rows], color="#a73")
    ax[2].set_title("tokens per forward")
    ax[3].bar([i - 0.2 for i in x], [r["latency_p50_s"] or 0 for r in rows], width=0.4, label="p50")
    ax[3].bar([i + 0.2 for i in x], [r["latency_p95_s"] or 0 for r in rows], width=0.4, label="p95")
    ax[3].set_title("request latency (s)")
    ax[3].legend(fontsize=8)
    for a in ax:
        a.set_xticks(list(x))
        a.set_xticklabels(labels, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
