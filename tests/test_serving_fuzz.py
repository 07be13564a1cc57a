"""Schemathesis against `epikv serve` on both engines (benchmarks/fuzz_serve.py; the small models, a bounded number of
examples per route and mode here, a longer run as that script's command): requests drawn from /openapi.json, valid
and schema-breaking, get no 5xx, no hang past --request-timeout, statuses / content types / bodies the document
lists, a 4xx for every schema-breaking body; afterwards nothing in flight, no pages or cells held, /health ok and a
clean exit on SIGTERM."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fuzz_serve  # noqa: E402

EXAMPLES = 12  # per route and mode: a few seconds each on the tiny model


@pytest.mark.parametrize("engine", ["torch", "llama.cpp"])
def test_fuzz_no_server_error_nothing_left_held(engine):
    if engine == "llama.cpp":
        from epikv.llamacpp import available

        assert available(), "llama-cpp-python is missing: run `bash scripts/install.sh --llamacpp`"
    else:
        from test_serving_http import cb_internals  # noqa: F401  (transformers' continuous batching present)
    s = fuzz_serve.Server(fuzz_serve.ENGINES[engine])
    try:
        out = fuzz_serve.fuzz_server(s.url, EXAMPLES)
    finally:
        rc = s.stop()
    assert not out["failures"], out["failures"][:3]
    posts = {r: c for r, c in out["statuses"].items() if r.startswith("POST")}
    assert len(posts) == 2 and all(c.get(200) and c.get(400) for c in posts.values()), out["statuses"]
    assert all(int(code) < 500 for c in out["statuses"].values() for code in c)
    assert out["slowest_s"] < fuzz_serve.REQUEST_TIMEOUT + fuzz_serve.MARGIN
    assert out["idle"]["in_flight"] == 0 and out["idle"]["held"] == 0 and out["idle"]["failed"] == 0, out["idle"]
    assert out["health"] == {"status": "ok"} and rc == 0
