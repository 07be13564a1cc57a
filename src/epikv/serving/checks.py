"""What serving with eviction needs from transformers' continuous batching, checked before anything runs.

Every refusal is an EpiKVError with a one-line message. `check_serving` is cheap (no cache is built); the probe that
exercises the paged cache's block bookkeeping runs when the scheduler is created (`probe_cache`).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from ..errors import EpiKVError
from .internals import ServingUnsupported, need as _need, params as _params

MIN_PAGES = 4  # a budget must hold at least this many pages (prompt, recency, newest page and one to evict)


@dataclass
class ServeSpec:
    """What `start_manager` serves: a policy at page granularity inside transformers' continuous batching.

    policy: a registered policy name ("full" = no eviction; default: `default_policy("serve-torch")`); settings: its settings (as `--set`); budget: K tokens
    kept per request; page: tokens per page, both the policy's page and the paged cache's `page_size`; num_blocks: the
    paged cache's size in pages (required: never the default that sizes it from free memory); max_batch_tokens:
    tokens per forward (a prompt longer than this is prefilled in chunks); recency / tau: the policy's `recent` and
    `tau` (None = the policy's defaults, as in `epikv generate`); cb: other ContinuousBatchingConfig settings."""

    policy: str = field(default_factory=lambda: _default_policy())
    settings: dict = field(default_factory=dict)
    budget: int | None = 512
    page: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int = 256
    recency: int | None = None
    tau: int | None = None
    cb: dict = field(default_factory=dict)


def _default_policy() -> str:
    from ..policies import default_policy

    return default_policy("serve-torch")  # ENTRY_DEFAULTS: its own default where it refuses the common one


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise EpiKVError(f"{name} must be a positive integer, got {v!r}")


def build_policy(spec: ServeSpec):
    """The policy instance the scheduler runs (page = spec.page), refusing those that cannot run in a paged engine
    from hidden states or keys / values alone."""
    from ..policies import Policy, get_policy

    settings = dict(spec.settings or {})
    for k, v in (("recent", spec.recency), ("tau", spec.tau)):
        if v is not None:
            if k in settings and settings[k] != v:
                raise EpiKVError(f"{k} is given twice ({settings[k]!r} in the settings, {v!r} in the spec)")
            settings[k] = v
    if "page" in settings and settings["page"] != spec.page:
        raise EpiKVError(f"{spec.policy}: page={settings['page']} differs from the paged cache's page size "
                         f"{spec.page}: the policy must evict exactly the engine's pages")
    settings.pop("page", None)
    if spec.policy == "full":
        return get_policy("full", **settings)
    pol = get_policy(spec.policy, **settings)
    why = None
    probe = pol.observes(32)
    if not pol.evicts:
        return pol
    if probe.attention_layers:
        why = "needs attention weights, which paged attention kernels never produce"
    elif probe.queries and not probe.query_layers:
        why = "reads recomputed query states of every layer, which the serving hooks capture at named layers only"
    elif pol.granularity != "token":
        why = f"keeps a different token set per {pol.granularity}, which a paged engine cannot free page by page"
    elif not pol.pages_ok():  # its own keep rule, blind to pages
        why = "has its own keep rule, not a page rule"
    elif pol.uncompressed_layers(32):
        why = "leaves some layers uncompressed, which one page table per request cannot express"
    if why:
        raise EpiKVError(f"policy {pol.name} cannot serve with eviction: it {why} (served policies read hidden "
                         "states, keys/values or one layer's recomputed queries at token granularity: epikv, epikv-raw, "
                         "epikv-seg, epikv-seg-q, streaming, random, kv-key, lag-kv, ...)")
    try:
        paged = dataclasses.replace(pol, page=spec.page)
    except EpiKVError as e:
        raise EpiKVError(str(e)) from None
    if hasattr(pol, "fallback"):  # the default (no policy named): keeps its fallback (policies.for_model)
        paged.fallback = pol.fallback
    return paged


def check_spec(spec: ServeSpec, cb_fields: set | None = None) -> Any:
    if not isinstance(spec, ServeSpec):
        raise EpiKVError(f"expected a ServeSpec, got {type(spec).__name__}")
    _positive_int("page", spec.page)
    if spec.page < 4:
        raise EpiKVError(f"page must be at least 4 tokens (transformers' minimum page_size), got {spec.page}")
    if spec.num_blocks is None:
        raise EpiKVError("num_blocks is required: without it transformers sizes the paged cache at 90% of free "
                         "memory and zero-fills it")
    _positive_int("num_blocks", spec.num_blocks)
    _positive_int("max_batch_tokens", spec.max_batch_tokens)
    pol = build_policy(spec)
    if pol.evicts:
        _positive_int("budget", spec.budget)
        if spec.budget < MIN_PAGES * spec.page:
            raise EpiKVError(f"budget {spec.budget} is under {MIN_PAGES} pages of {spec.page}: page eviction needs "
                             f"room for the prompt, the recency window, the newest page and one to drop; raise it "
                             f"to at least {MIN_PAGES * spec.page}")
    bad = {"allow_block_sharing": "block sharing / prefix caching hashes tokens by page index, wrong once pages are "
                                  "evicted (false prefix hits)",
           "use_async_batching": "async batching schedules one batch ahead, so evictions and positions would be one "
                                 "step late",
           "use_cuda_graph": "CUDA graphs replay captured kernels, so the Python hooks that score and correct "
                             "positions would run only at capture"}
    fixed = {"page_size", "block_size", "num_blocks", "max_batch_tokens", "scheduler_type"}
    if not isinstance(spec.cb or {}, dict):
        raise EpiKVError(f"cb must be a dict of ContinuousBatchingConfig settings, got {type(spec.cb).__name__}")
    for k, v in (spec.cb or {}).items():
        if cb_fields is not None and k not in cb_fields:
            raise EpiKVError(f"ContinuousBatchingConfig has no setting {k!r}")
        if k in fixed:
            raise EpiKVError(f"cb setting {k} is set by the spec (page, num_blocks, max_batch_tokens) or by epikv "
                             "(scheduler_type): give it there")
        if k in bad and v not in (False, None, (False, False)):
            raise EpiKVError(f"{k}={v!r} is refused with eviction: {bad[k]}")
        if k in ("varlen_compile_config", "decode_compile_config") and v is not None or (
                k == "default_compile_level" and v):
            raise EpiKVError(f"{k}={v!r} is refused with eviction: a compiled forward would not run the hooks")
    return pol


def cb_config_fields(cls) -> set:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


def check_internals():
    """The transformers internals the scheduler touches, present with the signatures it calls. Returns the
    modules (scheduler module, requests module, ContinuousBatchingConfig)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            raise ServingUnsupported("ContinuousBatchingConfig") from None
    try:
        from transformers.generation.continuous_batching import scheduler as sched_mod
        from transformers.generation.continuous_batching import requests as req_mod
        from transformers.generation.continuous_batching import cache as cache_mod
    except ImportError as e:
        raise ServingUnsupported("transformers.generation.continuous_batching", type(e).__name__) from None
    from .layout import layout_kind

    kind = layout_kind()
    fields = cb_config_fields(ContinuousBatchingConfig)
    for f in (kind.page_field, "num_blocks", "max_batch_tokens", "allow_block_sharing", "use_async_batching",
              "use_cuda_graph", "scheduler_type"):
        if f not in fields:
            raise ServingUnsupported(f"ContinuousBatchingConfig.{f}")
    mapping = _need(sched_mod, "SCHEDULER_MAPPING", "scheduler")
    if not isinstance(mapping, dict):
        raise ServingUnsupported("scheduler.SCHEDULER_MAPPING", "not a dict")
    fifo = _need(sched_mod, "FIFOScheduler", "scheduler")
    _params(fifo.schedule_batch, "FIFOScheduler.schedule_batch", ("token_budget", "cache_budget"))
    _params(fifo.__init__, "FIFOScheduler.__init__", ("cache", "safety_margin", "max_requests_per_batch"))
    for m in ("finish_request", "clear_cancelled_requests", "reset", "add_waiting_request"):
        _need(fifo, m, "Scheduler")
    state_cls = _need(req_mod, "RequestState", "requests")
    sfields = {f.name for f in dataclasses.fields(state_cls)} if dataclasses.is_dataclass(state_cls) else set()
    # (_true_initial_tokens and is_cpu_offloaded, of soft resets and CPU offloading, are read only where present)
    for f in ("request_id", "initial_tokens", "position_offset", "generated_tokens"):
        if f not in sfields:
            raise ServingUnsupported(f"RequestState.{f}")
    status = _need(req_mod, "RequestStatus", "requests")
    for st in ("PENDING", "PREFILLING", "DECODING", "FINISHED"):
        _need(status, st, "RequestStatus")
    try:
        from transformers.generation.continuous_batching import continuous_api as api_mod
    except ImportError:
        raise ServingUnsupported("continuous_batching.continuous_api") from None
    mgr = _need(api_mod, "ContinuousBatchingManager", "continuous_api")
    for m in ("start", "stop", "is_running", "add_request", "get_result", "cancel_request"):
        _need(mgr, m, "ContinuousBatchingManager")
    if not (hasattr(mgr, "warmup") or hasattr(mgr, "_create_batch_processor")):
        raise ServingUnsupported("ContinuousBatchingManager.warmup")
    fs = _need(req_mod, "FutureRequestState", "requests")
    _params(fs.__init__, "FutureRequestState.__init__", ("state", "has_new_token", "query_length"))
    pac = _need(cache_mod, "PagedAttentionCache", "cache")
    _need(pac, "free_blocks", "PagedAttentionCache")
    if kind.name == "cache_allocators":
        from transformers.generation.continuous_batching.cache_allocators import cache_allocator as ca_mod
        from transformers.generation.continuous_batching.cache_allocators import full_attention as fa_mod

        ledger = _need(ca_mod, "BlockLedger", "cache_allocator")
        _params(ledger.release, "BlockLedger.release", ("block_id", "no_cache"))
        fa = _need(fa_mod, "FullAttentionCacheAllocator", "full_attention")
        _params(fa.allocate_cache_to_request, "FullAttentionCacheAllocator.allocate_cache_to_request",
                ("request_id", "past_length", "query_length"))
    else:  # 5.17: cache_manager; a request's page count lives in its state too
        from transformers.generation.continuous_batching import cache_manager as cm_mod

        fa = _need(cm_mod, "FullAttentionCacheAllocator", "cache_manager")
        _params(fa.allocate_blocks, "FullAttentionCacheAllocator.allocate_blocks",
                ("n_blocks", "request_id", "block_manager"))
        if "allocated_blocks" not in sfields:
            raise ServingUnsupported("RequestState.allocated_blocks")
    for m in ("get_read_indices", "get_write_indices"):
        _params(_need(fa, m, "FullAttentionCacheAllocator"), f"FullAttentionCacheAllocator.{m}",
                ("request_id", "past_length", "query_length"))
    return sched_mod, req_mod, ContinuousBatchingConfig


def check_model(model, pol) -> None:
    from ..cache import attention_layout, decoder_layers
    from ..signals import check_layers, model_depth

    layers = decoder_layers(model)
    depth = model_depth(model.config, len(layers))
    sliding, _ = attention_layout(model, depth)
    if sliding:
        raise EpiKVError("models with sliding-window layers are not served with eviction (their paged cache is a "
                         "separate allocator that keeps a window): only all-full-attention models")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "kv_lora_rank", None) is not None:
        raise EpiKVError("MLA models (compressed latents) are not served with eviction")
    obs = pol.observes(depth)
    check_layers(obs.hidden_layers, depth)


def check_serving(model, spec: ServeSpec):
    """Raise an EpiKVError (one line) for every setting that serving with eviction cannot honour. Cheap: builds no
    cache. Returns the policy instance."""
    _, _, cb_cls = check_internals()
    pol = check_spec(spec, cb_config_fields(cb_cls))
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        raise EpiKVError("this model holds a cached continuous batching manager (stop(keep_for_next_session=True)): "
                         "destroy it first (model.destroy_cached_continuous_batching_manager())")
    check_model(model, pol)
    if getattr(pol, "check_model", None) is not None:  # learned weights: fitted on this very model?
        import dataclasses

        from ..cache import _check_learned, decoder_layers
        from ..fingerprint import model_fingerprint
        from ..policies import for_model
        from ..signals import model_depth

        layers = decoder_layers(model)
        fp, depth = model_fingerprint(model, layers), model_depth(model.config, len(layers))
        # the default (no policy named) falls back where no weights fit this model; a named one is refused
        pol = for_model(pol, lambda p: _check_learned(p, fp, depth),
                        build=lambda name: check_spec(dataclasses.replace(spec, policy=name, settings={}),
                                                      cb_config_fields(cb_cls)))
    return pol


def probe_cache(cache, page: int) -> Any:
    """Exercise, on the real paged cache and before any request, every block operation eviction uses: allocate
    two pages for a probe request, drop the first one the way eviction does, check the free count and the write
    slot, free the rest. Returns the cache's Layout."""
    from .layout import layout_for

    lay = layout_for(cache)
    if lay.page_size != page:
        raise ServingUnsupported("page size", f"the cache has pages of {lay.page_size}, the spec {page}")
    rid = "__epikv_probe__"
    try:
        free0 = lay.free_count()
        if free0 < 2:
            raise EpiKVError("num_blocks is too small: the paged cache cannot hold 2 pages")
        lay.allocate(rid, 2 * page)
        table = list(lay.block_table.get(rid, ()))
        if len(table) != 2 or lay.free_count() != free0 - 2:
            raise ServingUnsupported("block allocation", "did not take 2 pages for 2 pages of tokens")
        w = lay.write_indices(rid, page, 1)
        if list(w) != [table[1] * lay.stride()]:
            raise ServingUnsupported("get_write_indices", "slot of a token no longer follows past_length")
        lay.drop(rid, [0])
        if lay.block_table[rid] != table[1:] or lay.free_count() != free0 - 1:
            raise ServingUnsupported("block table / block release", "dropping a page did not return it to the pool")
        if list(lay.write_indices(rid, 0, 1)) != [table[1] * lay.stride()]:
            raise ServingUnsupported("get_write_indices", "slots do not follow the block table after a drop")
        if not lay.layers:
            raise ServingUnsupported("full-attention layer indices", "none found")
        k, v = lay.kv(lay.layers[0])
        if k.dim() != 3 or k.shape[0] < lay.num_blocks * lay.stride():
            raise ServingUnsupported("KV tensors", "not [slots, kv_heads, head_dim] over every page")
    finally:
        cache.free_blocks(rid)
        lay.tidy()
    if lay.free_count() != free0:
        raise ServingUnsupported("PagedAttentionCache.free_blocks", "freeing the probe did not return its pages")
    return lay
