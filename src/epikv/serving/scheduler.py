"""Eviction inside transformers' continuous batching, from outside transformers.

A FIFOScheduler subclass, registered as "epikv" in transformers' SCHEDULER_MAPPING, evicts between steps: before
the parent schedules the next batch, every request over its budget K loses the whole pages the policy's page rule
leaves out (`Track.evict`), which go back to the pool, so the parent's admission sees them free. Hooks on the model
score the new tokens of each forward (forward hooks on the policy's blocks over the packed batch [1, T, H], split
per request in schedule order) and keep true RoPE positions (a pre-hook adds each request's evicted-token count to
its rows of position_ids). See docs/SERVING.md.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import torch

from ..errors import EpiKVError
from .checks import ServeSpec, ServingUnsupported, check_internals, check_serving, probe_cache
from .evictor import TRACK_BUFFERS, KVReader, Track
from .metrics import mean_p50 as _mean_p50

SCHEDULER_KEY = "epikv"
RECENT_FINISHED = 256  # finished requests whose evicted-token count /stats lists (a ring: bounded on a long run)
_RUNTIMES: dict[int, "Runtime"] = {}  # id(text config the cache is built from) -> runtime waiting for its scheduler
_CLASS = None


class Runtime:
    """Everything one served manager shares between its scheduler (generation thread) and the model hooks."""

    def __init__(self, model, spec: ServeSpec, policy) -> None:
        from ..cache import decoder_layers
        from ..signals import model_depth

        self.model, self.spec, self.policy = model, spec, policy
        self.layers = decoder_layers(model)
        self.depth = model_depth(model.config, len(self.layers))
        self.obs = policy.observes(self.depth)
        self.budget = spec.budget if policy.evicts else None
        self.recent = policy.recent_window(spec.budget) if policy.evicts else 0
        self.device = model.get_input_embeddings().weight.device
        self.tracks: dict[str, Track] = {}
        # (request id, state, stored before, new tokens, whether the forward predicts its next token, tokens it
        # has generated so far)
        self.batch: list[tuple[str, Any, int, int, bool, int]] | None = None
        self.samplers: dict = {}  # request id -> RequestSampler (serving/sampling.py); absent: greedy
        self.logit_rows: list[int] | None = None  # per request of the batch, its row of the model's logits (or -1)
        self.open = False
        self.hidden: dict[int, torch.Tensor] = {}
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [1, heads, rows, head_dim] of the open forward
        self.batch_open: list = []  # the batch of the open forward (the query hooks split its rows)
        self.scheduler = self.cache = self.lay = self.manager = None
        self.handles: list = []
        self.in_flight_hist: dict[int, int] = {}
        self.cache_full_hist: dict[int, int] = {}  # the same, over the forwards in which the cache held a request back
        self.checked_cu = False
        self.loop_thread: int | None = None  # the thread that schedules (and so runs) the batches
        self.lock = threading.Lock()
        self.stats = dict(peak_pages=0, pages_in_use=0, pages_freed=0, evictions=0, max_in_flight=0, offloads=0,
                          soft_resets=0, forks=0, refused=0, steps=0, chunked_prefills=0, finished=0,
                          evicted_tokens=0, prompts_evicted=0)
        # tokens evicted per finished request, the newest RECENT_FINISHED only; the totals above count them all
        self.finished_evicted: collections.OrderedDict[str, int] = collections.OrderedDict()
        # every buffer the requests keep for their policies (Track.buffer_bytes), summed over the requests: now and
        # at the most (after a forward has scored its tokens, before the evictions it triggers)
        self.buffers_now = dict.fromkeys((*TRACK_BUFFERS, "total"), 0)
        self.buffers_peak = dict(self.buffers_now)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def install(self) -> None:
        if getattr(self.model, "_epikv_serving", None) is not None:
            raise EpiKVError("this model already serves with epikv: stop that manager first")
        self.model._epikv_serving = self
        self.handles.append(self.model.register_forward_pre_hook(self._pre, with_kwargs=True))
        self.handles.append(self.model.register_forward_hook(self._post))
        for l in self.obs.hidden_layers:
            self.handles.append(self.layers[l].register_forward_hook(self._hidden_hook(l)))
        for l in self.obs.query_layers if self.obs.queries else ():  # Seg-Q: one layer's recomputed queries
            self.handles.append(self.layers[l].self_attn.register_forward_pre_hook(self._query_hook(l),
                                                                                   with_kwargs=True))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if getattr(self.model, "_epikv_serving", None) is self:
            self.model._epikv_serving = None
        for k, v in list(_RUNTIMES.items()):
            if v is self:
                del _RUNTIMES[k]

    def _hidden_hook(self, layer: int):
        def hook(module, args, output):
            if self.open:
                self.hidden[layer] = output[0] if isinstance(output, tuple) else output  # [1, T_packed, H]
        return hook

    def _query_hook(self, layer: int):
        """The rotated queries of each request's newest min(w, t) tokens of this forward, recomputed from the
        attention's packed input [1, T_packed, H] and the position embeddings it receives (true positions: _pre
        corrected position_ids), as the torch cache's query hook does for a row (hooks.rotated_queries)."""
        from ..hooks import rotated_queries

        def hook(module, args, kwargs):
            if not self.open:
                return None
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            w, rows, a = self.obs.queries, [], 0
            for _, _, _, t, _, _ in self.batch_open:
                rows.extend(range(a + max(0, t - w), a + t))
                a += t
            ix = torch.tensor(rows, dtype=torch.long, device=h.device)
            self.queries[layer] = rotated_queries(module, h[:, ix], cos[:, ix], sin[:, ix])  # [1, heads, rows, d]
            return None
        return hook

    def _pre(self, module, args, kwargs):
        # only the generation loop's own forward, planned by the scheduler (not a forward of another thread)
        if self.batch is None or threading.get_ident() != self.loop_thread:
            return None
        lens = [b[3] for b in self.batch]
        cu = kwargs.get("cu_seq_lens_q")
        pos = kwargs.get("position_ids")
        if pos is None or cu is None:
            raise ServingUnsupported("model(**batch_data) with position_ids and cu_seq_lens_q")
        if not self.checked_cu or pos.device.type == "cpu":  # rows of request i are cu[i]:cu[i+1], schedule order
            want = [0]
            for t in lens:
                want.append(want[-1] + t)
            if cu.tolist()[: len(want)] != want:
                raise ServingUnsupported("cu_seq_lens_q in schedule order", f"got {cu.tolist()}, expected {want}")
            self.checked_cu = True
        offs = [self.tracks[b[0]].evicted for b in self.batch]
        # the logits the model returns: one row per position, or (logits_to_keep) one per request that predicts a
        # token, in batch order
        kept = "logits_to_keep" in kwargs
        rows, j, end = [], 0, 0
        for _, _, _, t, new, _ in self.batch:
            end += t
            rows.append((j if kept else end - 1) if new else -1)
            j += bool(new)
        self.logit_rows = rows
        if any(offs):  # true RoPE position = stored slot + tokens evicted before it
            add = torch.repeat_interleave(torch.tensor(offs), torch.tensor(lens))
            add = torch.nn.functional.pad(add, (0, pos.shape[-1] - add.shape[0]))  # padded rows (none here)
            kwargs["position_ids"] = pos + add.to(pos.device, pos.dtype)[None]
        self.hidden, self.queries = {}, {}
        self.batch_open = self.batch
        self.open = True
        return args, kwargs

    def _post(self, module, args, output):
        if not self.open:
            return None
        self.open = False
        batch, self.batch = self.batch, None
        if self.samplers:
            self._sample(batch, output)
        if not self.policy.evicts:
            return None
        a = q = 0
        w = self.obs.queries
        for rid, state, n_old, t, _, _ in batch:
            tr = self.tracks.get(rid)
            tq = min(w, t)  # the query hook kept this request's newest tq tokens
            if tr is not None:
                hidden = {l: h[:, a:a + t] for l, h in self.hidden.items()}
                tr.observe(self.policy, hidden, n_old, t, self.kv(rid),
                           {l: x[:, :, q:q + tq] for l, x in self.queries.items()})
            a += t
            q += tq
        self.hidden, self.queries = {}, {}
        self.note_buffers()
        return None

    def note_buffers(self) -> None:
        """Sum every request's buffers now (generation thread) and raise the peak (/stats reads both)."""
        per = [tr.bytes for tr in list(self.tracks.values())]
        now = {k: sum(b[k] for b in per) for k in TRACK_BUFFERS}
        now["total"] = sum(now.values())
        with self.lock:
            self.buffers_now = now
            self.buffers_peak = {k: max(v, now[k]) for k, v in self.buffers_peak.items()}

    def _sample(self, batch, output) -> None:
        """Replace each sampled request's logits row by its own sampler's choice (serving/sampling.py)."""
        from .sampling import force

        logits = output.logits if hasattr(output, "logits") else output[0]  # [1, rows, vocab]
        for (rid, _, _, _, new, step), row in zip(batch, self.logit_rows):
            smp = self.samplers.get(rid)
            if smp is None or not new or row < 0:
                continue
            force(logits[0, row], smp.choose(logits[0, row], step))

    def kv(self, rid: str) -> KVReader:
        return KVReader(self.lay, rid, self.obs, self.policy)

    # -- scheduler side ------------------------------------------------------------------------------------------
    def attach(self, scheduler, cache) -> None:
        self.lay = probe_cache(cache, self.spec.page)
        self.scheduler, self.cache = scheduler, cache

    def new_track(self, state) -> Track:
        prompt = getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens)
        policy = self.prompt_policy(prompt)
        if policy is not self.policy and not getattr(state, "_epikv_prompt_evicted", False):
            state._epikv_prompt_evicted = True  # counted once per request (a soft reset makes a new track)
            self.stats["prompts_evicted"] += 1
        return Track(policy, self.depth, self.device, prompt, self.budget, self.recent)

    def prompt_policy(self, prompt: int):
        """The policy a request with this many prompt tokens runs: the served one, or where its protected prompt
        does not fit the budget the same with prompt protection off (Policy.for_prompt)."""
        return self.policy.for_prompt(self.budget, self.recent, prompt)

    def too_long(self, state) -> str | None:
        """The engine's own check (EpiKVCache.begin): what stays protected and the recency window must fit."""
        return self.protected_overflow(getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens))

    def protected_overflow(self, prompt: int) -> str | None:
        """Why a prompt of this many tokens can never be served within the budget, or None."""
        if not self.policy.evicts:
            return None
        return self.prompt_policy(prompt).protected_overflow(self.budget, self.recent, prompt)

    def capacity_overflow(self, prompt: int) -> str | None:
        """Why an evicting request with this many prompt tokens would not fit the paged cache even alone, or None.
        It holds at most its whole prompt, or (a prompt evicted inside) budget + tau - 1 stored tokens plus one
        prefill chunk of max_batch_tokens, since transformers prefills a long prompt in chunks and the scheduler
        evicts between them."""
        if not self.policy.evicts:
            return None  # `full` holds prompt + answer: the server checks that total itself
        spec = self.spec
        cap = spec.num_blocks * spec.page
        peak = min(prompt, self.budget + self.policy.tau - 1 + spec.max_batch_tokens)
        if peak <= cap:
            return None
        if peak == prompt:
            return (f"prompt ({prompt} tokens) exceeds the {cap} tokens a request may hold in this server's cache "
                    "(--num-blocks x --page); raise --num-blocks")
        return (f"a prompt of {prompt} tokens, evicted between its prefill chunks, holds up to {peak} tokens (budget "
                f"+ tau - 1 + --max-batch-tokens), over the {cap} of this server's cache (--num-blocks x --page); "
                "raise --num-blocks or lower --max-batch-tokens")

    def fail(self, scheduler, state, msg: str) -> None:
        rid = state.request_id
        scheduler.active_requests.pop(rid, None)
        if scheduler.waiting_requests.pop(rid, None) is not None and rid in scheduler.waiting_requests_order:
            scheduler.waiting_requests_order.remove(rid)
        scheduler.cache.free_blocks(rid)
        self.drop(rid)
        self.stats["refused"] += 1
        router = getattr(self.manager, "output_router", None)
        if router is not None:
            router.fail_and_deliver(state, EpiKVError(msg))

    def drop(self, rid: str) -> None:
        tr = self.tracks.pop(rid, None)
        if tr is not None:
            with self.lock:
                self.stats["finished"] += 1
                self.stats["evicted_tokens"] += tr.evicted
                ring = self.finished_evicted
                ring[rid] = tr.evicted
                while len(ring) > RECENT_FINISHED:
                    ring.popitem(last=False)
            self.note_buffers()

    def pages_in_use(self) -> int:
        """Pages held by requests now (read live: any thread may ask while the loop allocates and frees)."""
        if self.lay is None:
            return 0
        for _ in range(10):
            try:
                return sum(len(t) for t in list(self.lay.block_table.values()))
            except RuntimeError:  # the table changed size while it was copied: read again
                continue
        return self.stats["pages_in_use"]


