"""`epikv serve`: an OpenAI-compatible HTTP server with eviction inside continuous batching, on transformers'
continuous batching (pages) or on one llama.cpp context (`--engine llama.cpp`, single cells)."""

from __future__ import annotations

import argparse
import importlib
import signal
import socket
import sys
import threading
import time

from ..errors import EpiKVError
from ..serving.reasoning import PARSERS
from .common import add_model_args, add_policy_args, load, nonneg_float, positive_int, settings_by_policy
from .engines import THREADS_HELP, add_cache_type_args, add_flash_attn_arg

_NEEDS = ("fastapi", "uvicorn", "prometheus_client")


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535 (0: any free port), got {text!r}")
    return v


def register(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server with eviction inside continuous batching",
                       description="Serve the model over HTTP (POST /v1/completions, /v1/chat/completions, streamed "
                                   "or not; GET /v1/models, /health, /stats, /metrics) on transformers' continuous "
                                   "batching, each request's KV cache kept within --budget tokens by dropping whole "
                                   "pages. Greedy unless a request asks for sampling (temperature, top_p, top_k, "
                                   "min_p, seed). Needs `pip install 'epikv[serve]'`.")
    add_model_args(p)
    add_policy_args(p, by_engine=True)
    e = p.add_argument_group("engine")
    e.add_argument("--engine", choices=("torch", "llama.cpp"), default="torch",
                   help="torch (transformers' continuous batching over a paged cache, default) or llama.cpp (one "
                        "llama.cpp context of --ctx cells shared by up to --sequences sequences; --model smollm2 or "
                        "a local .gguf file; CPU only)")
    g = p.add_argument_group("paged cache (--engine torch)")
    g.add_argument("--page", type=positive_int, default=None,
                   help="tokens per cache page (block); eviction drops whole pages (default 16)")
    g.add_argument("--num-blocks", type=positive_int, default=None,
                   help="pages in the shared KV cache (required: the engine's default fills 90%% of free memory)")
    c = p.add_argument_group("cells (--engine llama.cpp)")
    c.add_argument("--ctx", type=positive_int, default=None,
                   help="KV cells of the one llama.cpp context: with --kv streams, ctx / sequences cells a stream "
                        "(default for an evicting policy: derived, sequences x (budget + tau - 1 + "
                        "--max-batch-tokens)); with --kv unified, shared by all sequences (required); eviction frees "
                        "single cells")
    c.add_argument("--kv", choices=("streams", "unified"), default=None,
                   help="streams: one KV stream per sequence, which attends only to its own cells and answers the "
                        "same whatever its batch-mates (default for an evicting policy); unified: one cache shared "
                        "by all sequences (default for full)")
    c.add_argument("--sequences", type=positive_int, default=None,
                   help="sequences decoded at once, at most (required; up to 256)")
    add_flash_attn_arg(c)
    add_cache_type_args(c)
    p.add_argument("--max-batch-tokens", type=positive_int, default=256,
                   help="tokens per forward pass (prefill chunks + one per decoding request; default 256)")
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    h.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port, printed)")
    h.add_argument("--max-tokens", type=positive_int, default=256,
                   help="max_tokens of a request that names none (default 256)")
    h.add_argument("--threads", type=positive_int, default=None, help=THREADS_HELP)
    h.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="return the thinking part of chat answers (<think>...</think>) as reasoning_content, "
                        "whole and streamed (default: off, all in content)")
    h.add_argument("--max-waiting", type=positive_int, default=None,
                   help="requests waiting for their first token beyond which a request gets 429 with Retry-After "
                        "(default: no bound)")
    h.add_argument("--request-timeout", type=nonneg_float, default=None,
                   help="seconds a request may run; then it is cancelled and answered 504 (streamed: an error "
                        "event) (default: no limit)")
    h.add_argument("--drain-timeout", type=nonneg_float, default=30.0,
                   help="on SIGTERM / SIGINT: stop admitting (503), let requests in flight finish for up to this "
                        "many seconds, then end each open one with an error; exit 0 (default 30; a second signal "
                        "stops at once)")
    h.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    r = p.add_argument_group("Ray Serve (--ray)")
    r.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: its HTTP proxy routes each request to one of several replicas, "
                        "each one engine with its own cache (needs `pip install 'epikv[ray,serve]'`)")
    r.add_argument("--replicas", type=positive_int, default=None, help="replicas (default 1; or autoscale with "
                   "--min-replicas / --max-replicas)")
    r.add_argument("--min-replicas", type=positive_int, default=None,
                   help="autoscale by ongoing requests between this many replicas and --max-replicas")
    r.add_argument("--max-replicas", type=positive_int, default=None, help="the autoscaling's upper bound")
    r.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster (e.g. ray://head:10001 or auto); default: start a local instance")
    p.set_defaults(run=run)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so that a port in use is refused before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise EpiKVError(f"--host {host}: {e.strerror or e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise EpiKVError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _max_positions(model) -> int | None:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return getattr(cfg, "max_position_embeddings", None)


def run(args) -> int:
    """`epikv serve`. The server takes SIGINT / SIGTERM (drain, then stop) and ignores them while it stops; the
    handlers the caller had are put back when it returns (`epikv.cli.main` called from Python, a test session)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(args)
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in saved.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _run(args) -> int:
    if getattr(args, "ray", False):
        from ..serving.ray_serve import run_ray

        return run_ray(args)
    for flag, v in (("--replicas", args.replicas), ("--min-replicas", args.min_replicas),
                    ("--max-replicas", args.max_replicas), ("--ray-address", args.ray_address)):
        if v is not None:
            raise EpiKVError(f"{flag} is an option of --ray (Ray Serve replicas)")
    start = prepare(args)
    sock = _bind(args.host, args.port)  # after the refusals and the model's load, before the engine starts
    try:
        server, stop, banner = start()
        try:
            _http(args, server, sock, banner)
        finally:
            server.close()
            _ignore_signals()  # a second signal during the stop should not leave a traceback
            stop()
    finally:
        sock.close()
    print("epikv serve: stopped", file=sys.stderr, flush=True)
    return 0


def prepare(args):
    """Refuse bad options (EpiKVError, one line) and load the model; returns start() -> (server, stop, banner):
    the engine started and the app's Server on it, a function that stops the engine, and a line that says what is
    served. `epikv serve` binds its port between the two; a Ray Serve replica calls both in its constructor."""
    missing = []
    for m in _NEEDS:
        try:
            importlib.import_module(m)
        except ImportError:
            missing.append(m)
    if missing:
        raise EpiKVError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
                         "pip install 'epikv[serve]'")
    if args.policy is None:
        from ..policies import default_policy

        args.policy = default_policy("serve-llama.cpp" if args.engine == "llama.cpp" else "serve-torch")
    settings = settings_by_policy(args, [args.policy])[args.policy]  # unknown policy, stray --set: refused here
    from ..policies import REGISTRY

    evicts = REGISTRY[args.policy].evicts
    if args.engine == "llama.cpp":
        return _prepare_llamacpp(args, settings, evicts)
    given = [f for f, v in (("--ctx", args.ctx), ("--sequences", args.sequences), ("--kv", args.kv),
                            ("--flash-attn", None if args.flash_attn == "auto" else args.flash_attn),
                            ("--cache-type-k", None if args.cache_type_k == "f16" else args.cache_type_k),
                            ("--cache-type-v", None if args.cache_type_v == "f16" else args.cache_type_v),
                            ("--kv-memory", args.kv_memory)) if v is not None]
    if given:
        raise EpiKVError(f"{' and '.join(given)}: options of --engine llama.cpp; the torch engine's cache is "
                         "--num-blocks pages of --page tokens")
    if args.num_blocks is None:
        raise EpiKVError("--num-blocks is required (pages in the shared KV cache; the engine's default would fill 90% "
                         "of free memory)")
    args.page = args.page or 16
    import torch

    from ..engine import eos_ids
    from ..serving import ServeSpec, check_serving, start_manager

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = ServeSpec(policy=args.policy, settings=settings, budget=args.budget if evicts else None, page=args.page,
                     num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens, recency=args.recent,
                     tau=args.tau)
    lm = load(args)
    check_serving(lm.model, spec)  # refusals (EpiKVError, one line) before the port is bound
    return lambda: _start_torch(args, lm, spec, evicts, start_manager, eos_ids)


def _start_torch(args, lm, spec, evicts, start_manager, eos_ids):
    from transformers import GenerationConfig

    from ..serving.app import Server
    from ..serving.backend import TransformersBackend

    eos = eos_ids(lm.model, lm.tokenizer)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    # the engine decodes greedily; a sampled request's own sampler picks its tokens (serving/sampling.py)
    gc = GenerationConfig(do_sample=False, max_new_tokens=args.max_tokens, eos_token_id=eos or -1, pad_token_id=pad)
    capacity = args.num_blocks * args.page
    manager = start_manager(lm.model, spec, gc)
    try:
        # a request must fit the whole cache: without eviction its prompt and answer, with it its prompt (the
        # budget keeps the rest within K)
        server = Server(TransformersBackend(manager), lm.tokenizer, model_name=args.model, eos=eos,
                        default_max_tokens=args.max_tokens, max_positions=_max_positions(lm.model),
                        prompt_limit=capacity if evicts else None, total_limit=None if evicts else capacity,
                        max_waiting=args.max_waiting, request_timeout=args.request_timeout,
                        reasoning_parser=args.reasoning_parser,
                        info={"model": args.model, "policy": spec.policy, "budget": spec.budget, "page": spec.page,
                              "num_blocks": spec.num_blocks, "max_batch_tokens": spec.max_batch_tokens,
                              "reasoning_parser": args.reasoning_parser, "max_waiting": args.max_waiting,
                              "request_timeout": args.request_timeout, "drain_timeout": args.drain_timeout,
                              "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in spec.settings.items()}})
    except BaseException:
        _stop_manager(manager)
        raise
    what = f"{spec.policy}" + (f" K={spec.budget}" if spec.budget else "")
    return server, lambda: _stop_manager(manager), f"model {args.model}, {what}, page {spec.page}, " \
                                                   f"{spec.num_blocks} blocks"


def _http(args, server, sock, banner: str) -> None:
    """Serve `server` on the bound socket until a signal (the first drains, a second stops at once)."""
    from ..serving.app import build_app

    app = build_app(server)
    import uvicorn

    cfg = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("info", "debug"),
                         timeout_graceful_shutdown=5, lifespan="off")
    userver = _QuietServer(cfg)

    def on_signal(sig, frame):  # first signal: drain, then stop; second: stop now
        if server.draining:
            userver.force_exit = userver.should_exit = True
            return
        server.start_drain(args.drain_timeout)
        threading.Thread(target=_drain, args=(server, userver, args.drain_timeout), name="epikv-serve-drain",
                         daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sock.listen(2048)  # connections wait in the backlog from here on, so the line below means "ready"
    host, port = sock.getsockname()[:2]
    print(f"epikv serve: listening on http://{host}:{port} ({banner})", file=sys.stderr, flush=True)
    userver.run(sockets=[sock])


def _prepare_llamacpp(args, settings: dict, evicts: bool):
    """`epikv serve --engine llama.cpp`: the same app on LlamaBackend (epikv.serving.llamacpp)."""
    given = [f for f, v in (("--num-blocks", args.num_blocks), ("--page", args.page)) if v is not None]
    if given:
        raise EpiKVError(f"{' and '.join(given)}: options of the torch engine's paged cache; --engine llama.cpp "
                         "takes --ctx cells and --sequences")
    streams = (args.kv or ("streams" if evicts else "unified")) == "streams"
    missing = [f for f, v in (("--ctx", args.ctx), ("--sequences", args.sequences)) if v is None
               and not (f == "--ctx" and streams and evicts)]
    if missing:
        raise EpiKVError(f"--engine llama.cpp needs {' and '.join(missing)} (KV cells of the one context, and the "
                         "sequences decoded at once)")
    from .engines import LlamaCppEngine

    eng = LlamaCppEngine(args)  # torch-only flags, llama.cpp missing, a bad GGUF, bad cell types: refused in one line
    if args.kv_memory is not None:  # a sequence's peak KV bytes, cells and policy buffers: the budget it picks
        args.budget = eng.budget_for_memory(args.policy, args.tau, **settings)
    from ..serving.llamacpp import LlamaBackend

    backend = LlamaBackend(eng.gm, args.policy, args.budget if evicts else None, args.tau, ctx=args.ctx,
                           sequences=args.sequences, max_batch_tokens=args.max_batch_tokens, threads=args.threads,
                           kv=args.kv, flash_attn=eng.flash_attn, type_k=eng.type_k, type_v=eng.type_v, **settings)
    for note in eng.notes:
        print(note, file=sys.stderr)
    return lambda: _start_llamacpp(args, settings, evicts, eng, backend)


def _start_llamacpp(args, settings, evicts, eng, backend):
    from ..llamacpp import lib
    from ..serving.app import Server

    try:
        tok = eng.gm.tokenizer
        server = Server(backend, tok, model_name=args.model, eos=tok.eog_ids(), default_max_tokens=args.max_tokens,
                        max_positions=eng.gm.n_ctx_train or None, prompt_limit=backend.cells if evicts else None,
                        total_limit=None if evicts else backend.stream_cells, max_waiting=args.max_waiting,
                        request_timeout=args.request_timeout, reasoning_parser=args.reasoning_parser,
                        info={"model": args.model, "engine": "llama.cpp", "policy": args.policy,
                              "budget": backend.budget, "ctx": backend.cells, "sequences": args.sequences,
                              "kv": "streams" if backend.streams else "unified", "stream_cells": backend.stream_cells,
                              "max_batch_tokens": args.max_batch_tokens, "threads": backend.threads,
                              "cache_type_k": backend.type_k, "cache_type_v": backend.type_v,
                              "llama_cpp": lib.load().version, "system_info": lib.system_info(),
                              "reasoning_parser": args.reasoning_parser, "max_waiting": args.max_waiting,
                              "request_timeout": args.request_timeout, "drain_timeout": args.drain_timeout,
                              "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}})
    except BaseException:
        _stop_manager(backend)
        raise
    what = args.policy + (f" K={backend.budget}" if backend.budget else "")
    cells = (f"{args.sequences} streams of {backend.stream_cells} cells" if backend.streams else
             f"{backend.cells} cells, {args.sequences} sequences")
    kv = backend.n_ctx * backend.cell_bytes
    types = f" {backend.type_k}/{backend.type_v}" if (backend.type_k, backend.type_v) != ("f16", "f16") else ""
    cells += f", KV cache{types} {kv / 2**20:.1f} MiB" if kv > 0 else ""
    return server, lambda: _stop_manager(backend), f"llama.cpp, model {args.model}, {what}, {cells}"


def _drain(server, userver, timeout: float) -> None:
    """Stop admitting (the caller set server.draining), wait for the requests in flight up to `timeout` seconds,
    end the rest with an error event (their handlers answer them), then let uvicorn stop."""
    end = time.monotonic() + timeout
    while server.in_flight() and time.monotonic() < end and not userver.should_exit:
        time.sleep(0.05)
    left = server.abort_all(f"the server is shutting down: the request did not finish within --drain-timeout "
                            f"{timeout:g} s")
    if left:
        print(f"epikv serve: drain: {left} request(s) still running after {timeout:g} s ended with an error",
              file=sys.stderr, flush=True)
        end = time.monotonic() + 5
        while server.in_flight() and time.monotonic() < end:  # their handlers send the error and close
            time.sleep(0.05)
    userver.should_exit = True


def _server_class():
    import contextlib

    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn without its own signal handling (which differs between versions and re-raises the signal after
        shutdown): ours sets should_exit, then the engine is stopped and the command returns 0."""

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            pass

        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn >= 0.29
            yield

    return QuietServer


def _QuietServer(cfg):
    return _server_class()(cfg)


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _stop_manager(manager) -> None:
    try:
        manager.stop(block=True, timeout=10)
    except Exception as e:  # already stopped or crashed: nothing left to release
        print(f"epikv serve: warning: stopping the engine: {type(e).__name__}: {e}", file=sys.stderr)
