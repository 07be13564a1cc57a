"""A small OpenAI-compatible HTTP front end on an engine (`epikv serve`).

The app talks to the engine only through `serving.backend.Backend` (submit token ids, read outputs, cancel,
gauges), so transformers' continuous batching with eviction and a second engine are served by the same code. One
router thread drains the engine's outputs and hands each to the asyncio queue of the HTTP request that owns it, so
no request polls the queue of another; the router also times each request's tokens (time to first token,
inter-token latency).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or not), GET /v1/models,
GET /health, GET /stats, GET /metrics (Prometheus). Sampling per request (temperature, top_p, top_k, min_p, seed;
greedy when temperature is 0 or left out); a reasoning parser puts the thinking part of chat answers into
`reasoning_content`; past --max-waiting requests without a token yet a request gets 429 with Retry-After; while
draining (after SIGTERM) 503. Before any handler (serving/guard.py): 401 without --api-key's token on /v1/, 413 for a
body over --max-request-bytes. Every refusal is an OpenAI error object.
"""


import asyncio
import collections
import itertools
import json
import math
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..engine import Sampling
from ..errors import EpiKVError
from ..stops import StopStream
from .backend import Backend, Output
from .guard import DEFAULT_MAX_REQUEST_BYTES, Guard, error_response
from .reasoning import ReasoningSplit
from .schema import ChatCompletionRequest, CompletionRequest

# Body fields read by each endpoint, as the request models (schema.py) declare them; any other field is refused by
# name (a silently ignored option is a wrong answer)
_COMPLETION_FIELDS = frozenset(CompletionRequest.model_fields)
_CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields)
# What each accepted field does here (docs/serve.md's request table is rendered from these and the sets above):
# "openai" fields keep OpenAI's meaning within the limits stated; "extra" fields are not in OpenAI's API (vLLM has them)
FIELD_NOTES = {
    "model": ("openai", "optional; if given, a served name: `--served-model-name`, default `--model` (else 400)"),
    "prompt": ("openai", "a string, a list of token ids, or a list of one of these (one prompt per request)"),
    "messages": ("openai", "roles system / user / assistant; content a string or text parts (other part types: 400)"),
    "max_tokens": ("openai", "default `--max-tokens`; prompt + max_tokens must fit the model's positions"),
    "max_completion_tokens": ("openai", "as max_tokens (max_tokens wins when both are given)"),
    "stream": ("openai", "server-sent events, ending with `data: [DONE]`"),
    "stream_options": ("openai", "`include_usage`: a last event with usage"),
    "stop": ("openai", "a string or up to 4; the text ends before it"),
    "temperature": ("openai", "0 or absent: greedy; > 0 samples"),
    "top_p": ("openai", "in (0, 1]; read only when sampling"),
    "seed": ("openai", "in [0, 2^63); the same seed gives the same sample; absent: a random one"),
    "n": ("openai", "only 1"),
    "user": ("openai", "accepted and not used"),
    "frequency_penalty": ("openai", "only 0 or absent"),
    "presence_penalty": ("openai", "only 0 or absent"),
    "logprobs": ("openai", "only false / 0 / absent"),
    "top_logprobs": ("openai", "only 0 or absent"),
    "echo": ("openai", "only false or absent"),
    "suffix": ("openai", "only absent"),
    "best_of": ("openai", "only 1 or absent"),
    "top_k": ("extra", "an integer >= -1 (-1 or 0: off); read only when sampling"),
    "min_p": ("extra", "in [0, 1]; read only when sampling"),
    "ignore_eos": ("extra", "generate max_tokens tokens whatever the model's end token (benchmarks)"),
}


class BadRequest(Exception):
    """A request the server refuses: answered 400 with an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _content_text(content) -> str:
    """A message's text: a string, or its text parts (validated by schema.Message) joined in order with newlines (as
    vLLM joins them)."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


class Busy(Exception):
    """A well-formed request the server cannot take now: answered `status` with Retry-After."""

    def __init__(self, message: str, status: int, retry_after: int):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


@dataclass
class _Abort:
    """Put in a request's queue to end it without an output: the drain ran out, or the request timed out."""

    why: str


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    t0: float  # admission (time.perf_counter)
    n_prompt: int
    t_last: float | None = None  # arrival of its latest token
    n_tokens: int = 0


