"""`epikv serve`: an OpenAI-compatible HTTP server with eviction inside continuous batching, on transformers'
continuous batching (pages) or on one llama.cpp context (`--engine llama.cpp`, single cells)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
import threading
import time

from ..errors import EpiKVError
from ..serving.config import ServeConfig
from ..serving.guard import DEFAULT_MAX_REQUEST_BYTES
from ..serving.reasoning import PARSERS
from .common import add_model_args, add_policy_args, nonneg_float, positive_int, settings_by_policy
from .engines import FLASH_ATTN, THREADS_HELP, LlamaCppEngine, add_cache_type_args, add_flash_attn_arg


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535 (0: any free port), got {text!r}")
    return v


def _app_name(text: str) -> str:
    # it is also the route prefix (/NAME) and part of a Ray actor's name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", text):
        raise argparse.ArgumentTypeError(f"expected letters, digits, '-', '_' or '.' (at most 63), got {text!r}")
    return text


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
    h.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in the API (vLLM's option; llama-server's --alias): the first is the one "
                        "answers and GET /v1/models carry, any of them is accepted as a request's model (default: "
                        "--model as given)")
    h.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help=f"a request body of more bytes is answered 413 as it arrives, never parsed (default "
                        f"{DEFAULT_MAX_REQUEST_BYTES}: 2 MiB)")
    h.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on the /v1/ routes (401 without it; /health, /stats, "
                        "/metrics stay open), as vLLM and llama-server do; default: $EPIKV_API_KEY if set, else no "
                        "key")
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
    r.add_argument("--ray-app-name", type=_app_name, default=None,
                   help="this server's Serve application (its replicas, router and registry; deleted when it "
                        "stops, other applications on the cluster stay). Serve's one HTTP proxy serves every "
                        "application: the first at /, a later one at /NAME (the URL printed); default: epikv- and "
                        "a random suffix")
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


def config(args) -> ServeConfig:
    """The serve options as a ServeConfig: bad or contradictory options refused (EpiKVError, one line), the defaults
    that depend on other options filled in. Nothing is loaded here."""
    if not args.ray:
        for flag, v in (("--replicas", args.replicas), ("--min-replicas", args.min_replicas),
                        ("--max-replicas", args.max_replicas), ("--ray-address", args.ray_address),
                        ("--ray-app-name", args.ray_app_name)):
            if v is not None:
                raise EpiKVError(f"{flag} is an option of --ray (Ray Serve replicas)")
    if args.min_replicas is not None or args.max_replicas is not None:
        if args.replicas is not None:
            raise EpiKVError("--replicas and --min-replicas / --max-replicas: give a fixed count or the "
                             "autoscaling's bounds, not both")
        if args.max_replicas is None:
            raise EpiKVError("--min-replicas needs --max-replicas (the autoscaling's upper bound)")
        if (args.min_replicas or 1) > args.max_replicas:
            raise EpiKVError(f"--min-replicas {args.min_replicas} is above --max-replicas {args.max_replicas}")
    names = tuple(args.served_model_name or ())
    if any(not n.strip() for n in names):
        raise EpiKVError("--served-model-name: a name must not be empty")
    api_key = args.api_key if args.api_key is not None else os.environ.get("EPIKV_API_KEY") or None
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise EpiKVError("--api-key: the key must be non-empty and hold no spaces (it travels in one header)")
    policy = args.policy
    if policy is None:
        from ..policies import default_policy

        policy = args.policy = default_policy("serve-llama.cpp" if args.engine == "llama.cpp" else "serve-torch")
    settings = settings_by_policy(args, [policy])[policy]  # unknown policy, stray --set: refused here
    from ..policies import REGISTRY

    evicts = REGISTRY[policy].evicts
    if args.engine == "llama.cpp":
        given = [f for f, v in (("--num-blocks", args.num_blocks), ("--page", args.page)) if v is not None]
        if given:
            raise EpiKVError(f"{' and '.join(given)}: options of the torch engine's paged cache; --engine llama.cpp "
                             "takes --ctx cells and --sequences")
        streams = (args.kv or ("streams" if evicts else "unified")) == "streams"
        missing = [f for f, v in (("--ctx", args.ctx), ("--sequences", args.sequences)) if v is None
                   and not (f == "--ctx" and streams and evicts)]
        if missing:
            raise EpiKVError(f"--engine llama.cpp needs {' and '.join(missing)} (KV cells of the one context, and "
                             "the sequences decoded at once)")
        LlamaCppEngine.refuse_torch_options(args)
        if args.kv_memory is not None:
            if "budget" in (getattr(args, "given", None) or set()):
                raise EpiKVError("--kv-memory chooses the budget: give --kv-memory or --budget, not both")
            if not evicts:
                raise EpiKVError(f"--kv-memory sizes an evicting policy's budget; {policy} keeps every token")
    else:
        given = [f for f, v in (("--ctx", args.ctx), ("--sequences", args.sequences), ("--kv", args.kv),
                                ("--flash-attn", None if args.flash_attn == "auto" else args.flash_attn),
                                ("--cache-type-k", None if args.cache_type_k == "f16" else args.cache_type_k),
                                ("--cache-type-v", None if args.cache_type_v == "f16" else args.cache_type_v),
                                ("--kv-memory", args.kv_memory)) if v is not None]
        if given:
            raise EpiKVError(f"{' and '.join(given)}: options of --engine llama.cpp; the torch engine's cache is "
                             "--num-blocks pages of --page tokens")
        if args.num_blocks is None:
            raise EpiKVError("--num-blocks is required (pages in the shared KV cache; the engine's default would "
                             "fill 90% of free memory)")
    return ServeConfig(
        model=args.model, device=args.device, device_map=args.device_map, dtype=args.dtype, attn=args.attn,
        policy=policy, settings=settings, budget=args.budget if evicts else None, tau=args.tau, recent=args.recent,
        engine=args.engine, page=args.page or 16, num_blocks=args.num_blocks, ctx=args.ctx, kv=args.kv,
        sequences=args.sequences, flash_attn=FLASH_ATTN[args.flash_attn], max_batch_tokens=args.max_batch_tokens,
        threads=args.threads, host=args.host, port=args.port, max_tokens=args.max_tokens,
        reasoning_parser=args.reasoning_parser, max_waiting=args.max_waiting, request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout, log_level=args.log_level, served_model_names=names,
        max_request_bytes=args.max_request_bytes, api_key=api_key, ray=args.ray, replicas=args.replicas,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas, ray_address=args.ray_address,
        ray_app_name=args.ray_app_name, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
        kv_memory=args.kv_memory)


def _run(args) -> int:
    cfg = config(args)
    if cfg.ray:
        from ..serving.ray_serve import run_ray

        return run_ray(cfg)
    from ..serving.build import check_installed, prepare

    check_installed()
    start = prepare(cfg)
    sock = _bind(cfg.host, cfg.port)  # after the refusals and the model's load, before the engine starts
    try:
        server, stop, banner = start()
        try:
            _http(cfg, server, sock, banner)
        finally:
            server.close()
            _ignore_signals()  # a second signal during the stop should not leave a traceback
            stop()
    finally:
        sock.close()
    print("epikv serve: stopped", file=sys.stderr, flush=True)
    return 0


def _http(cfg: ServeConfig, server, sock, banner: str) -> None:
    """Serve `server` on the bound socket until a signal (the first drains, a second stops at once)."""
    from ..serving.app import build_app

    app = build_app(server)
    import uvicorn

    ucfg = uvicorn.Config(app, log_level=cfg.log_level, access_log=cfg.log_level in ("info", "debug"),
                          timeout_graceful_shutdown=5, lifespan="off")
    userver = _QuietServer(ucfg)

    def on_signal(sig, frame):  # first signal: drain, then stop; second: stop now
        if server.draining:
            userver.force_exit = userver.should_exit = True
            return
        server.start_drain(cfg.drain_timeout)
        threading.Thread(target=_drain, args=(server, userver, cfg.drain_timeout), name="epikv-serve-drain",
                         daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sock.listen(2048)  # connections wait in the backlog from here on, so the line below means "ready"
    host, port = sock.getsockname()[:2]
    print(f"epikv serve: listening on http://{host}:{port} ({banner})", file=sys.stderr, flush=True)
    userver.run(sockets=[sock])


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