def scheduler_class():
    """The EpiKV scheduler class, built on this transformers' FIFOScheduler and registered as "epikv"."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    sched_mod, req_mod, _ = check_internals()
    Status = req_mod.RequestStatus

    class EpiKVScheduler(sched_mod.FIFOScheduler):
        """FIFO scheduling after page eviction of every request over its budget (epikv.serving)."""

        def __init__(self, cache, safety_margin, max_requests_per_batch):
            self._rt = None
            super().__init__(cache, safety_margin, max_requests_per_batch)
            rt = _RUNTIMES.get(id(cache.config))
            if rt is None:
                raise EpiKVError("the epikv scheduler runs only under epikv.serving.start_manager")
            rt.attach(self, cache)
            self._rt = rt

        def reset(self) -> None:
            super().reset()
            rt = getattr(self, "_rt", None)
            if rt is not None:  # a manager reset: every request is gone
                for rid in list(rt.tracks):
                    rt.drop(rid)
                rt.batch, rt.open = None, False

        def add_waiting_request(self, state) -> None:
            rt = self._rt
            if rt is not None:
                # back from preemption: a CPU-offloaded request keeps its pages' content and its state; a soft
                # reset is a new request (prompt + generated so far, the true prompt length kept), whose state
                # starts over
                if getattr(state, "is_cpu_offloaded", False):
                    rt.stats["offloads"] += 1
                elif len(state.initial_tokens) > (getattr(state, "_true_initial_tokens", 0)
                                                  or len(state.initial_tokens)):
                    rt.stats["soft_resets"] += 1
            super().add_waiting_request(state)

        def finish_request(self, request_id: str) -> None:
            state = self.active_requests.get(request_id)
            if self._rt is not None and not (state is not None and state.status == Status.PENDING):
                self._rt.drop(request_id)  # finished, failed or soft reset (a CPU offload comes back PENDING)
            super().finish_request(request_id)

        def clear_cancelled_requests(self):
            cancelled = super().clear_cancelled_requests()
            for state in cancelled:
                self._rt.drop(state.request_id)
            return cancelled

        def schedule_batch(self, token_budget: int, cache_budget: int):
            rt = self._rt
            rt.batch, rt.open = None, False
            for rid, state in list(self.active_requests.items()):
                if rid not in rt.tracks and "__child#" in rid:  # a fork (num_return_sequences > 1)
                    parent = rt.tracks.get(rid.rsplit("__child#", 1)[0])
                    if parent is not None:
                        rt.tracks[rid] = parent.fork()
                        rt.stats["forks"] += 1
            for rid in list(self.waiting_requests_order):
                state = self.waiting_requests.get(rid)
                if state is not None and not getattr(state, "_epikv_checked", False):
                    msg = rt.too_long(state)
                    if msg:
                        rt.fail(self, state, msg)
                    else:
                        state._epikv_checked = True  # checked once per request (a soft reset is checked again)
            if rt.policy.evicts:
                for rid, state in list(self.active_requests.items()):
                    tr = rt.tracks.get(rid)
                    if tr is None or state.status not in (Status.DECODING, Status.PREFILLING):
                        continue
                    if getattr(state, "is_cpu_offloaded", False) or not tr.due(rt.policy, state.position_offset,
                                                                               rt.budget):
                        continue
                    try:
                        freed = tr.evict(rt.policy, rt.lay, state, rt.budget, rt.recent, rt.kv(rid))
                    except EpiKVError as e:
                        rt.fail(self, state, str(e))
                        continue
                    rt.stats["pages_freed"] += freed
                    rt.stats["evictions"] += 1
                rt.note_buffers()
            out = super().schedule_batch(token_budget, cache_budget)
            scheduled = out[0]
            if scheduled:
                batch = []
                for fs in scheduled:
                    state = fs.state
                    rid = state.request_id
                    if rid not in rt.tracks:
                        rt.tracks[rid] = rt.new_track(state)
                    batch.append((rid, state, state.position_offset, fs.query_length, bool(fs.has_new_token),
                                  len(state.generated_tokens)))
                    if not fs.has_new_token and not getattr(state, "_epikv_chunked", False):
                        state._epikv_chunked = True  # its prefill continues in a later forward: chunked
                        rt.stats["chunked_prefills"] += 1
                rt.batch = batch
                rt.loop_thread = threading.get_ident()
            st = rt.stats
            st["steps"] += 1
            holding = sum(1 for rid, t in rt.lay.block_table.items() if t)  # requests whose KV is in the cache
            st["max_in_flight"] = max(st["max_in_flight"], holding)
            if scheduled:  # how many requests hold pages, per forward (a histogram: bounded memory)
                rt.in_flight_hist[holding] = rt.in_flight_hist.get(holding, 0) + 1
                if self.waiting_requests and cache_bound(scheduled, token_budget,
                                                         getattr(self, "max_requests_per_batch", None)):
                    rt.cache_full_hist[holding] = rt.cache_full_hist.get(holding, 0) + 1
            st["max_batch"] = max(st.get("max_batch", 0), len(scheduled or ()))
            st["pages_in_use"] = rt.pages_in_use()
            st["peak_pages"] = max(st["peak_pages"], st["pages_in_use"])
            return out

    sched_mod.SCHEDULER_MAPPING[SCHEDULER_KEY] = EpiKVScheduler
    _CLASS = EpiKVScheduler
    return _CLASS


def cache_bound(scheduled, token_budget: int, max_requests: int | None) -> bool:
    """Whether a forward that left a request waiting did so for want of pages: it had room for more tokens and
    more requests, so the waiting request was not admitted (or was preempted) because the cache was full."""
    tokens = sum(fs.query_length for fs in scheduled)
    return tokens < token_budget and (max_requests is None or len(scheduled) < max_requests)


def _cb_config(spec: ServeSpec):
    from .layout import layout_kind

    _, _, CBConfig = check_internals()
    kw = dict(num_blocks=spec.num_blocks, max_batch_tokens=spec.max_batch_tokens,
              allow_block_sharing=False, use_async_batching=False, use_cuda_graph=False,
              scheduler_type=SCHEDULER_KEY)
    kw[layout_kind().page_field] = spec.page  # page_size (5.18+) or block_size (5.17)
    kw.update(spec.cb or {})
    try:
        return CBConfig(**kw)
    except TypeError as e:
        raise EpiKVError(f"ContinuousBatchingConfig refused the settings: {str(e).splitlines()[0]}") from None


def _check_resolved(cb) -> None:
    """After transformers resolved its defaults: nothing that breaks eviction came back on."""
    graphs = getattr(cb, "use_cuda_graph", False)
    if cb.allow_block_sharing or cb.use_async_batching or (any(graphs) if isinstance(graphs, tuple) else graphs):
        raise ServingUnsupported("ContinuousBatchingConfig resolution", "block sharing, async batching or CUDA "
                                 "graphs were turned on despite being set off")
    if getattr(cb, "scheduler_type", None) != SCHEDULER_KEY:
        raise ServingUnsupported("ContinuousBatchingConfig.scheduler_type")


def start_manager(model, spec: ServeSpec, generation_config=None):
    """A started transformers ContinuousBatchingManager serving `spec` (the epikv scheduler and hooks installed).
    Use transformers' manager API (add_request, get_result, request_id_iter, stop); `serving_stats(manager)`."""
    policy = check_serving(model, spec)
    scheduler_class()
    cb = _cb_config(spec)
    rt = Runtime(model, spec, policy)
    rt.install()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    _RUNTIMES[id(cfg)] = rt
    # some versions (5.17) switch the model to paged attention when the manager is made; a refused start restores it
    attn = model.config._attn_implementation
    try:
        manager = model.init_continuous_batching(generation_config=generation_config,
                                                 continuous_batching_config=cb)
        rt.manager = manager
        _check_resolved(manager.continuous_batching_config)
        # build the batch processor (hence the scheduler and its cache probe) here, so a refusal raises in this thread
        if hasattr(manager, "warmup"):
            manager.warmup()
        else:
            manager.batch_processor = manager._create_batch_processor()
        if rt.scheduler is None:
            raise ServingUnsupported("scheduler_type", "the epikv scheduler was not instantiated from "
                                     "SCHEDULER_MAPPING")
        manager._epikv_runtime = rt
        original_stop = manager.stop

        def stop(*args, **kwargs):
            try:
                return original_stop(*args, **kwargs)
            finally:
                if not manager.is_running():
                    rt.close()

        manager.stop = stop
        manager.start()
    except BaseException:
        rt.close()
        if model.config._attn_implementation != attn:
            model.set_attn_implementation(attn)
        raise
    return manager