@dataclass
class Counters:
    received: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    timeout: int = 0
    aborted: int = 0
    rejected: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.time)


class Server:
    """What the HTTP handlers share: the engine (a Backend), the tokenizer, the routing of outputs, counters and
    metrics, the waiting-queue bound and the drain state.

    capacity limits: max_positions (the model's), prompt_limit / total_limit (tokens one request may hold in the
    cache: its prompt under eviction, prompt + answer without), None: no check. max_waiting: admitted requests
    without a token yet beyond which a request gets 429 (None: no bound). request_timeout: seconds a request may
    run before it is cancelled (None: no limit). reasoning_parser: a name of reasoning.PARSERS or None.
    aliases: further names a request's `model` may give (--served-model-name); max_request_bytes: larger bodies get
    413 (None: no limit); api_key: the Bearer token /v1/ routes require (None: none).
    """

    def __init__(self, backend: Backend, tokenizer, *, model_name: str, eos: list[int], default_max_tokens: int = 256,
                 max_positions: int | None = None, prompt_limit: int | None = None, total_limit: int | None = None,
                 info: dict | None = None, max_waiting: int | None = None, request_timeout: float | None = None,
                 reasoning_parser: str | None = None, aliases: tuple[str, ...] = (),
                 max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, api_key: str | None = None):
        from .metrics import Metrics

        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name  # the name answers carry
        self.model_names = list(dict.fromkeys([model_name, *aliases]))  # the names a request may give
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key
        self.eos = set(int(e) for e in eos)
        self.default_max_tokens = default_max_tokens
        self.max_positions = max_positions
        self.prompt_limit = prompt_limit
        self.total_limit = total_limit
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.reasoning_parser = reasoning_parser
        self.info = dict(info or {})
        self.counters = Counters()
        self.per_request_eos = backend.per_request_eos
        self.draining = False
        self.id_prefix = "http"  # request ids: <prefix>-<n>-<random> (a Ray Serve replica adds its id)
        self.drain_deadline: float | None = None  # time.monotonic() at which the drain ends open requests
        self._pending: dict[str, _Pending] = {}
        self._done_times: collections.deque = collections.deque(maxlen=256)  # recent completions, for Retry-After
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.metrics = Metrics(self)
        self._router = threading.Thread(target=self._route, name="epikv-serve-router", daemon=True)
        self._router.start()

    # ------------------------------------------------------------------ routing (router thread)
    def _route(self) -> None:
        while not self._stop.is_set():
            try:
                out = self.backend.next_output(0.05)
            except Exception:  # the engine is gone (stopped or crashed): the handlers notice through healthy()
                time.sleep(0.05)
                continue
            if out is None:
                if not self.healthy():  # an engine that is gone returns at once: do not spin
                    time.sleep(0.05)
                continue
            now = time.perf_counter()
            with self._lock:
                p = self._pending.get(out.request_id)
                if p is not None and len(out.tokens) > p.n_tokens:
                    new = len(out.tokens) - p.n_tokens
                    if p.t_last is None:
                        self.metrics.ttft.observe(now - p.t0)
                    else:
                        gap = (now - p.t_last) / new  # tokens that arrived together share the gap
                        for _ in range(new):
                            self.metrics.itl.observe(gap)
                    p.t_last, p.n_tokens = now, len(out.tokens)
                    self.metrics.generation_tokens.inc(new)
            if p is not None:  # an output of a request the client already left is dropped
                p.loop.call_soon_threadsafe(p.queue.put_nowait, out)

    def close(self) -> None:
        self._stop.set()
        self._router.join(timeout=2)

    def healthy(self) -> bool:
        try:
            return self.backend.healthy()
        except Exception:
            return False

    # ------------------------------------------------------------------ load
    def waiting(self) -> int:
        """Admitted requests without a token yet: the queue in front of the engine."""
        with self._lock:
            return sum(1 for p in self._pending.values() if p.t_last is None)

    def running(self) -> int:
        with self._lock:
            return sum(1 for p in self._pending.values() if p.t_last is not None)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved by its length: waiting / recent completion rate, 1..60."""
        now = time.monotonic()
        with self._lock:
            recent = [t for t in self._done_times if now - t < 60]
            waiting = sum(1 for p in self._pending.values() if p.t_last is None)
        if len(recent) < 2:
            return 1
        rate = (len(recent) - 1) / max(recent[-1] - recent[0], 1e-3)
        return max(1, min(60, math.ceil((waiting + 1) / rate)))

    def admit(self) -> None:
        """Raise Busy when the server cannot take a request now (draining, or the waiting queue is full)."""
        busy = None
        if self.draining:
            busy = Busy("the server is shutting down", 503, self.drain_left())
        elif self.max_waiting is not None and self.waiting() >= self.max_waiting:
            busy = Busy(f"the server has {self.max_waiting} requests waiting for their first token (--max-waiting): "
                        "retry later", 429, self.retry_after())
        if busy is not None:
            with self._lock:
                self.counters.rejected += 1
            self.metrics.requests.labels("rejected").inc()
            raise busy

    def start_drain(self, timeout: float) -> None:
        """Stop admitting (503 with Retry-After); the caller ends what is still open after `timeout` seconds."""
        self.drain_deadline = time.monotonic() + timeout
        self.draining = True

    def drain_left(self) -> int:
        left = (self.drain_deadline or time.monotonic()) - time.monotonic()
        return max(1, math.ceil(min(left, 3600)))

    # ------------------------------------------------------------------ one request
    def submit(self, input_ids: list[int], max_tokens: int, *, sampling: Sampling | None, seed: int,
               ignore_eos: bool) -> tuple[str, asyncio.Queue]:
        self.admit()
        rid = f"{self.id_prefix}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:  # registered before the engine can answer
            self._pending[rid] = _Pending(asyncio.get_running_loop(), q, time.perf_counter(), len(input_ids))
            c = self.counters
            c.received += 1
            c.in_flight += 1
            c.max_in_flight = max(c.max_in_flight, c.in_flight)
        try:
            self.backend.submit(rid, list(input_ids), max_tokens, sampling=sampling, seed=seed,
                                ignore_eos=ignore_eos)
        except RuntimeError:
            self.finish(rid, "failed")
            raise
        self.metrics.prompt_tokens.inc(len(input_ids))
        return rid, q

    def finish(self, rid: str, how: str, tokens: int = 0) -> None:
        with self._lock:
            p = self._pending.pop(rid, None)
            if p is None:
                return
            c = self.counters
            c.in_flight -= 1
            c.completion_tokens += tokens
            setattr(c, how, getattr(c, how) + 1)
            if how == "completed":
                self._done_times.append(time.monotonic())
        self.backend.release(rid)
        self.metrics.requests.labels(how).inc()
        if how == "completed":
            self.metrics.latency.observe(time.perf_counter() - p.t0)

    def cancel(self, rid: str, how: str = "cancelled", tokens: int = 0) -> None:
        try:  # a stop string ends a request early but complete: the engine counts it finished, not cancelled
            if how == "completed":
                self.backend.cancel(rid, completed=True)
            else:
                self.backend.cancel(rid)
        except Exception:  # the engine is gone: nothing left to stop
            pass
        finally:
            self.finish(rid, how, tokens)

    def abort_all(self, why: str) -> int:
        """End every open request with an error (the drain ran out); returns how many."""
        with self._lock:
            pending = list(self._pending.values())
        for p in pending:
            p.loop.call_soon_threadsafe(p.queue.put_nowait, _Abort(why))
        return len(pending)

    def finish_reason(self, tokens: list[int], max_tokens: int) -> str:
        return "stop" if tokens and tokens[-1] in self.eos and len(tokens) <= max_tokens else "length"

    def visible(self, tokens: list[int], ignore_eos: bool) -> list[int]:
        """The answer's tokens without its final EOS (the text never shows it)."""
        return tokens[:-1] if tokens and not ignore_eos and tokens[-1] in self.eos else list(tokens)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def stats(self) -> dict:
        with self._lock:
            c = vars(self.counters).copy()
        c["waiting"], c["running"], c["draining"] = self.waiting(), self.running(), self.draining
        out = {"http": c, "server": self.info}
        try:
            out["engine"] = self.backend.stats()
        except Exception as e:  # stats must never take the server down
            out["engine"] = {"error": f"{type(e).__name__}: {e}"}
        return out


