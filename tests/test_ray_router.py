"""The pieces of `epikv serve --ray` that run without Ray: `asgi_forward` (one HTTP request through an ASGI app
in-process, the way an engine replica answers its Router) and the `Router`'s recovery when the replica it streams
from dies (an SSE error event and [DONE] mid-stream, a 503 with Retry-After before anything was sent), with a fake
deployment handle. test_serving_ray runs the same path end to end on a local Ray instance."""

import asyncio
import json

import pytest

pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from epikv.serving.ray_serve import Router, asgi_forward  # noqa: E402

closed = []


async def whole(request):
    body = await request.json()
    return JSONResponse({"echo": body, "q": request.url.query}, headers={"X-Epikv-Replica": "r1"})


async def stream(request):
    async def gen():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)
        finally:  # the app's own clean-up when its client leaves (epikv's _stream cancels the request here)
            closed.append(True)

    return StreamingResponse(gen(), media_type="text/event-stream")


APP = Starlette(routes=[Route("/whole", whole, methods=["POST"]), Route("/stream", stream)])


async def _collect(agen, n=None):
    out = []
    async for part in agen:
        out.append(part)
        if n is not None and len(out) == n:
            await agen.aclose()
            break
    return out


def test_a_whole_answer_is_one_item_with_its_head():
    parts = asyncio.run(_collect(asgi_forward(APP, "POST", "/whole", b"a=1", [(b"content-type", b"application/json")],
                                              b'{"x": 2}')))
    assert len(parts) == 1
    head = parts[0]
    assert head["status"] == 200 and head["more"] is False
    assert json.loads(head["body"]) == {"echo": {"x": 2}, "q": "a=1"}
    assert (b"x-epikv-replica", b"r1") in head["headers"]


def test_a_stream_comes_chunk_by_chunk_and_leaving_early_closes_it_in_the_app():
    closed.clear()
    parts = asyncio.run(_collect(asgi_forward(APP, "GET", "/stream", b"", [], b""), n=3))
    assert parts[0]["status"] == 200 and parts[0]["more"] is True and parts[0]["body"] == b"data: 0\n\n"
    assert parts[1:] == [b"data: 1\n\n", b"data: 2\n\n"]
    assert closed == [True], "the app's stream was not closed when the caller left"


class _Died(Exception):
    """What a handle raises when the actor behind it died (ray.exceptions.ActorDiedError in Ray)."""


class _Call:
    def __init__(self, parts, die_after):
        self.parts, self.die_after, self.cancelled = list(parts), die_after, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.die_after == 0:
            raise _Died("the actor died unexpectedly")
        self.die_after -= 1
        if not self.parts:
            raise StopAsyncIteration
        return self.parts.pop(0)

    def cancel(self):
        self.cancelled = True


class _Handle:
    """A fake DeploymentHandle: `.options(stream=True).forward.remote(...)` returns the prepared call."""

    def __init__(self, call):
        self.call, self.forward = call, self

    def options(self, **kw):
        assert kw == {"stream": True}
        return self

    def remote(self, *args):
        self.args = args
        return self.call


def _request(path="/v1/completions", body=b"{}", root_path=""):
    sent = [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": [],
             "root_path": root_path}
    return Request(scope, receive)


def _answer(call):
    async def go():
        resp = await Router(_Handle(call))(_request())
        body = b""
        if hasattr(resp, "body_iterator"):
            async for chunk in resp.body_iterator:
                body += chunk if isinstance(chunk, bytes) else chunk.encode()
        else:
            body = resp.body
        return resp, body

    return asyncio.run(go())


SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def test_a_replica_that_dies_mid_stream_ends_it_with_an_error_event_and_done():
    head = {"status": 200, "headers": SSE, "body": b"data: {\"n\": 0}\n\n", "more": True}
    call = _Call([head, b"data: {\"n\": 1}\n\n"], die_after=2)
    resp, body = _answer(call)
    events = [e[len("data: "):] for e in body.decode().split("\n\n") if e]
    assert resp.status_code == 200 and events[:2] == ['{"n": 0}', '{"n": 1}']
    err = json.loads(events[2])["error"]
    assert err["type"] == "server_error" and "replica" in err["message"] and "_Died" in err["message"]
    assert events[3:] == ["[DONE]"]
    assert not call.cancelled  # it ended by itself: nothing to cancel


def test_a_replica_that_dies_before_answering_gives_503_with_retry_after():
    resp, body = _answer(_Call([], die_after=0))
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert "stopped before answering" in json.loads(body)["error"]["message"]


def test_answers_and_refusals_are_relayed_as_the_replica_sent_them():
    head = {"status": 429, "headers": [(b"content-type", b"application/json"), (b"retry-after", b"3"),
                                       (b"content-length", b"2")], "body": b"{}", "more": False}
    resp, body = _answer(_Call([head], die_after=5))
    assert resp.status_code == 429 and resp.headers["retry-after"] == "3" and body == b"{}"
    ok = {"status": 200, "headers": SSE, "body": b"data: 1\n\n", "more": True}
    call = _Call([ok, b"data: [DONE]\n\n"], die_after=5)
    resp, body = _answer(call)
    assert body == b"data: 1\n\ndata: [DONE]\n\n" and not call.cancelled


def test_a_client_that_leaves_cancels_the_call_in_the_replica():
    ok = {"status": 200, "headers": SSE, "body": b"data: 1\n\n", "more": True}
    call = _Call([ok, b"data: 2\n\n", b"data: 3\n\n"], die_after=5)

    async def go():
        resp = await Router(_Handle(call))(_request())
        it = resp.body_iterator
        await it.__anext__()
        await it.aclose()  # the client left after the first chunk

    asyncio.run(go())
    assert call.cancelled


def test_an_application_under_a_route_prefix_forwards_the_path_below_it():
    """A second server on a cluster's Serve answers under /<its app name> (Serve's proxy puts the prefix in
    root_path and keeps it in path): the replica's app gets its own routes, /v1/completions.
    Mutant: the Router forwards scope["path"] as it came: the replica would answer 404."""
    head = {"status": 200, "headers": [], "body": b"{}", "more": False}
    for path, root in (("/epikv-b/v1/completions", "/epikv-b"), ("/v1/completions", ""), ("/epikv-b", "/epikv-b")):
        handle = _Handle(_Call([head], die_after=5))
        asyncio.run(Router(handle)(_request(path, root_path=root)))
        assert handle.args[:2] == ("POST", path[len(root):] or "/"), (path, handle.args)