def prompt_refusal(manager, prompt_tokens: int) -> str | None:
    """Why a prompt of `prompt_tokens` tokens would fail in this served manager, or None; lets a server refuse it up
    front: what stays protected of it and the recency window exceed the budget (the same line the engine gives), or
    the most it holds at once exceeds the paged cache."""
    rt = getattr(manager, "_epikv_runtime", None)
    if rt is None:
        raise EpiKVError("this manager was not started by epikv.serving.start_manager")
    return rt.protected_overflow(prompt_tokens) or rt.capacity_overflow(prompt_tokens)


def serving_stats(manager) -> dict:
    """Counters of a served manager: peak_pages, pages_in_use and pages_free (read now), pages_freed, evictions,
    max_in_flight, preemptions (offloads + soft resets), finished requests and the tokens evicted from them, and the
    tokens evicted per request for the live ones and the newest RECENT_FINISHED finished ones."""
    rt = getattr(manager, "_epikv_runtime", None)
    if rt is None:
        raise EpiKVError("this manager was not started by epikv.serving.start_manager")
    with rt.lock:
        st = dict(rt.stats)
        evicted = dict(rt.finished_evicted)
        # the requests' policy buffers (Track.buffer_bytes) by kind and their sum, now and at the most
        st["buffer_bytes"], st["buffer_peak_bytes"] = dict(rt.buffers_now), dict(rt.buffers_peak)
    for rid, tr in list(rt.tracks.items()):
        evicted[rid] = tr.evicted
    st["evicted"] = evicted  # the live requests and the newest finished ones (counters: finished, evicted_tokens)
    # live, not as of the last scheduled step: pages return when a request ends, after that step
    st["pages_in_use"] = rt.pages_in_use()
    st["pages_free"] = rt.lay.free_count() if rt.lay is not None else None
    st["preemptions"] = st["offloads"] + st["soft_resets"]
    # requests holding pages, over the forwards: the mean and median say what the cache sustains; the max is
    # often the first burst of prompts, admitted before any of them has grown
    mean, p50, _ = _mean_p50(rt.in_flight_hist)
    st["in_flight_mean"], st["in_flight_p50"] = mean or 0.0, p50 or 0
    # the same over the forwards in which a request waited for pages: what the cache holds when it is the limit,
    # free of the ramp-up and of the tail (the last requests running alone); None when the cache never was the limit
    st["in_flight_cache_full_mean"], st["in_flight_cache_full_p50"], st["cache_full_steps"] = \
        _mean_p50(rt.cache_full_hist)
    st["num_blocks"] = rt.lay.num_blocks if rt.lay is not None else None
    st["kv_bytes"] = kv_bytes(rt.lay) if rt.lay is not None else None
    st["policy"], st["budget"], st["page"] = rt.policy.name, rt.budget, rt.spec.page
    return st


