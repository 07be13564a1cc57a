"""What `epikv serve` checks before a request reaches its handler, shared by the app (serving/app.py) and the Ray
Serve router (serving/ray_serve.py, which answers HTTP without importing the app and torch with it): the API key
(`--api-key`, a Bearer token on /v1/ routes, as vLLM checks it), the body's size (`--max-request-bytes`: 413), and the
OpenAI error shape every refusal is written in. Imports only starlette.
"""

from __future__ import annotations

import hmac

DEFAULT_MAX_REQUEST_BYTES = 2 * 2**20  # 2 MiB: a 128k-token prompt as text or as token ids fits
# past this much of an oversized body, stop reading it and close the connection (reading the rest first lets a client
# that writes its whole body before reading get its 413 instead of a reset connection)
_DRAIN_BYTES = 64 * 2**20


def error_json(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_json(message, kind, param, code), status_code=status, headers=headers)


def protected(path: str) -> bool:
    """Whether --api-key applies to a path: the OpenAI routes (/health, /stats, /metrics stay open, as in vLLM)."""
    return path.startswith("/v1/") or path == "/v1"


def authorized(headers, api_key: str | None) -> bool:
    """Whether raw ASGI `headers` carry `Authorization: Bearer <api_key>` (always, without a key)."""
    if not api_key:
        return True
    for k, v in headers:
        if k.lower() == b"authorization":
            scheme, _, token = v.decode("latin-1").strip().partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
    return False


def unauthorized():
    return error_response(401, "a valid API key is required: send the header Authorization: Bearer <key> "
                               "(--api-key)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def too_large(limit: int, close: bool = False):
    return error_response(413, f"the request body is larger than this server's {limit} bytes (--max-request-bytes)",
                          headers={"Connection": "close"} if close else None)


class TooLarge(Exception):
    def __init__(self, drained: bool):
        super().__init__("the request body is too large")
        self.drained = drained  # the whole body was read (the connection may stay open)


async def read_body(receive, headers, limit: int | None) -> bytes:
    """The body of an ASGI http request read through `receive`, or TooLarge once it passes `limit` bytes (None: no
    limit). A declared Content-Length over the limit is refused before reading; what is read past the limit is
    dropped, not kept."""
    declared = next((v for k, v in headers if k.lower() == b"content-length"), None)
    if limit is not None and declared is not None and declared.isdigit() and int(declared) > _DRAIN_BYTES:
        raise TooLarge(drained=False)
    over = limit is not None and declared is not None and declared.isdigit() and int(declared) > limit
    parts, size = [], 0
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            break
        chunk = m.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            over = True
        if over:
            parts.clear()
            if size > _DRAIN_BYTES:
                raise TooLarge(drained=False)
        else:
            parts.append(chunk)
        if not m.get("more_body", False):
            break
    if over:
        raise TooLarge(drained=True)
    return b"".join(parts)


class Guard:
    """ASGI middleware: 401 without the API key on /v1/ routes, 413 for a body over `max_bytes`; otherwise the app
    gets the request with its body read (replayed from memory), and the client's later messages (a disconnect)."""

    def __init__(self, app, max_bytes: int | None, api_key: str | None):
        self.app, self.max_bytes, self.api_key = app, max_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key and protected(scope["path"]) and not authorized(scope["headers"], self.api_key):
            return await unauthorized()(scope, receive, send)
        try:
            body = await read_body(receive, scope["headers"], self.max_bytes)
        except TooLarge as e:
            return await too_large(self.max_bytes, close=not e.drained)(scope, receive, send)
        first = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)
