"""A small OpenAI-compatible HTTP front end on a started continuous-batching manager (`epikv serve`).

The manager (transformers' ContinuousBatchingManager, with epikv's eviction installed by `start_manager`) runs its
own generation thread. One router thread here drains the manager's shared output queue and hands each output to the
asyncio queue of the HTTP request that owns it, so no request polls the queue of another (the manager's
`request_id_iter` re-queues foreign outputs, which is quadratic under load).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or not), GET /v1/models,
GET /health, GET /stats. Decoding is greedy: the manager has one generation config for all requests, so a request
that asks for sampling is refused with a 400 rather than silently decoded greedily.
"""


import asyncio
import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..stops import StopStream

# Body fields read by each endpoint; any other field is refused by name (a silently ignored option is a wrong answer).
_COMMON = {"model", "max_tokens", "stream", "temperature", "top_p", "n", "seed", "user", "ignore_eos",
           "stream_options", "frequency_penalty", "presence_penalty"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "logprobs", "stop", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "stop", "logprobs", "top_logprobs"}


class BadRequest(Exception):
    """A request the server refuses: answered 400 with an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class Counters:
    received: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.time)


class Server:
    """What the HTTP handlers share: the manager, the tokenizer, the routing of outputs, and counters.

    manager: a started ContinuousBatchingManager. stats: a callable manager -> dict (epikv.serving.serving_stats).
    capacity_tokens: the most tokens one request may hold in the cache (prompt + output, or the prompt alone under
    eviction), used to refuse a request that could never be admitted; None: no check.
    """

    def __init__(self, manager, tokenizer, *, model_name: str, eos: list[int], default_max_tokens: int = 256,
                 max_positions: int | None = None, prompt_limit: int | None = None, total_limit: int | None = None,
                 stats=None, info: dict | None = None, prompt_check=None):
        self.manager = manager
        self.prompt_check = prompt_check  # n_prompt -> why it can never be served (a 400), or None
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos = set(int(e) for e in eos)
        self.default_max_tokens = default_max_tokens
        self.max_positions = max_positions
        self.prompt_limit = prompt_limit
        self.total_limit = total_limit
        self.stats_fn = stats
        self.info = dict(info or {})
        self.counters = Counters()
        # per-request EOS (what ignore_eos needs) is an add_request argument only in some transformers versions
        import inspect

        self.per_request_eos = "eos_token_id" in inspect.signature(manager.add_request).parameters
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._router = threading.Thread(target=self._route, name="epikv-serve-router", daemon=True)
        self._router.start()

    # ------------------------------------------------------------------ routing (router thread)
    def _route(self) -> None:
        while not self._stop.is_set():
            try:
                out = self.manager.get_result(timeout=0.05)
            except Exception:  # the manager is gone (stopped or crashed): the handlers notice through health()
                time.sleep(0.05)
                continue
            if out is None:
                if not self.healthy():  # get_result returns at once when the loop is gone: do not spin
                    time.sleep(0.05)
                continue
            with self._lock:
                p = self._pending.get(out.request_id)
            if p is not None:  # an output of a request the client already left is dropped
                p.loop.call_soon_threadsafe(p.queue.put_nowait, out)

    def close(self) -> None:
        self._stop.set()
        self._router.join(timeout=2)

    def healthy(self) -> bool:
        is_running = getattr(self.manager, "is_running", None)
        return bool(is_running()) if callable(is_running) else True

    # ------------------------------------------------------------------ one request
    def submit(self, input_ids: list[int], max_tokens: int, *, streaming: bool, ignore_eos: bool) -> tuple[str, asyncio.Queue]:
        rid = f"http-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:  # registered before the manager can answer
            self._pending[rid] = _Pending(asyncio.get_running_loop(), q)
            c = self.counters
            c.received += 1
            c.in_flight += 1
            c.max_in_flight = max(c.max_in_flight, c.in_flight)
        kw = {"eos_token_id": -1} if ignore_eos else {}
        try:
            got = self.manager.add_request(list(input_ids), request_id=rid, max_new_tokens=max_tokens,
                                           streaming=streaming, **kw)
        except Exception as e:  # e.g. the input queue stayed full
            self.finish(rid, "failed")
            raise RuntimeError(f"the engine did not take the request: {type(e).__name__}: {e}") from None
        if got is None:  # the manager is stopping and dropped it
            self.finish(rid, "failed")
            raise RuntimeError("the server is shutting down")
        return rid, q

    def finish(self, rid: str, how: str, tokens: int = 0) -> None:
        with self._lock:
            if self._pending.pop(rid, None) is None:
                return
            c = self.counters
            c.in_flight -= 1
            c.completion_tokens += tokens
            setattr(c, how, getattr(c, how) + 1)

    def cancel(self, rid: str, how: str = "cancelled", tokens: int = 0) -> None:
        try:
            self.manager.cancel_request(rid)
        finally:
            self.finish(rid, how, tokens)

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
        out = {"http": c, "server": self.info}
        if self.stats_fn is not None:
            try:
                out["engine"] = self.stats_fn(self.manager)
            except Exception as e:  # stats must never take the server down
                out["engine"] = {"error": f"{type(e).__name__}: {e}"}
        return out


# ---------------------------------------------------------------------- request parsing
def _int_field(body: dict, name: str, lo: int, default):
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadRequest(f"{name} must be an integer >= {lo}, got {v!r}", name)
    return v


def _sampling(body: dict) -> None:
    """Greedy only: sampling fields are accepted when they select greedy decoding, refused otherwise."""
    t = body.get("temperature", None)
    if t is not None:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
            raise BadRequest(f"temperature must be a number >= 0, got {t!r}", "temperature")
        if t > 0:
            raise BadRequest("this server decodes greedily (one generation config for all requests): temperature "
                             f"must be 0 or left out, got {t}", "temperature")
    p = body.get("top_p", None)
    if p is not None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise BadRequest(f"top_p must be a number in (0, 1], got {p!r}", "top_p")
        # under greedy decoding top_p changes nothing: accepted
    for name in ("frequency_penalty", "presence_penalty"):
        v = body.get(name, None)
        if v not in (None, 0, 0.0):
            raise BadRequest(f"{name} is not supported by this server (got {v!r}); leave it out or 0", name)
    n = body.get("n", None)
    if n not in (None, 1):
        raise BadRequest(f"n must be 1 (one answer per request), got {n!r}", "n")
    seed = body.get("seed", None)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
    # a seed is accepted: greedy decoding gives the same answer under every seed


def _stop(body: dict) -> list[str]:
    s = body.get("stop", None)
    if s is None:
        return []
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or not all(isinstance(x, str) and x for x in s) or len(s) > 4:
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them", "stop")
    return s


def parse_request(server: Server, body, chat: bool) -> dict:
    """The request as {input_ids, max_tokens, stream, stop, ignore_eos}, or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    extra = sorted(set(body) - allowed)
    if extra:
        raise BadRequest(f"unsupported field(s): {', '.join(extra)}", extra[0])
    model = body.get("model", None)
    if model is not None and model != server.model_name:
        raise BadRequest(f"this server serves model {server.model_name!r}, not {model!r}", "model")
    _sampling(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", "stream")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
    if ignore_eos and not server.per_request_eos:
        raise BadRequest("ignore_eos needs a transformers whose continuous batching takes a per-request EOS",
                         "ignore_eos")
    for name in ("logprobs", "top_logprobs", "echo", "suffix"):
        if body.get(name) not in (None, False, 0):
            raise BadRequest(f"{name} is not supported by this server", name)
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of must be 1", "best_of")
    tok = server.tokenizer
    if chat:
        max_tokens = _int_field(body, "max_completion_tokens", 1, None)
        max_tokens = _int_field(body, "max_tokens", 1, max_tokens)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise BadRequest(f"messages[{i}] must be {{role: system|user|assistant, content: <text>}}",
                                 "messages")
            clean.append({"role": m["role"], "content": m["content"]})
        if not getattr(tok, "chat_template", None):
            raise BadRequest(f"model {server.model_name} has no chat template: use /v1/completions")
        text = tok.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
        ids = list(tok(text, add_special_tokens=False)["input_ids"])  # the template holds BOS where wanted
    else:
        max_tokens = _int_field(body, "max_tokens", 1, None)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("prompt is empty", "prompt")
            ids = list(tok(prompt)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            vocab = len(tok)
            if any(x < 0 or x >= vocab for x in prompt):
                raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
            ids = list(prompt)
        else:
            raise BadRequest("prompt must be a string, a list of token ids, or a list of one of these "
                             "(one prompt per request)", "prompt")
    if not ids:
        raise BadRequest("the prompt encodes to no tokens", "prompt")
    max_tokens = server.default_max_tokens if max_tokens is None else max_tokens
    if server.max_positions and len(ids) + max_tokens > server.max_positions:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"{server.max_positions} positions", "max_tokens")
    why = server.prompt_check(len(ids)) if server.prompt_check else None
    if why:
        raise BadRequest(why, "prompt")
    if server.prompt_limit and len(ids) > server.prompt_limit:
        raise BadRequest(f"prompt ({len(ids)} tokens) exceeds the {server.prompt_limit} tokens a request may hold "
                         f"in this server's cache", "prompt")
    if server.total_limit and len(ids) + max_tokens > server.total_limit:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the {server.total_limit} "
                         f"tokens one request may hold in this server's cache (--num-blocks x --page)", "max_tokens")
    return {"input_ids": ids, "max_tokens": max_tokens, "stream": stream, "stop": _stop(body),
            "ignore_eos": ignore_eos, "usage_in_stream": bool((body.get("stream_options") or {}).get("include_usage"))}


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
def build_app(server: Server):
    """The FastAPI application over `server`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="epikv serve", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                            status_code=status)

    @app.get("/health")
    async def health():
        if not server.healthy():
            return error(503, "the generation loop is not running", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "created": int(server.counters.started), "owned_by": "epikv"}]}

    @app.get("/stats")
    async def stats():
        return server.stats()

    async def handle(request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            return error(400, "the request body is not valid JSON")
        try:
            req = parse_request(server, body, chat)
        except BadRequest as e:
            return error(400, str(e), e.param)
        if not server.healthy():
            return error(503, "the generation loop is not running", kind="server_error")
        try:
            rid, q = server.submit(req["input_ids"], req["max_tokens"], streaming=req["stream"],
                                   ignore_eos=req["ignore_eos"])
        except RuntimeError as e:
            return error(503, str(e), kind="server_error")
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()),
                "model": server.model_name}
        n_prompt = len(req["input_ids"])
        if req["stream"]:
            return StreamingResponse(_stream(server, rid, q, req, meta, chat, n_prompt),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(server, rid, q, req, meta, chat, n_prompt, request, error)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _failed(out) -> bool:
    return getattr(out, "error", None) is not None


async def _next(server: Server, q: asyncio.Queue, rid: str):
    """The next output of request `rid`; None when the generation loop died meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(q.get(), timeout=1.0)
        except asyncio.TimeoutError:
            if not server.healthy():
                return None