# ---------------------------------------------------------------------- request parsing
def _sampling(req, supported: frozenset) -> tuple[Sampling | None, int]:
    """The request's sampling (None: greedy, the default) and its seed (a random one when none is given).
    temperature 0 or left out is greedy, whatever top_p / top_k / min_p say (as model.generate without sampling).
    Types and ranges were checked by the request model (schema.py); here: what the engine honours."""
    t, p, k, mp, seed = req.temperature, req.top_p, req.top_k, req.min_p, req.seed
    if not t:  # greedy: every sampling setting and the seed change nothing
        return None, 0
    for name, v, off in (("temperature", t, None), ("top_p", p, 1), ("top_k", k, 0), ("min_p", mp, 0),
                         ("seed", seed, None)):
        if v is not None and v != off and name not in supported and not (name == "top_k" and v == -1):
            raise BadRequest(f"{name} is not supported by this server's engine", name)
    try:
        # Gumbel-max: a token changes only if rounding in the logits (another batch) reorders its two best scores
        sampling = Sampling(temperature=float(t), top_p=1.0 if p is None else float(p),
                            top_k=0 if k in (None, -1) else k, min_p=0.0 if mp is None else float(mp), draw="gumbel")
    except EpiKVError as e:
        raise BadRequest(str(e)) from None
    return sampling, secrets.randbits(63) if seed is None else seed


