"""The engine behind `epikv serve`, built from a `ServeConfig`: transformers' continuous batching over a paged cache
(`--engine torch`) or one llama.cpp context (`--engine llama.cpp`), with the app's `Server` on it.

`prepare(cfg)` loads the model and refuses what the model cannot serve (EpiKVError, one line); the function it
returns starts the engine. The single server binds its port between the two; a Ray Serve replica calls both in its
constructor. The options were checked by the CLI (epikv.commands.serve) when it built the config.
"""

from __future__ import annotations

import dataclasses

import importlib
import sys

from ..errors import EpiKVError
from .config import ServeConfig

_NEEDS = ("fastapi", "uvicorn", "prometheus_client")


def check_installed() -> None:
    """Refuse, in one line, a server whose web packages are missing."""
    missing = []
    for m in _NEEDS:
        try:
            importlib.import_module(m)
        except ImportError:
            missing.append(m)
    if missing:
        raise EpiKVError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
                         "pip install 'epikv[serve]'")


def prepare(cfg: ServeConfig):
    """Load the model and refuse what it cannot serve; returns start() -> (server, stop, banner): the engine started
    and the app's Server on it, a function that stops the engine, and a line that says what is served."""
    check_installed()
    if cfg.engine == "llama.cpp":
        return _prepare_llamacpp(cfg)
    import torch

    from ..models import load_model
    from . import ServeSpec, check_serving

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    spec = ServeSpec(policy=cfg.policy, settings=dict(cfg.settings), budget=cfg.budget, page=cfg.page,
                     num_blocks=cfg.num_blocks, max_batch_tokens=cfg.max_batch_tokens, recency=cfg.recent, tau=cfg.tau)
    lm = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, device_map=cfg.device_map,
                    attn_implementation=cfg.attn)
    pol = check_serving(lm.model, spec)  # refusals (EpiKVError, one line) before the port is bound
    if pol.name != spec.policy:  # the default fell back on this model (one warning line): serve and report that one
        spec = dataclasses.replace(spec, policy=pol.name, settings={})
    return lambda: _start_torch(cfg, lm, spec)


def _max_positions(model) -> int | None:
    c = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return getattr(c, "max_position_embeddings", None)


def _settings(settings: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}


def _queue_info(cfg: ServeConfig) -> dict:
    """The request-handling options /stats reports for either engine."""
    return {"reasoning_parser": cfg.reasoning_parser, "max_waiting": cfg.max_waiting,
            "request_timeout": cfg.request_timeout, "drain_timeout": cfg.drain_timeout}


def _start_torch(cfg: ServeConfig, lm, spec):
    from transformers import GenerationConfig

    from ..engine import eos_ids
    from . import start_manager
    from .app import Server
    from .backend import TransformersBackend

    eos = eos_ids(lm.model, lm.tokenizer)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    # the engine decodes greedily; a sampled request's own sampler picks its tokens (serving/sampling.py)
    gc = GenerationConfig(do_sample=False, max_new_tokens=cfg.max_tokens, eos_token_id=eos or -1, pad_token_id=pad)
    capacity = cfg.num_blocks * cfg.page
    manager = start_manager(lm.model, spec, gc)
    try:
        # without eviction a request's prompt and answer must fit the whole cache; with it the engine says what
        # fits (prompt_refusal: a long prompt is evicted between its prefill chunks)
        server = Server(TransformersBackend(manager), lm.tokenizer, model_name=cfg.served_names[0],
                        aliases=cfg.served_names[1:], max_request_bytes=cfg.max_request_bytes, api_key=cfg.api_key,
                        eos=eos,
                        default_max_tokens=cfg.max_tokens, max_positions=_max_positions(lm.model),
                        total_limit=None if cfg.evicts else capacity,
                        max_waiting=cfg.max_waiting, request_timeout=cfg.request_timeout,
                        reasoning_parser=cfg.reasoning_parser,
                        info={"model": cfg.model, "policy": spec.policy, "budget": spec.budget, "page": spec.page,
                              "num_blocks": spec.num_blocks, "max_batch_tokens": spec.max_batch_tokens,
                              **_queue_info(cfg),
                              "settings": _settings(spec.settings)})
    except BaseException:
        stop_engine(manager)
        raise
    what = f"{spec.policy}" + (f" K={spec.budget}" if spec.budget else "")
    return server, lambda: stop_engine(manager), f"model {cfg.model}, {what}, page {spec.page}, " \
                                                 f"{spec.num_blocks} blocks"


