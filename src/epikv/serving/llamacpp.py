"""`epikv serve --engine llama.cpp`: continuous batching over one llama.cpp context, each sequence's cache kept within
the budget by removing single cells (LLAMACPP.md sections 2 and 3).

- One thread owns the context (llama.cpp's context is not thread-safe); the app talks to it through queues
  (`LlamaBackend`, the serving.backend.Backend interface).
- Two cache layouts (`kv`):
  - "streams" (the default for an evicting policy): one llama.cpp KV stream per sequence slot (kv_unified = false,
    n_seq_max = sequences), each of `ctx / sequences` cells (derived, when ctx is None, as budget + tau - 1 + one
    prompt chunk of max_batch_tokens; llama.cpp rounds a stream up to a multiple of 256 cells, all used). A sequence
    attends only to its own stream, so its attention costs its own cells (at most budget + tau - 1 + a chunk), not
    every sequence's, and its logits do not depend on its batch-mates. A request is admitted when a slot is free.
  - "unified" (the default for `full`, whose requests differ in length): one stream of `ctx` cells shared by up to
    `sequences` sequences: a cell one sequence frees serves any other. A request is admitted (first come, first
    served) when its protected prompt and recency window fit the free cells not yet promised to sequences still
    filling theirs (`full`, which never evicts: its prompt and max_tokens).
- Each step feeds the next token of every decoding sequence, then prompt chunks, at most `max_batch_tokens` rows
  (and, unified, never more than the free cells). Unified: one `llama_decode` a step; with n_ubatch = the batch, row
  i of a captured block output is batch token i (LLAMACPP.md section 1), so each sequence reads its own slice.
  Streams: llama.cpp splits a batch by stream (split_equal, `src/llama-batch.cpp`): a micro-batch takes sequences
  of consecutive increasing ids only, the same number of tokens from each, its rows grouped by sequence in id
  order, and the capture keeps only the last micro-batch's rows. So the step hands llama.cpp batches that are one
  micro-batch each, in the order llama.cpp would lay them out: the decoding sequences in runs of consecutive ids
  (one token each, ids increasing), and each prompt chunk on its own (whole chunks of at most max_batch_tokens:
  a request's chunks do not depend on its batch-mates). Slot ids are handed out lowest first, so runs stay long.
- Each sequence is a SequenceCache (sequence.py, the single-sequence decoder's own code): its policy is fed its
  rows, and it evicts, by runs of cells, between steps, never its newest token.
- A finished, failed or cancelled sequence's cells are removed at once (`seq_rm(s, -1, -1)`). When the running
  sequences' next tokens do not fit, the most recently admitted one is preempted: its cells are removed and it is
  queued again at the front; on readmission its prompt is prefilled again and the tokens it had generated are fed
  back one a step (not sampled, not sent again), so its cache is rebuilt as it was. Preemptions are counted.
- Sampling per request with `epikv.engine.Sampler` (serving.sampling.RequestSampler), the sampler the llama.cpp
  `generate` uses; greedy is the argmax.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import EpiKVError
from ..llamacpp import lib
from ..policies import DEFAULT_POLICY
from ..llamacpp.engine import all_outputs, attn_plan, checked_policy, default_threads, kv_types, make_context
from ..llamacpp.kvtypes import cell_bytes, mirror_dtype
from ..llamacpp.model import GGUFModel
from ..llamacpp.sequence import SEQUENCE_BUFFERS, SequenceCache
from .backend import Backend, Output
from .metrics import mean_p50

KV_LAYOUTS = ("streams", "unified")


log = logging.getLogger("epikv.serve")


class _Seq(SequenceCache):
    def __init__(self, ll, mem, seq, gm, policy, budget, blocks, cells, kv_dtype=torch.float16,
                 cell_bytes: int = 0) -> None:
        self._init_sequence(ll, mem, seq, gm, policy, budget, blocks, cells, kv_dtype, cell_bytes)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    sampler: object | None  # serving.sampling.RequestSampler; None: greedy
    ignore_eos: bool
    policy: object = None  # the policy this request runs (LlamaBackend.prompt_policy)
    generated: list[int] = field(default_factory=list)
    seq: _Seq | None = None
    fed: int = 0  # tokens of prompt + generated fed into the cache

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.generated)


class LlamaBackend(Backend):
    """The llama.cpp engine behind `epikv serve`: one context of `ctx` cells (unified: llama.cpp may allocate more,
    rounded up; only `ctx` are used; streams: `ctx / sequences` a stream, rounded up to 256 by llama.cpp and all
    used), up to `sequences` sequences, `max_batch_tokens` rows a step. kv: "streams" or "unified" (default: streams
    for an evicting policy, unified for `full`). spare_sequences: sequence ids past `sequences` left to a caller (the
    tests build an oracle there from the engine thread; with streams each gets a stream of its own)."""

    sampling_fields = frozenset({"temperature", "top_p", "top_k", "min_p", "seed"})
    per_request_eos = True
    capacity_flags = "--ctx"

    def __init__(self, gm: GGUFModel, policy=DEFAULT_POLICY, budget: int | None = 1024, tau: int | None = None, *,
                 ctx: int | None = None, sequences: int, max_batch_tokens: int = 256, threads: int | None = None,
                 capture: str = "auto", type_kv: str = "f16", flash_attn: bool | None = None,
                 spare_sequences: int = 0, kv: str | None = None, type_k: str | None = None,
                 type_v: str | None = None, **policy_settings) -> None:
        self.gm = gm
        self.policy, self.blocks = checked_policy(gm, policy, budget, tau, **policy_settings)
        ev = self.policy.evicts
        self.budget = budget if ev else None
        self.recent = self.policy.recent_window(budget) if ev else 0
        kv = kv or ("streams" if ev else "unified")
        if kv not in KV_LAYOUTS:
            raise EpiKVError(f"--kv must be one of {', '.join(KV_LAYOUTS)}, got {kv!r}")
        self.streams = kv == "streams"
        if sequences < 1 or (ctx is not None and ctx < 1) or max_batch_tokens < 1:
            raise EpiKVError("--ctx, --sequences and --max-batch-tokens must be positive integers")
        if ctx is None and self.streams and ev:  # derived: the most a sequence ever holds, one prompt chunk included
            ctx = sequences * (budget + self.policy.tau - 1 + max_batch_tokens)
        if ctx is None:
            raise EpiKVError(f"--engine llama.cpp with {'policy full' if not ev else 'a unified cache'} needs --ctx "
                             "(the KV cells of the context)")
        if sequences + spare_sequences > 256:
            raise EpiKVError(f"--sequences {sequences}: a llama.cpp context takes at most 256 sequences")
        if max_batch_tokens < sequences:
            raise EpiKVError(f"--max-batch-tokens {max_batch_tokens} is below --sequences {sequences}: every running "
                             "sequence's next token goes into one batch")
        per = ctx // sequences if self.streams else ctx
        if ev and per < budget + self.policy.tau:
            what = f"gives each of the {sequences} streams {per} cells" if self.streams else \
                "cannot hold one sequence at its budget"
            raise EpiKVError(f"--ctx {ctx} {what}: {self.policy.name} grows to budget + tau = "
                             f"{budget + self.policy.tau} cells before it evicts"
                             + (" (leave --ctx out to derive it)" if self.streams else ""))
        self.cells = ctx
        self.sequences = sequences
        self.max_batch = max_batch_tokens
        self.threads = threads or default_threads()
        self.type_kv = type_kv
        self.type_k, self.type_v = kv_types(type_kv, type_k, type_v)  # the cells' types (llama.cpp's names)
        self.cell_bytes = cell_bytes(gm, self.type_k, self.type_v)
        self._ll = ll = lib.load().ll
        # the context is probed before the server takes a request: a model whose graph cannot be captured is
        # refused here (EpiKVError: `epikv serve` says so in one line and exits 2)
        n_seq = sequences + spare_sequences
        self.ctx, self.capture, self.cell_counter = make_context(
            gm, self.blocks, n_ctx=per * n_seq if self.streams else ctx, n_batch=max_batch_tokens, n_seq_max=n_seq,
            threads=self.threads, capture=capture, type_k=self.type_k, type_v=self.type_v, flash_attn=flash_attn,
            attn=attn_plan(gm, self.policy), kv_unified=not self.streams)
        self.n_ctx = int(ll.llama_n_ctx(self.ctx))
        # cells one sequence may hold: its own stream (llama.cpp's size, rounded up to 256), or the unified cache
        self.stream_cells = int(ll.llama_n_ctx_seq(self.ctx)) if self.streams else self.cells
        if self.streams:
            self.cells = self.stream_cells * sequences
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(max_batch_tokens, 0, 1)
        self.all_outputs = all_outputs(gm, self.blocks)
        self.n_vocab = gm.tokenizer.n_vocab
        self.eog = set(gm.tokenizer.eog_ids())
        self._inbox: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: list[_Req] = []  # in admission order
        self._free_ids = list(range(sequences))
        self._stop = threading.Event()
        # a scrape (any thread) reads ended sequences' totals plus the running ones': _end moves a sequence from
        # one to the other under this lock, so /metrics counters never count it twice or not at all
        self._lock = threading.Lock()
        self.fatal: str | None = None
        self.counters = dict(admitted=0, finished=0, failed=0, cancelled=0, preemptions=0, evictions=0,
                             evicted_tokens=0, steps=0, decodes=0, batch_rows=0, max_running=0, peak_cells=0,
                             prompts_evicted=0)
        # sequences holding cells, per decode; and the same over the decodes in which a request waited for cells
        # (a sequence id was free): what the cache holds when it is the limit (bench serve's "in flight, cache full")
        self.in_flight_hist: dict[int, int] = {}
        self.cache_full_hist: dict[int, int] = {}
        self._hold = False  # set by a preemption, cleared when a request ends
        self._in_use = 0  # cells held by running sequences, after the last step (read by gauges)
        self._mirror_bytes = 0  # bytes of the running sequences' key/value mirrors, after the last step (stats)
        # every buffer the running sequences keep for their policies (SequenceCache.buffer_bytes), summed: now (after
        # the last step) and at the most. Each publish sums every sequence's most since the last one (a sequence
        # that ended since, its last), so the peak counts each sequence's buffers after its decode, before its
        # scoring and eviction, as peak_cells counts cells (a bound: two sequences' moments may fall a record apart)
        self._buffers_now = dict.fromkeys((*SEQUENCE_BUFFERS, "total"), 0)
        self._buffers_peak = dict(self._buffers_now)
        self._ended_windows: list[dict] = []
        # the largest peak KV bytes of a sequence (SequenceCache.peak): of a running one after the last step, of an
        # ended one
        self._peak_live: dict = {}
        self._peak_ended: dict = {}
        # cells llama.cpp itself holds for any sequence id, counted by llama.cpp (not the mirrors) by the engine
        # thread each time it goes idle: 0 unless some ended request's cells were never removed
        self.llama_cells_idle = self.llama_cells()
        self.idle_checks = 0  # how many times the engine went idle and asked llama.cpp (0: the figure is the start's)
        self.trace: dict[str, list] | None = None  # test hook: request id -> the logits each token was drawn from
        self.on_step = None  # test hook: called by the engine thread after each step with this backend
        self._thread = threading.Thread(target=self._loop, name="epikv-llamacpp", daemon=True)
        self._thread.start()

    # -- the app's side (any thread) ---------------------------------------------------------------------------------
    def submit(self, rid, input_ids, max_tokens, *, sampling, seed, ignore_eos) -> None:
        if self._stop.is_set() or self.fatal:
            raise RuntimeError("the server is shutting down" if self._stop.is_set() else self.fatal)
        why = self.prompt_refusal(len(input_ids)) or self.total_refusal(len(input_ids), int(max_tokens))
        if why:  # refused here, not queued: the engine thread would wait for cells that never come free
            raise RuntimeError(why)
        sampler = None
        if sampling is not None and sampling.temperature > 0:
            from .sampling import RequestSampler

            sampler = RequestSampler(sampling, seed, input_ids, max_tokens, "cpu")
        policy = self.prompt_policy(len(input_ids))
        if policy is not self.policy:
            with self._lock:
                self.counters["prompts_evicted"] += 1
        self._inbox.put(("submit", _Req(rid, [int(t) for t in input_ids], int(max_tokens), sampler, ignore_eos,
                                        policy)))

    def next_output(self, timeout: float) -> Output | None:
        try:
            return self._out.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self, rid: str, completed: bool = False) -> None:
        self._inbox.put(("release" if completed else "cancel", rid))

    def release(self, rid: str) -> None:
        """The app is done with the request (it ended, or a stop string completed it): free its cells if it still
        runs, counted as finished, not cancelled; a no-op for a request already gone."""
        self._inbox.put(("release", rid))

    def healthy(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def need(self, r: _Req) -> int:
        """Cells a request must find free to be admitted: its protected prompt and recency window under an evicting
        policy (at most its whole length); a policy that never evicts reserves its whole length, prompt and
        max_tokens, so it is never preempted."""
        if self.policy.evicts:
            return min((r.policy or self.policy).protected(len(r.prompt)) + self.recent, r.known)
        return len(r.prompt) + r.max_tokens

    def prompt_policy(self, n_prompt: int):
        """The policy a request with this many prompt tokens runs: the served one, or where its protected prompt
        does not fit the budget the same with prompt protection off (Policy.for_prompt): the prompt is then evicted
        inside, between its prefill chunks, as `--no-protect-prompt` does."""
        return self.policy.for_prompt(self.budget, self.recent, n_prompt)

    def prompt_refusal(self, n_prompt: int) -> str | None:
        if self.policy.evicts:
            pol = self.prompt_policy(n_prompt)
            why = pol.protected_overflow(self.budget, self.recent, n_prompt)
            if why:
                return why
            need = pol.protected(n_prompt) + self.recent
            if min(need, n_prompt) > self.stream_cells:
                return (f"the prompt's protected tokens and recency window ({need}) exceed the {self.stream_cells} "
                        f"cells {'of a stream' if self.streams else ''}".rstrip())
        elif n_prompt + 1 > self.stream_cells:  # (the app refuses prompt + max_tokens beyond the cells: total_limit)
            return (f"prompt ({n_prompt} tokens) does not fit the {self.stream_cells} cells of the "
                    f"{'stream of a sequence' if self.streams else 'cache'}")
        return None

    def total_refusal(self, n_prompt: int, max_tokens: int) -> str | None:
        """Why a request of this length can never run: under `full` its prompt and max_tokens must fit the cells."""
        if not self.policy.evicts and n_prompt + max_tokens > self.stream_cells:
            where = "a sequence's stream in this server's llama.cpp cache (--ctx / --sequences)" if self.streams \
                else "this server's llama.cpp cache (--ctx)"
            return (f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the {self.stream_cells} cells of "
                    f"{where}")
        return None

    def stats(self) -> dict:
        c = dict(self.counters)
        c["evictions"], c["evicted_tokens"] = self._totals()
        mean, p50, _ = mean_p50(self.in_flight_hist)
        c["max_in_flight"] = max(self.in_flight_hist, default=0)
        c["in_flight_mean"], c["in_flight_p50"] = mean or 0.0, p50 or 0
        c["in_flight_cache_full_mean"], c["in_flight_cache_full_p50"], c["cache_full_steps"] = \
            mean_p50(self.cache_full_hist)
        peak = self._buffers_peak  # one read: the engine thread replaces it
        c.update(engine="llama.cpp", kv="streams" if self.streams else "unified", stream_cells=self.stream_cells,
                 cells=self.cells, cells_allocated=self.n_ctx, cells_in_use=self._in_use,
                 kv_bytes=self.n_ctx * self.cell_bytes or None, cache_type_k=self.type_k, cache_type_v=self.type_v,
                 cells_held_when_idle=self.llama_cells_idle, idle_checks=self.idle_checks,
                 sequences=self.sequences, max_batch_tokens=self.max_batch, policy=self.policy.name,
                 budget=self.budget, threads=self.threads, capture=self.capture.method if self.capture else None,
                 kv_mirror_bytes=self._mirror_bytes,
                 # every buffer the sequences keep for their policies, by kind and in all: now and at the most
                 buffer_bytes=dict(self._buffers_now), buffer_peak_bytes=dict(peak),
                 # the KV bytes with every buffer: the cells llama.cpp allocated and the buffers' most at once
                 kv_bytes_with_buffers_peak=(self.n_ctx * self.cell_bytes or 0) + peak["total"],
                 # one sequence's peak KV bytes (cells as stored + the policy's buffers: llamacpp.kvtypes), the
                 # largest over every sequence so far, with its parts
                 **self._peak_stats(),
                 running=len(self._running), waiting=len(self._waiting))
        return c

    def _peak_stats(self) -> dict:
        live, ended = self._peak_live, self._peak_ended
        p = live if live.get("bytes", 0) > ended.get("bytes", 0) else ended
        return {"kv_peak_bytes": p.get("bytes", 0), "kv_peak_cells_at_peak": p.get("cells", 0),
                "kv_peak_buffer_bytes": p.get("bytes", 0) - p.get("cell_bytes", 0)}

    def _totals(self) -> tuple[int, int]:
        """Evictions and evicted tokens: those of ended sequences and of the running ones (under the lock that
        _end holds while it moves a sequence from the second to the first)."""
        with self._lock:
            live = [r.seq for r in self._running if r.seq is not None]
            return (self.counters["evictions"] + sum(s.evictions for s in live),
                    self.counters["evicted_tokens"] + sum(s.evicted_tokens for s in live))

    def gauges(self) -> dict:
        ev, toks = self._totals()
        return {"cells_in_use": self._in_use, "cells_free": self.cells - self._in_use, "evictions": ev,
                "evicted_tokens": toks, "preemptions": self.counters["preemptions"]}

    def stop(self, block: bool = True, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout if block else 0)
        if not self._thread.is_alive() and self.ctx:
            self._ll.llama_batch_free(self.batch)
            self._ll.llama_free(self.ctx)
            self.ctx = None

    # -- the engine thread ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._commands(block=not (self._running or self._waiting))
                self._admit()
                if self._running:
                    self._step()
                    if self.on_step is not None:
                        self.on_step(self)
        except Exception as e:  # the context is in an unknown state: fail every request, stay unhealthy
            log.exception("the llama.cpp engine thread stopped")
            self.fatal = f"the llama.cpp engine stopped: {type(e).__name__}: {e}"
        for r in list(self._running) + list(self._waiting):
            self._out.put(Output(r.rid, list(r.generated), True, self.fatal or "the server is shutting down"))

    def _commands(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, x = item
            if kind == "submit":
                self._waiting.append(x)
            else:
                self._cancel(x, "cancelled" if kind == "cancel" else "finished")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, rid: str, how: str = "cancelled") -> None:
        for r in self._running:
            if r.rid == rid:
                self._end(r)
                self._hold = False
                self.counters[how] += 1
                return
        for r in self._waiting:
            if r.rid == rid:
                self._waiting.remove(r)
                self.counters[how] += 1
                return

    def llama_cells(self, seqs=None) -> int:
        """Cells llama.cpp holds for the given sequence ids (default: every id of this server), counted by
        llama.cpp from each sequence's state (engine thread only: llama.cpp's context is not thread-safe)."""
        n = 0
        for s in range(self.sequences) if seqs is None else seqs:
            if self.cell_counter is not None:
                n += self.cell_counter(s)
            else:
                n += int(self._ll.llama_memory_seq_pos_max(self.mem, s) >= 0)
        return n

    def _held(self) -> int:
        return sum(r.seq.stored() for r in self._running)

    def _publish(self) -> None:
        """The gauges a scrape reads from another thread, computed here by the engine thread, the only one that
        changes the sequences: a scrape that read a sequence itself could find it half-ended (`_end` clears r.seq,
        `drop` the mirror) and fail."""
        self._in_use = self._held()
        self._mirror_bytes = sum(r.seq.mirror_bytes() for r in self._running)
        seqs = [r.seq for r in self._running]
        windows, self._ended_windows = [s.buffers.take_window() for s in seqs] + self._ended_windows, []
        now = {k: sum(s.buffers.now[k] for s in seqs) for k in self._buffers_now}
        most = {k: sum(w[k] for w in windows) for k in self._buffers_now}
        self._buffers_now = now
        self._buffers_peak = {k: max(v, most[k]) for k, v in self._buffers_peak.items()}
        self._peak_live = max((r.seq.peak for r in self._running), key=lambda p: p["bytes"], default={})

    def _admit(self) -> None:
        while self._waiting and self._free_ids and not self._hold:
            r = self._waiting[0]
            if not self.streams:  # a stream of its own holds any admissible request (prompt_refusal)
                promised = sum(max(0, self.need(r) - r.seq.stored()) for r in self._running)
                if self.cells - self._held() - promised < self.need(r):
                    return
            self._waiting.popleft()
            if self.streams:  # lowest id first: decoding ids stay consecutive, so a step is few micro-batches
                self._free_ids.sort()
            seq = _Seq(self._ll, self.mem, self._free_ids.pop(0), self.gm, r.policy or self.policy, self.budget,
                       self.blocks, self.cell_counter, mirror_dtype(self.type_k, self.type_v), self.cell_bytes)
            # a sequence holds at most budget + tau - 1 cells and a step's rows
            seq.mirror_cells = min(self.cells, self.budget + self.policy.tau + self.max_batch if self.budget
                                   else self.cells)
            with self._lock:
                r.seq = seq
            r.fed = 0
            try:
                r.seq.start(len(r.prompt))
            except EpiKVError as e:
                self._fail(r, str(e))
                continue
            with self._lock:
                self._running.append(r)
            self.counters["admitted"] += 1
            self.counters["max_running"] = max(self.counters["max_running"], len(self._running))

    def _end(self, r: _Req) -> None:
        """Free the request's cells and sequence id at once."""
        seq = r.seq
        if seq is not None:
            self._ended_windows.append(seq.buffers.take_window())  # its last moments, for the next publish
            seq.drop()
        with self._lock:  # its counts move from the running to the ended totals in one step (see _totals)
            if seq is not None:
                if seq.peak["bytes"] > self._peak_ended.get("bytes", 0):
                    self._peak_ended = seq.peak
                self.counters["evictions"] += seq.evictions
                self.counters["evicted_tokens"] += seq.evicted_tokens
                self._free_ids.append(seq.seq)
                r.seq = None
            if r in self._running:
                self._running.remove(r)
        if not self._running and not self._waiting:  # idle now: what does llama.cpp itself still hold?
            self.llama_cells_idle = self.llama_cells()  # (before the gauge reads 0, so a reader of 0 sees it)
            self.idle_checks += 1
        self._publish()

    def _fail(self, r: _Req, why: str) -> None:
        self._end(r)
        self._hold = False
        self.counters["failed"] += 1
        self._out.put(Output(r.rid, list(r.generated), True, why))

    def _preempt(self, r: _Req) -> None:
        self._end(r)
        self.counters["preemptions"] += 1
        self._waiting.appendleft(r)
        self._hold = True  # no admission until a request ends: readmitted at once, it would be preempted again

    def _plan_streams(self) -> list[list[tuple[_Req, list[int]]]]:
        """This step's llama_decode calls, each one llama.cpp micro-batch in batch order (module docstring): the
        decoding sequences in runs of consecutive ids, one token each; then whole prompt chunks of min(the rest of
        the prompt, max_batch_tokens, the stream's free cells), each its own call, in admission order, while the
        step's rows stay within max_batch_tokens (the first chunk goes whatever the decodes took)."""
        decoding = sorted((r for r in self._running if r.fed >= len(r.prompt)), key=lambda r: r.seq.seq)
        calls, run = [], []
        for r in decoding:
            if r.seq.stored() + 1 > self.stream_cells:  # cannot happen for an admissible request (prompt_refusal)
                self._fail(r, f"the request does not fit the {self.stream_cells} cells of its stream")
                continue
            if run and r.seq.seq != run[-1][0].seq.seq + 1:
                calls.append(run)
                run = []
            run.append((r, [r.generated[r.fed - len(r.prompt)]]))
        if run:
            calls.append(run)
        rows, chunks = len(decoding), 0
        for r in list(self._running):
            if r.fed < len(r.prompt):
                t = min(len(r.prompt) - r.fed, self.max_batch, self.stream_cells - r.seq.stored())
                if t < 1:
                    self._fail(r, f"the request does not fit the {self.stream_cells} cells of its stream")
                    continue
                if chunks and rows + t > self.max_batch:
                    continue
                calls.append([(r, r.prompt[r.fed: r.fed + t])])
                rows += t
                chunks += 1
        return calls

    def _plan(self) -> list[tuple[_Req, list[int]]]:
        """This step's rows: every decoding sequence's next token, then prompt chunks, within the free cells and
        max_batch_tokens; preempts the most recently admitted sequence while the next tokens do not fit."""
        while True:
            free = self.cells - self._held()
            decoding = [r for r in self._running if r.fed >= len(r.prompt)]
            if len(decoding) <= free or len(self._running) == 1:
                break
            self._preempt(self._running[-1])
        plan, rows = [], 0
        for r in decoding:
            if free < 1:
                break
            plan.append((r, [r.generated[r.fed - len(r.prompt)]]))
            rows += 1
            free -= 1
        for r in self._running:
            if r.fed < len(r.prompt):
                t = min(len(r.prompt) - r.fed, self.max_batch - rows, free)
                if t > 0:
                    plan.append((r, r.prompt[r.fed: r.fed + t]))
                    rows += t
                    free -= t
        if not plan:  # nothing fits: the most recent sequence makes room, or a lone one can never run
            r = self._running[-1]
            if len(self._running) == 1:
                self._fail(r, f"the request does not fit the {self.cells} cells of the cache")
            else:
                self._preempt(r)
        return plan

    def _step(self) -> None:
        calls = self._plan_streams() if self.streams else [p for p in [self._plan()] if p]
        if not calls:
            return
        holding = len(self._running)
        self.counters["steps"] += 1
        self.in_flight_hist[holding] = self.in_flight_hist.get(holding, 0) + 1
        if self._waiting and self._free_ids:  # admission stopped at the cells (or a preemption's hold), not the ids
            self.cache_full_hist[holding] = self.cache_full_hist.get(holding, 0) + 1
        for plan in calls:
            self._decode(plan)
        self._publish()

    def _decode(self, plan: list[tuple[_Req, list[int]]]) -> None:
        """One llama_decode of the plan's rows in plan order; each sequence records its rows and samples."""
        ll, b = self._ll, self.batch
        j = 0
        for r, toks in plan:
            for i, tok in enumerate(toks):
                b.token[j] = tok
                b.pos[j] = r.seq.next_pos + i  # the sequence's next (true unless context-shift renumbered)
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = r.seq.seq
                b.logits[j] = 1 if (self.all_outputs or i == len(toks) - 1) else 0
                j += 1
        b.n_tokens = j
        if self.capture is not None:
            self.capture.reset()
        # cells at their fullest: after this decode, before the sequences record its rows (and evict)
        self.counters["peak_cells"] = max(self.counters["peak_cells"], self._held() + j)
        rc = ll.llama_decode(self.ctx, b)
        if rc != 0:
            for r, _ in plan:
                self._fail(r, f"llama_decode failed with status {rc}")
            return
        self.counters["decodes"] += 1
        self.counters["batch_rows"] += j
        cap = self.capture
        try:
            rows = cap.rows(j) if cap is not None and cap.blocks else None  # [blocks, j, dim], batch order
            # q/k/v -> layer -> [j, heads, dim]
            attn = cap.attn_rows(j) if cap is not None and cap.attn_nodes else None
        except Exception as e:  # this decode's rows are unusable: fail its requests (their cells go), serve on
            log.exception("the capture of a decode of %d rows failed", j)
            for r, _ in plan:
                self._fail(r, str(e))
            return
        end = 0
        for r, toks in plan:
            t = len(toks)
            off, end = end, end + t  # this request's rows: off .. end - 1
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, end - 1), shape=(self.n_vocab,))
            try:  # an error here is this request's alone: it fails, its cells go, the others go on
                if attn is not None:
                    r.seq.attend(t, {k: d.rows(off, end) for k, d in attn.items()})
                r.seq.record(t, rows.rows(off, end) if rows is not None else None)
                r.fed += t
                if r.fed == r.known:  # its newest logits are the next token's: sample it
                    self._sample(r, logits)
            except Exception as e:
                if not isinstance(e, EpiKVError):
                    log.exception("request %s failed in the llama.cpp engine", r.rid)
                self._fail(r, str(e) if isinstance(e, EpiKVError) else f"{type(e).__name__}: {e}")
        self._publish()

    def _sample(self, r: _Req, logits: np.ndarray) -> None:
        step = len(r.generated)
        if self.trace is not None:
            self.trace.setdefault(r.rid, []).append(logits.copy())
        if r.sampler is None:
            tok = int(np.argmax(logits))
        else:
            tok = r.sampler.choose(torch.from_numpy(logits.copy()), step)
        r.generated.append(tok)
        done = len(r.generated) >= r.max_tokens or (tok in self.eog and not r.ignore_eos)
        if done:
            self._end(r)
            self._hold = False
            self.counters["finished"] += 1
        self._out.put(Output(r.rid, list(r.generated), done))