def parse_body(server: Server, raw: bytes, chat: bool) -> dict:
    """parse_request of a raw body: BadRequest for a body that is not JSON (or nests too deep to decode)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise BadRequest("the request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("the request body nests too deeply") from None
    return parse_request(server, body, chat)


def parse_request(server: Server, body, chat: bool) -> dict:
    """The request as {input_ids, max_tokens, stream, stop, ignore_eos, sampling, seed, reasoning,
    usage_in_stream}, or BadRequest. `body`: the decoded JSON, validated here by the request model (schema.py);
    then what depends on the served model and engine."""
    from .schema import Refused, validate

    try:
        req = validate(body, chat)
    except Refused as e:
        raise BadRequest(str(e), e.param) from None
    if req.model is not None and req.model not in server.model_names:
        names = " or ".join(json.dumps(n) for n in server.model_names)
        raise BadRequest(f"this server serves model {names}, not {json.dumps(req.model)}"[:300], "model")
    sampling, seed = _sampling(req, server.backend.sampling_fields)
    if req.ignore_eos and not server.per_request_eos:
        raise BadRequest("ignore_eos needs a transformers whose continuous batching takes a per-request EOS",
                         "ignore_eos")
    tok = server.tokenizer
    if chat:
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        clean = [{"role": m.role, "content": _content_text(m.content)} for m in req.messages]
        if not getattr(tok, "chat_template", None):
            raise BadRequest(f"model {server.model_name} has no chat template: use /v1/completions")
        text = tok.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
        ids = list(tok(text, add_special_tokens=False)["input_ids"])  # the template holds BOS where wanted
    else:
        max_tokens = req.max_tokens
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = list(tok(prompt)["input_ids"])
        else:
            vocab = len(tok)
            if any(x >= vocab for x in prompt):
                raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
            ids = list(prompt)
    if not ids:
        raise BadRequest("the prompt encodes to no tokens", "prompt")
    max_tokens = server.default_max_tokens if max_tokens is None else max_tokens
    if server.max_positions and len(ids) + max_tokens > server.max_positions:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"{server.max_positions} positions", "max_tokens")
    why = server.backend.prompt_refusal(len(ids))
    if why:
        raise BadRequest(why, "prompt")
    if server.prompt_limit and len(ids) > server.prompt_limit:
        raise BadRequest(f"prompt ({len(ids)} tokens) exceeds the {server.prompt_limit} tokens a request may hold "
                         f"in this server's cache", "prompt")
    if server.total_limit and len(ids) + max_tokens > server.total_limit:
        flags = getattr(server.backend, "capacity_flags", "its capacity")
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the {server.total_limit} "
                         f"tokens one request may hold in this server's cache ({flags})", "max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return {"input_ids": ids, "max_tokens": max_tokens, "stream": req.stream, "stop": stop,
            "ignore_eos": req.ignore_eos, "sampling": sampling, "seed": seed,
            "reasoning": chat and server.reasoning_parser is not None,
            "usage_in_stream": bool(req.stream_options and req.stream_options.include_usage)}


# ---------------------------------------------------------------------- text bookkeeping
class _Detok(StopStream):
    """Incremental text of a request's tokens under the stop-string rule (epikv.stops), its final EOS unseen."""

    def __init__(self, server: Server, stop: list[str], ignore_eos: bool):
        super().__init__(server.text, stop)
        self.server, self.ignore_eos = server, ignore_eos

    def step(self, tokens: list[int], final: bool) -> str:
        return super().step(self.server.visible(tokens, self.ignore_eos), final)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---------------------------------------------------------------------- the app