def _prepare_llamacpp(cfg: ServeConfig):
    """`--engine llama.cpp`: the same app on LlamaBackend (epikv.serving.llamacpp)."""
    import torch

    from ..llamacpp import load_gguf
    from ..llamacpp.kvtypes import budget_for_memory, resolve_flash_attn
    from ..llamacpp.engine import check_model_policy
    from ..policies import for_model, get_policy
    from .llamacpp import LlamaBackend

    # the policy's tensors here are a few rows per token: one torch thread (more only hand work between threads
    # and take cores from llama.cpp's, which spin while they wait)
    torch.set_num_threads(1)
    gm = load_gguf(cfg.model)  # llama.cpp missing, a bad GGUF: refused here in one line
    # bad cell types refused in one line; a quantized V cache switches flash attention on (said so)
    flash_attn, note = resolve_flash_attn(gm, cfg.cache_type_k, cfg.cache_type_v, cfg.flash_attn)
    notes = [note] if note else []
    budget, policy = cfg.budget, cfg.policy
    if cfg.kv_memory is not None:  # a sequence's peak KV bytes, cells and policy buffers: the budget it picks
        pol = for_model(get_policy(cfg.policy, tau=cfg.tau, **cfg.settings), lambda p: check_model_policy(gm, p),
                        tau=cfg.tau)  # the default's fallback too
        policy = pol  # the backend runs the policy sized here (a fallback warned once, not again by the backend)
        plan = budget_for_memory(gm, pol, cfg.kv_memory, cfg.cache_type_k, cfg.cache_type_v)
        budget = plan.budget
        notes.append(f"--kv-memory {cfg.kv_memory} bytes with {cfg.cache_type_k}/{cfg.cache_type_v} cells: "
                     f"{pol.name} {plan.describe()}")
    backend = LlamaBackend(gm, policy, budget, cfg.tau, ctx=cfg.ctx, sequences=cfg.sequences,
                           max_batch_tokens=cfg.max_batch_tokens, threads=cfg.threads, kv=cfg.kv,
                           flash_attn=flash_attn, type_k=cfg.cache_type_k, type_v=cfg.cache_type_v, **cfg.settings)
    for n in notes:
        print(f"epikv serve: {n}", file=sys.stderr)
    return lambda: _start_llamacpp(cfg, gm, backend)


def _start_llamacpp(cfg: ServeConfig, gm, backend):
    from ..llamacpp import lib
    from .app import Server

    try:
        tok = gm.tokenizer
        server = Server(backend, tok, model_name=cfg.served_names[0], aliases=cfg.served_names[1:],
                        max_request_bytes=cfg.max_request_bytes, api_key=cfg.api_key,
                        eos=tok.eog_ids(), default_max_tokens=cfg.max_tokens,
                        max_positions=gm.n_ctx_train or None,
                        total_limit=None if cfg.evicts else backend.stream_cells, max_waiting=cfg.max_waiting,
                        request_timeout=cfg.request_timeout, reasoning_parser=cfg.reasoning_parser,
                        info={"model": cfg.model, "engine": "llama.cpp", "policy": backend.policy.name,
                              "budget": backend.budget, "ctx": backend.cells, "sequences": cfg.sequences,
                              "kv": "streams" if backend.streams else "unified", "stream_cells": backend.stream_cells,
                              "max_batch_tokens": cfg.max_batch_tokens, "threads": backend.threads,
                              "cache_type_k": backend.type_k, "cache_type_v": backend.type_v,
                              "llama_cpp": lib.load().version, "system_info": lib.system_info(),
                              **_queue_info(cfg),
                              "settings": _settings(cfg.settings)})
    except BaseException:
        stop_engine(backend)
        raise
    what = backend.policy.name + (f" K={backend.budget}" if backend.budget else "")  # the default's fallback too
    cells = (f"{cfg.sequences} streams of {backend.stream_cells} cells" if backend.streams else
             f"{backend.cells} cells, {cfg.sequences} sequences")
    kv = backend.n_ctx * backend.cell_bytes
    types = f" {backend.type_k}/{backend.type_v}" if (backend.type_k, backend.type_v) != ("f16", "f16") else ""
    cells += f", KV cache{types} {kv / 2**20:.1f} MiB" if kv > 0 else ""
    return server, lambda: stop_engine(backend), f"llama.cpp, model {cfg.model}, {what}, {cells}"


def stop_engine(manager) -> None:
    try:
        manager.stop(block=True, timeout=10)
    except Exception as e:  # already stopped or crashed: nothing left to release
        print(f"epikv serve: warning: stopping the engine: {type(e).__name__}: {e}", file=sys.stderr)
