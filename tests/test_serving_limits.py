"""What one request cannot do to `epikv serve` (issue 55): stall other clients (a body over --max-request-bytes is
answered 413 as it arrives, a long prompt is tokenized off the event loop), get past the schema's bounds and strict
types, get a 500 or FastAPI's `{"detail": ...}` instead of the OpenAI error shape, keep running after its client
left, or use /v1/ without --api-key's token; --served-model-name's names are the ones a request may give. On the
scripted engine of test_serving_app; the Ray Serve router's own checks with a fake handle. 127.0.0.1 only."""

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_serving_app import MSGS, App, Scripted, _app, tok  # noqa: E402,F401 (tok: the module's fixture)


def _send(app, method, path, body=b"", headers=None, chunked=False):
    """(status, decoded JSON or text) of one raw request."""
    host, port = app.url.rsplit("/", 1)[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request(method, path, body=iter([body]) if chunked else body,
                  headers={"Content-Type": "application/json", **(headers or {})}, encode_chunked=chunked)
        r = c.getresponse()
        text = r.read().decode()
    finally:
        c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def _openai_error(status, body, code):
    assert status == code, (status, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"], body
    return err


def _health_times(app, until: threading.Event) -> list[float]:
    """Seconds each GET /health took, asked back to back until `until` is set."""
    times = []
    while not until.is_set():
        t = time.monotonic()
        assert app.get("/health") == '{"status":"ok"}'
        times.append(time.monotonic() - t)
    return times


def test_a_body_over_the_limit_is_413_while_health_answers(request, tok):
    """Mutant: the Guard middleware left out of build_app: the 4 MiB prompt is decoded and refused 400, not 413."""
    app = _app(request, tok)
    big = json.dumps({"prompt": "x" * (4 * 2**20)}).encode()
    done = threading.Event()
    got = {}

    def post():
        got["declared"] = _send(app, "POST", "/v1/completions", big)
        got["chunked"] = _send(app, "POST", "/v1/completions", big, chunked=True)  # no Content-Length: counted
        done.set()

    t = threading.Thread(target=post)
    t.start()
    times = _health_times(app, done)
    t.join()
    for how in ("declared", "chunked"):
        err = _openai_error(*got[how], 413)
        assert "--max-request-bytes" in err["message"] and str(2 * 2**20) in err["message"]
    assert times and max(times) < 1.0, times
    # a body under the limit still goes through, on the same server
    assert app.client.completions.create(model="scripted", prompt="x" * 1000, max_tokens=3).choices[0].text


def test_a_small_limit_refuses_a_normal_request(request, tok):
    """The limit is the server's setting (--max-request-bytes), not a constant. Mutant: Guard ignoring max_bytes."""
    app = _app(request, tok, max_request_bytes=100)
    status, body = _send(app, "POST", "/v1/completions", json.dumps({"prompt": "y" * 200}).encode())
    assert "100 bytes" in _openai_error(status, body, 413)["message"]
    assert _send(app, "POST", "/v1/completions", json.dumps({"prompt": "y", "max_tokens": 2}).encode())[0] == 200


class _SlowTokenizer:
    """The test tokenizer, taking `seconds` to encode each text (a very long prompt on a slow machine)."""

    def __init__(self, tok, seconds):
        self._tok, self.seconds, self.busy = tok, seconds, threading.Event()

    def __call__(self, *a, **kw):
        self.busy.set()
        time.sleep(self.seconds)
        return self._tok(*a, **kw)

    def __len__(self):
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_a_prompt_being_tokenized_does_not_stall_health(request, tok):
    """Mutant: parse_body called on the event loop (no asyncio.to_thread): /health waits out the 2 s encode."""
    slow = _SlowTokenizer(tok, 2.0)
    app = App(Scripted(tok, eos=tok.eos_token_id), slow)
    request.addfinalizer(app.close)
    done = threading.Event()
    got = []

    def post():
        got.append(app.client.completions.create(model="scripted", prompt="hello", max_tokens=3))
        done.set()

    t = threading.Thread(target=post)
    t.start()
    assert slow.busy.wait(10)
    times = _health_times(app, done)
    t.join()
    assert got and got[0].choices[0].text and max(times) < 1.0, times


@pytest.mark.parametrize("body", [b"[" * 200_000 + b"]" * 200_000,
                                  b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
                                  b'{"messages": [{"role": "user", "content": ' + b"[" * 980 + b"]" * 980 + b"}]}"])
def test_deeply_nested_json_is_a_400(request, tok, body):
    """Too deep to decode (the first two), or decoded and refused by name. Mutant: parse_body without its
    RecursionError clause: a bare 500 (the first two)."""
    app = _app(request, tok)
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    err = _openai_error(*_send(app, "POST", path, body), 400)
    assert err["type"] == "invalid_request_error"
    assert app.get("/health") == '{"status":"ok"}'


def test_a_refused_value_too_deep_to_show():
    """The refusal shows the value as JSON, or says it nests too deeply (never a RecursionError, a 500).
    Mutant: _as_json without RecursionError in its except."""
    from epikv.serving.schema import _as_json

    deep = []
    for _ in range(100_000):
        deep = [deep]
    assert _as_json(deep) == "a value nested too deeply"
    assert _as_json([True, None, "é"]) == '[true, null, "é"]' and _as_json("x" * 100).endswith('xxx...')


@pytest.mark.parametrize("field, value, shown", [("n", True, "got true"), ("best_of", True, "got true"),
                                                 ("echo", 0, "got 0"), ("top_logprobs", False, "got false"),
                                                 ("logprobs", True, "got true")])
def test_literal_fields_keep_json_types_apart(request, tok, field, value, shown):
    """`n: true`, `echo: 0`, `top_logprobs: false` are refused, as /openapi.json's const says, and the message shows
    the value as JSON. Mutants: _exactly's check that returns v whatever its type (accepted, 200); the refusal
    showing {got!r} ("got True")."""
    app = _app(request, tok)
    chat = field == "top_logprobs"
    base = {"messages": MSGS} if chat else {"prompt": "x"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    err = _openai_error(*_send(app, "POST", path, json.dumps({**base, field: value, "max_tokens": 2}).encode()), 400)
    assert err["param"] == field and err["message"].endswith(shown), err
    if field != "logprobs":  # the value of the right type still passes
        ok = {"n": 1, "best_of": 1, "echo": False, "top_logprobs": 0}[field]
        assert _send(app, "POST", path, json.dumps({**base, field: ok, "max_tokens": 2}).encode())[0] == 200


def test_bounded_fields(request, tok):
    """A field past its schema bound is refused by name (a stop string, the user, the token ids).
    Mutant: MAX_SHORT's bound off the stop field (accepted)."""
    from epikv.serving.schema import MAX_SHORT

    app = _app(request, tok)
    for field, value in (("stop", "s" * (MAX_SHORT + 1)), ("user", "u" * (MAX_SHORT + 1)),
                         ("model", "m" * (MAX_SHORT + 1))):
        err = _openai_error(*_send(app, "POST", "/v1/completions",
                                   json.dumps({"prompt": "x", field: value}).encode()), 400)
        assert err["param"] == field and f"at most {MAX_SHORT}" in err["message"], err


@pytest.mark.parametrize("method, path, code", [("GET", "/", 404), ("GET", "/v1/nope", 404),
                                                ("GET", "/v1/completions", 405), ("DELETE", "/health", 405),
                                                ("POST", "/v1/models", 405)])
def test_fastapis_own_refusals_in_the_openai_shape(request, tok, method, path, code):
    """Mutant: the HTTPException handler left out of build_app: FastAPI's {"detail": ...}."""
    app = _app(request, tok)
    err = _openai_error(*_send(app, method, path), code)
    assert path in err["message"]


def test_a_client_that_leaves_a_whole_request_cancels_it(request, tok):
    """A non-streamed request whose client disconnects is cancelled in the engine within a second (its cache goes
    back to the pool), as a stream is. Mutant: _whole awaiting the answer alone (no _client_left): it runs on."""
    backend = Scripted(tok, finish=False)  # never ends by itself
    app = _app(request, tok, backend=backend)
    host, port = app.url.rsplit("/", 1)[1].split(":")
    body = json.dumps({"prompt": "x", "max_tokens": 100000}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    end = time.monotonic() + 10
    while app.server.running() < 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert app.server.running() == 1
    s.close()
    end = time.monotonic() + 1.0
    while (app.server.in_flight() or not backend.cancelled) and time.monotonic() < end:
        time.sleep(0.01)
    assert len(backend.cancelled) == 1 and app.server.in_flight() == 0
    assert json.loads(app.get("/stats"))["http"]["cancelled"] == 1


def test_api_key(request, tok):
    """--api-key: /v1/ routes need `Authorization: Bearer <key>` (401 in the OpenAI shape without it or with another
    key); /health stays open. Mutant: `authorized` always true (200 without a key)."""
    app = _app(request, tok, api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        for method, path, body in (("POST", "/v1/completions", b'{"prompt": "x"}'), ("GET", "/v1/models", b"")):
            err = _openai_error(*_send(app, method, path, body, headers=headers), 401)
            assert err["code"] == "invalid_api_key" and "--api-key" in err["message"]
    with pytest.raises(openai.AuthenticationError):
        app.client.completions.create(model="scripted", prompt="x", max_tokens=2)
    good = openai.OpenAI(base_url=app.url + "/v1", api_key="sekret", max_retries=0, timeout=30)
    assert good.completions.create(model="scripted", prompt="x", max_tokens=2).choices[0].text
    assert [m.id for m in good.models.list()] == ["scripted"]
    assert app.get("/health") == '{"status":"ok"}'


def test_served_model_names(request, tok):
    """Every --served-model-name is accepted and listed; answers carry the first; another name is a 400 naming the
    served ones. Mutant: parse_request comparing with model_name alone (the alias gets 400)."""
    app = _app(request, tok, aliases=("short", "also"))
    assert [m.id for m in app.client.models.list()] == ["scripted", "short", "also"]
    r = app.client.completions.create(model="short", prompt="x", max_tokens=2)
    assert r.model == "scripted"
    with pytest.raises(openai.BadRequestError) as e:
        app.client.completions.create(model="/some/folder", prompt="x", max_tokens=2)
    assert '"scripted" or "short" or "also", not "/some/folder"' in e.value.message
    doc = json.loads(app.get("/openapi.json"))
    enum = doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["anyOf"][0]["enum"]
    assert enum == ["scripted", "short", "also"]


# ---------------------------------------------------------------------- the Ray Serve router's own checks
class _NoHandle:
    """A deployment handle that must not be reached."""

    def options(self, **kw):
        raise AssertionError("the router forwarded a request it should have refused")


def _route(router, path="/v1/completions", body=b"{}", headers=()):
    from starlette.requests import Request

    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)] or [b""]

    async def receive():
        c = chunks.pop(0)
        return {"type": "http.request", "body": c, "more_body": bool(chunks)}

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    resp = asyncio.run(router(Request(scope, receive)))
    return resp.status_code, json.loads(resp.body)


def test_the_ray_router_refuses_a_big_body_and_a_missing_key_itself():
    """Under --ray the router answers HTTP: 413 and 401 come from it, before a body travels to a replica.
    Mutants: Router.__call__ without the read_body limit (forwarded), without the key check (forwarded)."""
    from epikv.serving.ray_serve import Router

    router = Router(_NoHandle(), max_request_bytes=1000, api_key="k")
    auth = [("Authorization", "Bearer k")]
    err = _openai_error(*_route(router, body=b"x" * 300_000, headers=auth), 413)
    assert "1000 bytes" in err["message"]
    err = _openai_error(*_route(router, body=b'{"prompt": "x"}'), 401)
    assert err["code"] == "invalid_api_key"
    with pytest.raises(AssertionError, match="forwarded"):  # a good request does reach the handle
        _route(router, body=b'{"prompt": "x"}', headers=auth)


# ---------------------------------------------------------------------- the options, from the CLI to the Server
def _config(*argv):
    from epikv.cli import build_parser
    from epikv.commands.serve import config

    return config(build_parser().parse_args(["serve", "--model", "random:tiny", "--num-blocks", "16", *argv]))


def test_the_options_reach_the_server(monkeypatch):
    """--served-model-name, --max-request-bytes and --api-key (or $EPIKV_API_KEY) go through ServeConfig into the
    torch engine's Server (a Ray replica builds the same). Mutant: build.py passing model_name=cfg.model (the local
    folder's path stays the id)."""
    from epikv.serving.build import prepare
    from epikv.serving.guard import DEFAULT_MAX_REQUEST_BYTES

    monkeypatch.delenv("EPIKV_API_KEY", raising=False)
    plain = _config()
    assert (plain.served_names, plain.max_request_bytes, plain.api_key) == (("random:tiny",),
                                                                            DEFAULT_MAX_REQUEST_BYTES, None)
    monkeypatch.setenv("EPIKV_API_KEY", "from-env")
    assert _config().api_key == "from-env" and _config("--api-key", "given").api_key == "given"
    assert "from-env" not in repr(_config())  # never printed with the config
    cfg = _config("--served-model-name", "tiny", "tiny-alias", "--max-request-bytes", "5000", "--api-key", "k")
    server, stop, _ = prepare(cfg)()
    try:
        assert (server.model_name, server.model_names) == ("tiny", ["tiny", "tiny-alias"])
        assert (server.max_request_bytes, server.api_key) == (5000, "k")
    finally:
        server.close()
        stop()


@pytest.mark.parametrize("argv, needle", [(["--served-model-name", " "], "--served-model-name: a name must not"),
                                          (["--api-key", ""], "--api-key: the key must be non-empty"),
                                          (["--api-key", "a b"], "--api-key: the key must be non-empty")])
def test_bad_http_options_exit_2_in_one_line(capsys, argv, needle):
    from epikv.cli import main

    assert main(["serve", "--model", "random:tiny", "--num-blocks", "16", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


def test_max_request_bytes_must_be_positive(capsys):
    from epikv.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--num-blocks", "16", "--max-request-bytes", "0"])
    assert e.value.code == 2 and "--max-request-bytes" in capsys.readouterr().err


def test_under_ray_the_key_the_limit_and_the_error_shape_hold():
    """`serve --ray` end to end (one replica on a local Ray instance): the router answers 401 without the key and
    413 for a body over --max-request-bytes, the replica's app answers an unknown path in the OpenAI shape, and a
    good request with the key and a --served-model-name is served. (Router and replica both check key and size:
    the router's own checks are the fake-handle test above.) Mutants: guard.authorized always true (200, not 401);
    the app's HTTPException handler left out (the 404 is FastAPI's {"detail": ...})."""
    pytest.importorskip("ray.serve")
    import signal

    from test_serving_http import SERVE, Served

    s = Served(["--ray", "--replicas", "1", *SERVE, "--api-key", "k", "--max-request-bytes", "5000",
                "--served-model-name", "tiny"])
    try:
        def post(path, body, key=None):
            req = urllib.request.Request(s.url + path, data=body, headers={
                "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        small = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3}).encode()
        assert _openai_error(*post("/v1/completions", small), 401)["code"] == "invalid_api_key"
        big = json.dumps({"model": "tiny", "prompt": "x" * 6000}).encode()
        assert "5000 bytes" in _openai_error(*post("/v1/completions", big, "k"), 413)["message"]
        assert _openai_error(*post("/nope", small, "k"), 404)
        status, body = post("/v1/completions", small, "k")
        assert status == 200 and body["model"] == "tiny" and body["choices"][0]["text"] is not None
        assert s.get("/health") == {"status": "ok"}  # open without the key
    finally:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(90)
        except Exception:  # noqa: BLE001
            s.proc.kill()
