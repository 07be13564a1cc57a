"""`epikv bench serve --url` against a server that is not epikv serve (llama.cpp's llama-server): tokens counted from
its per-chunk timings and closing usage, not one per chunk, and a row without engine counts. A fake OpenAI server
streams in llama-server's wire format: text deltas, top-level `timings.predicted_n` (cumulative; one chunk carries
two tokens, as llama-server sends a character split over tokens), then a usage-only chunk; no /stats."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# (content, predicted_n so far): 7 tokens in 5 chunks with text
CHUNKS = [("The", 1), (" answer", 2), (" é", 4), ("", 5), (" is", 6), (" 4", 7)]
TOTAL = 7


class _Fake(BaseHTTPRequestHandler):
    bodies: list[dict] = []
    send_timings = True  # False: a server that ignores timings_per_token

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        if self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": "fake.gguf", "object": "model"}]})
        else:
            self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Fake.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        meta = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake.gguf"}
        timings = body.get("timings_per_token") and _Fake.send_timings
        for i, (text, n) in enumerate(CHUNKS):
            ch = {**meta, "choices": [{"index": 0, "delta": {"content": text} if text else {},
                                       "finish_reason": "length" if i == len(CHUNKS) - 1 else None}]}
            if timings:
                ch["timings"] = {"predicted_n": n, "predicted_ms": 1.0}
            self.wfile.write(f"data: {json.dumps(ch)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            u = {**meta, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": TOTAL, "total_tokens": 10}}
            self.wfile.write(f"data: {json.dumps(u)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _json(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def fake():
    _Fake.bodies, _Fake.send_timings = [], True
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_external_server_tokens_from_timings_and_usage(fake):
    from epikv.bench.serve import Row, run_row

    msgs = [[{"role": "user", "content": "2+2?"}]] * 3
    rec = run_row(Row("full", None, name="llama-server"), [], msgs, concurrency=3, max_tokens=TOTAL, timeout=60,
                  log=None, url=fake, say=lambda *_: None)
    assert rec["label"] == "llama-server" and rec["engine"] == "external"
    assert rec["completed"] == 3 and rec["complete_length"] == 3
    assert rec["generated_tokens"] == 3 * TOTAL
    assert sum(rec["tokens_by_second"]) == 3 * TOTAL  # the window counts match the totals
    # asked for what it needs, and forced length as epikv serve is
    assert all(b.get("timings_per_token") is True and b["stream_options"]["include_usage"] is True
               and b.get("ignore_eos") is True for b in _Fake.bodies)
    assert rec["max_in_flight"] is None and rec["evictions"] is None  # no engine counts from a server without them


def test_external_server_without_usage_counts_timings(fake, monkeypatch):
    """Without the usage chunk the cumulative timings alone give the count (a chunk of two tokens counts two)."""
    import asyncio

    from epikv.bench.serve import drive

    monkeypatch.setattr(_Fake, "do_POST", _no_usage(_Fake.do_POST))
    res = asyncio.run(drive(fake, "fake.gguf", [[{"role": "user", "content": "x"}]], 1, TOTAL, 60, external=True))
    assert res["records"][0]["tokens"] == TOTAL


def test_external_server_without_timings_counts_usage(fake, monkeypatch):
    """A server that sends text and a closing usage only: its total, not one per chunk with text (5 here)."""
    import asyncio

    from epikv.bench.serve import drive

    monkeypatch.setattr(_Fake, "send_timings", False)
    res = asyncio.run(drive(fake, "fake.gguf", [[{"role": "user", "content": "x"}]], 1, TOTAL, 60, external=True))
    assert res["records"][0]["tokens"] == TOTAL and sum(res["tokens_by_second"]) == TOTAL


def _no_usage(post):
    def do_post(self):
        length = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(length))
        body.pop("stream_options", None)
        data = json.dumps(body).encode()
        import io

        self.rfile = io.BytesIO(data)
        self.headers.replace_header("Content-Length", str(len(data)))
        post(self)
    return do_post


def test_table_prints_dashes_for_an_external_row(fake):
    from epikv.bench.serve import Row, run_row, table

    rec = run_row(Row("full", None, name="llama-server"), [], [[{"role": "user", "content": "x"}]], 1, TOTAL, 60,
                  log=None, url=fake, say=lambda *_: None)
    line = next(x for x in table([rec], []).splitlines() if x.startswith("| llama-server"))
    assert "None" not in line and line.startswith("| llama-server | 1/1 | - | - |")


def test_label_needs_url(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "epikv.cli", "bench", "serve", "--num-blocks", "8", "--label", "x",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and "--label" in r.stderr and "Traceback" not in r.stderr