def build_app(server: Server, extra_stats=None, headers: dict | None = None, metrics_text=None):
    """The FastAPI application over `server`. extra_stats: a function whose dict /stats adds (a Ray Serve replica:
    every replica's figures); headers: added to /stats and /metrics (a replica's id); metrics_text: a function
    whose bytes /metrics answers instead of this server's own (a Ray Serve replica: every replica's series)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    from .. import __version__
    from . import schema

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    app = FastAPI(title="epikv serve", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = lambda: _openapi(app, server)
    # checked before any handler runs, so that an oversized body is refused as it arrives (never parsed)
    app.add_middleware(Guard, max_bytes=server.max_request_bytes, api_key=server.api_key)

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
              headers: dict | None = None):
        return error_response(status, message, kind, param, headers=headers)

    # FastAPI's own refusals (an unknown path: 404, a wrong method: 405) in the OpenAI error shape too
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                   f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error(400, "the request does not match /openapi.json")

    @app.get("/health", response_model=None, responses={200: {"model": schema.Health}, 503: _ERR})
    async def health():
        if not server.healthy():
            return error(503, "the generation loop is not running", kind="server_error")
        if server.draining:
            return error(503, "the server is shutting down", kind="server_error",
                         headers={"Retry-After": str(server.drain_left())})
        return {"status": "ok"}

    @app.get("/v1/models", response_model=None, responses={200: {"model": schema.ModelList}})
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(server.counters.started),
                                            "owned_by": "epikv"} for name in server.model_names]}

    @app.get("/stats")
    async def stats():
        out = server.stats()
        if extra_stats is not None:
            out.update(await asyncio.to_thread(extra_stats))
        return JSONResponse(out, headers=headers)

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus text format"}})
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        body = server.metrics.text() if metrics_text is None else await asyncio.to_thread(metrics_text)
        return Response(body, media_type=CONTENT_TYPE_LATEST, headers=headers)

    async def handle(request: Request, chat: bool):
        raw = await request.body()  # within --max-request-bytes (Guard)
        try:  # decoding, validating and tokenizing a long prompt takes a while: off the event loop
            req = await asyncio.to_thread(parse_body, server, raw, chat)
        except BadRequest as e:
            server.metrics.requests.labels("invalid").inc()
            return error(400, str(e), e.param)
        if not server.healthy():
            return error(503, "the generation loop is not running", kind="server_error")
        try:
            rid, q = server.submit(req["input_ids"], req["max_tokens"], sampling=req["sampling"], seed=req["seed"],
                                   ignore_eos=req["ignore_eos"])
        except Busy as e:
            return error(e.status, str(e), kind="rate_limit_error" if e.status == 429 else "server_error",
                         headers={"Retry-After": str(e.retry_after)})
        except RuntimeError as e:
            return error(503, str(e), kind="server_error")
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()),
                "model": server.model_name}
        n_prompt = len(req["input_ids"])
        if req["stream"]:
            return StreamingResponse(_stream(server, rid, q, req, meta, chat, n_prompt),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(server, rid, q, req, meta, chat, n_prompt, error, request)

    @app.post("/v1/completions", response_model=None, openapi_extra=_body("CompletionRequest"),
              responses=_answers("CompletionResponse", "CompletionChunk"))
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=_body("ChatCompletionRequest"),
              responses=_answers("ChatCompletionResponse", "ChatCompletionChunk"))
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


_ERR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _body(name: str) -> dict:
    """The request body of a POST route: the request model (validated by parse_request, not by FastAPI, so that a
    refusal keeps the OpenAI error shape and names its field)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def _answers(whole: str, chunk: str) -> dict:
    ref = "#/components/schemas/"
    return {200: {"description": "the answer; with stream: true, server-sent events (`data: <chunk>` each, an error "
                                 "object as the last event if it fails midway, then `data: [DONE]`)",
                  "content": {"application/json": {"schema": {"$ref": ref + whole}},
                              # one server-sent event (OpenAPI < 3.2: `schema` describes each event); its data
                              # is a chunk, an error object, or [DONE]
                              "text/event-stream": {"schema": {
                                  "type": "object", "required": ["data"],
                                  "properties": {"data": {"anyOf": [
                                      {"const": "[DONE]"},
                                      {"type": "string", "contentMediaType": "application/json",
                                       "contentSchema": {"anyOf": [{"$ref": ref + chunk},
                                                                   {"$ref": ref + "ErrorResponse"}]}}]}}}}}},
            400: {**_ERR, "description": "a refused request: the field it names in error.param"},
            401: {**_ERR, "description": "--api-key is set and the request lacks `Authorization: Bearer <key>`"},
            413: {**_ERR, "description": "the body is larger than --max-request-bytes"},
            429: {**_ERR, "description": "--max-waiting requests wait for their first token (Retry-After)"},
            500: {**_ERR, "description": "the engine failed the request"},
            503: {**_ERR, "description": "draining after SIGTERM (Retry-After), or the engine is not running"},
            504: {**_ERR, "description": "--request-timeout passed"}}