async def _whole(server, rid, q, req, meta, chat, n_prompt, request, error):
    from fastapi.responses import JSONResponse

    det = _Detok(server, req["stop"], req["ignore_eos"])
    try:
        while True:
            out = await _next(server, q, rid)
            if out is None or _failed(out):
                server.finish(rid, "failed")
                why = "the generation loop stopped" if out is None else out.error
                return error(500, f"generation failed: {why}", kind="server_error")
            tokens = list(out.generated_tokens)
            if out.is_finished():  # a non-streaming request gets one output, at its end
                break
    except asyncio.CancelledError:  # the client left
        server.cancel(rid)
        raise
    det.step(tokens, final=True)
    text_tokens = det.ids(server.visible(tokens, req["ignore_eos"]))  # cut with the text at a stop string
    finish = "stop" if det.stopped else server.finish_reason(tokens, req["max_tokens"])
    if req["ignore_eos"]:
        finish = "length"
    server.finish(rid, "completed", len(tokens))
    choice = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": text_tokens}
    if chat:
        choice["message"] = {"role": "assistant", "content": det.sent}
        obj = "chat.completion"
    else:
        choice["text"] = det.sent
        obj = "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": [choice], "usage": _usage(n_prompt, len(tokens))})


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(server, rid, q, req, meta, chat, n_prompt):
    det = _Detok(server, req["stop"], req["ignore_eos"])
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent_ids = 0  # visible token ids sent so far

    def chunk(delta: str, ids: list[int], finish: str | None, first: bool = False):
        if chat:
            d = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta or not finish else {})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        choice["token_ids"] = ids
        return _sse({**meta, "object": obj, "choices": [choice]})

    finished = False
    first = True
    try:
        if chat:
            yield chunk("", [], None, first=True)
            first = False
        while True:
            out = await _next(server, q, rid)
            if out is None or _failed(out):
                why = "the generation loop stopped" if out is None else out.error
                server.finish(rid, "failed")
                finished = True
                yield _sse({"error": {"message": f"generation failed: {why}", "type": "server_error",
                                      "param": None, "code": None}})
                yield "data: [DONE]\n\n"
                return
            tokens = list(out.generated_tokens)
            done = out.is_finished()
            delta = det.step(tokens, final=done)
            vis = server.visible(tokens, req["ignore_eos"]) if done else [t for t in tokens]
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