def kv_bytes(lay) -> int:
    """Bytes of K and V in the pages a request may hold (num_blocks x page tokens, every full-attention layer), to
    compare caches at equal bytes (bench serve; llama.cpp's server reports its cells' bytes). transformers' own
    allocation can be larger (spare blocks, its pool's granularity: version-dependent), so it is not counted."""
    per_token = 0
    for layer in lay.layers:
        for t in lay.kv(layer):  # [slots, kv_heads, head_dim]
            per_token += t.shape[-2] * t.shape[-1] * t.element_size()
    return lay.num_blocks * lay.page_size * per_token


def run_batch(model, spec: ServeSpec, prompts: list[list[int]], max_new_tokens: int, generation_config=None,
              timeout: float = 600.0) -> tuple[list[list[int]], dict]:
    """Start a manager, submit every prompt at once, collect, stop. Returns (generated ids per prompt, stats).
    Greedy unless generation_config says otherwise."""
    from transformers import GenerationConfig

    if generation_config is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = model.config.eos_token_id if eos is None else eos
        generation_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos)
    manager = start_manager(model, spec, generation_config)
    outs: dict[str, Any] = {}
    try:
        ids = [f"epikv-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            manager.add_request(list(p), request_id=rid, max_new_tokens=max_new_tokens)
        end = time.monotonic() + timeout
        while len(outs) < len(ids):
            left = end - time.monotonic()
            if left <= 0:
                raise EpiKVError(f"run_batch: {len(ids) - len(outs)} of {len(ids)} requests unfinished after "
                                 f"{timeout:.0f} s")
            res = manager.get_result(timeout=min(left, 1.0))
            if res is None:
                if not manager.is_running():
                    raise EpiKVError("run_batch: the generation loop stopped before every request finished")
                continue
            if res.is_finished() or getattr(res, "error", None):
                outs[res.request_id] = res
        stats = serving_stats(manager)
    finally:
        manager.stop(block=True, timeout=60)
    errors = [o.error for o in outs.values() if getattr(o, "error", None)]
    if errors:
        raise EpiKVError(str(errors[0]).splitlines()[0])
    return [list(outs[rid].generated_tokens) for rid in ids], stats