def _openapi(app, server: Server) -> dict:
    """FastAPI's document with the request, response, chunk and error models of schema.py in its components, and what
    this server adds to the models' ranges: the one model name it serves, token ids below its vocabulary's size."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    from . import schema

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="An OpenAI-compatible server with eviction inside continuous batching (epikv).")
    models = [(m, "validation") for m in (schema.CompletionRequest, schema.ChatCompletionRequest)]
    models += [(m, "serialization") for m in (schema.CompletionResponse, schema.ChatCompletionResponse,
                                              schema.CompletionChunk, schema.ChatCompletionChunk,
                                              schema.ErrorResponse, schema.ModelList, schema.Health)]
    _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    comps.update(defs.get("$defs", {}))
    vocab = len(server.tokenizer) if server.tokenizer is not None else None

    def below_vocab(node):
        if isinstance(node, dict):
            if node.get("type") == "integer" and vocab:
                node["maximum"] = vocab - 1
            for v in node.values():
                below_vocab(v)
        elif isinstance(node, list):
            for v in node:
                below_vocab(v)

    for name in ("CompletionRequest", "ChatCompletionRequest"):
        comps[name]["properties"]["model"]["anyOf"] = [{"type": "string", "enum": list(server.model_names)},
                                                       {"type": "null"}]
    below_vocab(comps["CompletionRequest"]["properties"]["prompt"])
    app.openapi_schema = doc
    return doc


def _failed(out) -> bool:
    return isinstance(out, _Abort) or out is None or out.error is not None


async def _next(server: Server, q: asyncio.Queue, deadline: float | None):
    """The request's next output; None when the engine died meanwhile; _Abort when it timed out (or the drain
    ended it)."""
    while True:
        wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
        if wait <= 0:
            return _Abort(f"the request timed out after {server.request_timeout:g} s (--request-timeout)")
        try:
            return await asyncio.wait_for(q.get(), timeout=wait)
        except asyncio.TimeoutError:
            if not server.healthy():
                return None


def _why(server: Server, rid: str, out) -> tuple[str, str, int]:
    """A failed output: end the request (cancelled in the engine where it still runs); (message, kind, status)."""
    if isinstance(out, _Abort):
        timed_out = "timed out" in out.why
        server.cancel(rid, "timeout" if timed_out else "aborted")
        return out.why, "timeout" if timed_out else "server_error", 504 if timed_out else 503
    server.finish(rid, "failed")
    return f"generation failed: {'the generation loop stopped' if out is None else out.error}", "server_error", 500


def _deadline(server: Server) -> float | None:
    return None if server.request_timeout is None else time.monotonic() + server.request_timeout


def _message(req, text: str) -> dict:
    if not req["reasoning"]:
        return {"role": "assistant", "content": text}
    reasoning, content = ReasoningSplit().split(text, final=True)
    return {"role": "assistant", "content": content or None, "reasoning_content": reasoning}


async def _last(server: Server, q: asyncio.Queue, deadline: float | None):
    """The request's final output, or the failed one that ended it."""
    while True:
        out = await _next(server, q, deadline)
        if _failed(out) or out.finished:
            return out


async def _client_left(request) -> None:
    """Returns when the client disconnects: with its body read, the next ASGI message a request gets is that."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(server, rid, q, req, meta, chat, n_prompt, error, request):
    from fastapi.responses import JSONResponse

    det = _Detok(server, req["stop"], req["ignore_eos"])
    # nothing is sent before the answer, so the server would not notice a client that left: watch for it, and
    # cancel the request (its cache returns to the pool) as a stream is when its client leaves
    last = asyncio.ensure_future(_last(server, q, _deadline(server)))
    left = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait((last, left), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server cancelled the handler
        server.cancel(rid)
        raise
    finally:
        for t in (last, left):
            t.cancel()
    if not last.done() or last.cancelled():  # the client left
        server.cancel(rid)
        return error(499, "the client closed the connection")
    out = last.result()
    if _failed(out):
        why, kind, status = _why(server, rid, out)
        return error(status, why, kind=kind)
    tokens = out.tokens
    det.step(tokens, final=True)
    text_tokens = det.ids(server.visible(tokens, req["ignore_eos"]))  # cut with the text at a stop string
    finish = "stop" if det.stopped else server.finish_reason(tokens, req["max_tokens"])
    if req["ignore_eos"]:
        finish = "length"
    server.finish(rid, "completed", len(tokens))
    choice = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": text_tokens}
    if chat:
        choice["message"] = _message(req, det.sent)
        obj = "chat.completion"
    else:
        choice["text"] = det.sent
        obj = "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": [choice], "usage": _usage(n_prompt, len(tokens))})


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(server, rid, q, req, meta, chat, n_prompt):
    det = _Detok(server, req["stop"], req["ignore_eos"])
    split = ReasoningSplit() if req["reasoning"] else None
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent_ids = 0  # visible token ids sent so far
    deadline = _deadline(server)

    def chunk(delta: str, ids: list[int], finish: str | None, first: bool = False):
        if chat:
            if first:
                d = {"role": "assistant", "content": delta}
            elif split is not None:
                dr, dc = split.step(det.sent, final=finish is not None)
                d = {k: v for k, v in (("reasoning_content", dr), ("content", dc)) if v}
            else:
                d = {"content": delta} if delta or not finish else {}
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        choice["token_ids"] = ids
        return _sse({**meta, "object": obj, "choices": [choice]})

    finished = False
    try:
        if chat:
            yield chunk("", [], None, first=True)
        while True:
            out = await _next(server, q, deadline)
            if _failed(out):
                why, kind, _ = _why(server, rid, out)
                finished = True
                yield _sse({"error": {"message": why, "type": kind, "param": None, "code": None}})
                yield "data: [DONE]\n\n"
                return
            tokens = out.tokens
            done = out.finished
            delta = det.step(tokens, final=done)
            vis = server.visible(tokens, req["ignore_eos"]) if done else list(tokens)
            # the ids of the text sent, cut with it at a stop string (a trailing EOS decodes to no text)
            new_ids = det.ids(vis)[sent_ids:] if det.stopped or not done else vis[sent_ids:]
            if det.stopped or done:
                finish = "stop" if det.stopped else ("length" if req["ignore_eos"]
                                                      else server.finish_reason(tokens, req["max_tokens"]))
                if det.stopped and not done:  # a stop string: the answer is complete, the engine stops it
                    server.cancel(rid, "completed", len(tokens))
                else:
                    server.finish(rid, "completed", len(tokens))
                finished = True
                yield chunk(delta, new_ids, finish)
                if req["usage_in_stream"]:
                    yield _sse({**meta, "object": obj, "choices": [], "usage": _usage(n_prompt, len(tokens))})
                yield "data: [DONE]\n\n"
                return
            if delta or new_ids:
                # an EOS may still come: hold a trailing EOS id back until the request ends
                if new_ids and new_ids[-1] in server.eos and not req["ignore_eos"]:
                    new_ids = new_ids[:-1]
                sent_ids += len(new_ids)
                yield chunk(delta, new_ids, None)
    finally:
        if not finished:  # the client left mid-stream
            server.cancel(rid)
