"""`epikv serve` as a process, on a random tiny model, 127.0.0.1 only: the drain on SIGTERM (no finished answer
lost, open streams ended with an error event, exit 0), /metrics of the real engine, and a soak bounded in count and
time (500 requests of random short lengths, a third streamed, one in ten dropped mid-stream, one in twenty
malformed): every well-formed request answered once, no duplicate ids, pages in use back to 0 when idle, RSS after
the soak within 10 % of after the warm-up, /health ok throughout.

EPIKV_SOAK_OUT=<file.json> writes the soak's figures there (benchmarks/results/serve/ keeps one run)."""

import http.client
import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from test_serving_http import MODEL, Served, cb_internals  # noqa: E402,F401  (one launcher for the serve tests)

BASE = ["--model", MODEL, "--policy", "epikv", "--budget", "128", "--page", "16", "--num-blocks", "256",
        "--max-batch-tokens", "128"]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _post(url, body: bytes, timeout=60):
    """(status, body text) of a POST over a fresh connection."""
    host = url.split("//")[1]
    c = http.client.HTTPConnection(host, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def _drop_mid_stream(url, body: dict) -> None:
    """Start a streamed request, read its first event, hang up."""
    host = url.split("//")[1]
    c = http.client.HTTPConnection(host, timeout=60)
    try:
        c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        r.fp.readline()  # the first event's line
    finally:
        c.close()


class HealthWatch:
    """Polls /health every 0.2 s in a thread; stop() returns every answer that was not ok."""

    def __init__(self, s) -> None:
        self.bad: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(s,), daemon=True)
        self._thread.start()

    def _watch(self, s) -> None:
        while not self._stop.is_set():
            try:
                h = s.get("/health")
                if h != {"status": "ok"}:
                    self.bad.append(h)
            except Exception as e:  # noqa: BLE001 (any failure is a finding)
                self.bad.append(repr(e))
            time.sleep(0.2)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(5)
        return self.bad


def soak_request(s, i: int, r: random.Random, model: str, vocab: int = 49152):
    """One soak request number i, drawn from r: random prompt ids and length, half sampled; one in twenty malformed,
    one in ten dropped mid-stream, a third streamed. -> (kind, id or None)."""
    prompt = [r.randrange(3, vocab) for _ in range(r.randint(1, 40))]
    body = dict(model=model, prompt=prompt, max_tokens=r.randint(1, 40))
    if r.random() < 0.5:
        body.update(temperature=0.6, top_p=0.95, seed=i)
    if i % 20 == 7:  # malformed: broken JSON or a bad field
        status, text = _post(s.url, b'{"prompt": [1, 2' if i % 40 == 7 else json.dumps(
            {**body, "max_tokens": -3}).encode())
        assert status == 400 and "error" in json.loads(text), text
        return "malformed", None
    if i % 10 == 3:
        _drop_mid_stream(s.url, body)
        return "dropped", None
    if i % 3 == 0:
        parts = list(s.client.completions.create(stream=True, **body))
        assert parts[-1].choices[0].finish_reason in ("stop", "length")
        assert len({p.id for p in parts}) == 1
        return "streamed", parts[0].id
    out = s.client.completions.create(**body)
    assert out.choices[0].finish_reason in ("stop", "length")
    return "whole", out.id


def _wait_idle(s, in_use: str = "pages_in_use", timeout=20):
    end = time.monotonic() + timeout
    st = s.get("/stats")
    while (st["http"]["in_flight"] or st["engine"][in_use]) and time.monotonic() < end:
        time.sleep(0.1)
        st = s.get("/stats")
    return st


def soak(s, model: str, seed: int, in_use: str) -> dict:
    """The soak on a served engine: 100 warm-up requests, then 500 (soak_request, request i drawn from
    Random(seed + i)), 16 at a time; /stats once idle (the engine's `in_use` gauge back to 0) and the server's RSS
    after each part."""
    def run(ids):
        with ThreadPoolExecutor(16) as ex:
            return list(ex.map(lambda i: soak_request(s, i, random.Random(seed + i), model), ids))

    t0 = time.monotonic()
    warm = run(range(100))
    idle_warm = _wait_idle(s, in_use)
    rss_warm = _rss_kib(s.proc.pid)
    t1 = time.monotonic()
    got = run(range(100, 600))
    soak_s = time.monotonic() - t1
    idle = _wait_idle(s, in_use)
    return {"warm": warm, "got": got, "idle_warm": idle_warm, "idle": idle, "rss_warm": rss_warm,
            "rss_after": _rss_kib(s.proc.pid), "soak_s": soak_s, "total_s": time.monotonic() - t0}


def test_drain_on_sigterm_loses_no_finished_answer():
    s = Served(BASE + ["--max-tokens", "64", "--drain-timeout", "6"])
    try:
        results, errors = {}, {}

        def short(i):
            kw = dict(model=MODEL, prompt=f"Request {i}: the sum of odd numbers", max_tokens=48, temperature=0.6,
                      seed=i, extra_body={"ignore_eos": True})
            if i % 2:
                parts = list(s.client.completions.create(stream=True, **kw))
                results[i] = (sum(len(p.choices[0].model_extra["token_ids"]) for p in parts),
                              parts[-1].choices[0].finish_reason)
            else:
                r = s.client.completions.create(**kw)
                results[i] = (r.usage.completion_tokens, r.choices[0].finish_reason)

        def long():
            try:
                for _ in s.client.completions.create(model=MODEL, prompt="A long one", max_tokens=8000, stream=True,
                                                     extra_body={"ignore_eos": True}):
                    pass
            except openai.APIError as e:
                errors["long"] = str(e)

        threads = [threading.Thread(target=short, args=(i,)) for i in range(6)] + [threading.Thread(target=long)]
        for t in threads:
            t.start()
        end = time.monotonic() + 30
        while s.get("/stats")["http"]["in_flight"] < 7 and time.monotonic() < end:
            time.sleep(0.02)
        assert s.get("/stats")["http"]["in_flight"] == 7
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(openai.InternalServerError) as e:  # no new request while draining: 503 + Retry-After
            s.client.completions.create(model=MODEL, prompt="late", max_tokens=4)
        assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) >= 1
        for t in threads:
            t.join(60)
        rc = s.proc.wait(60)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    err = "".join(s.err)
    assert rc == 0 and "epikv serve: stopped" in err, err
    assert results == {i: (48, "length") for i in range(6)}  # every request in flight finished, whole
    assert "drain-timeout 6" in errors.get("long", ""), errors  # the open stream ended with an error event
    assert "1 request(s) still running" in err


def test_metrics_of_the_real_engine_and_soak(request):
    from prometheus_client.parser import text_string_to_metric_families

    # K = 64 in pages of 8: prompts of 1 to 40 tokens with up to 40 new ones, so many requests evict
    s = Served(["--model", MODEL, "--policy", "epikv", "--budget", "64", "--page", "8", "--num-blocks", "256",
                "--max-batch-tokens", "128", "--max-tokens", "40"])
    request.addfinalizer(lambda: (s.proc.send_signal(signal.SIGTERM), s.proc.wait(60)))
    health = HealthWatch(s)
    r = soak(s, MODEL, 1000, "pages_in_use")
    warm, got, idle, st, rss_warm, rss_after = (r[k] for k in ("warm", "got", "idle_warm", "idle", "rss_warm",
                                                               "rss_after"))
    health_bad = health.stop()
    kinds = [k for k, _ in warm + got]
    ids = [x for _, x in warm + got if x is not None]
    answered = kinds.count("whole") + kinds.count("streamed")
    http_st, eng = st["http"], st["engine"]
    figures = {"requests": len(got), "warmup": len(warm), "whole": kinds.count("whole"),
               "streamed": kinds.count("streamed"), "dropped": kinds.count("dropped"),
               "malformed": kinds.count("malformed"), "soak_seconds": round(r["soak_s"], 1),
               "total_seconds": round(r["total_s"], 1), "rss_after_warmup_mib": round(rss_warm / 1024, 1),
               "rss_after_soak_mib": round(rss_after / 1024, 1), "rss_ratio": round(rss_after / rss_warm, 3),
               "completed": http_st["completed"], "cancelled": http_st["cancelled"], "failed": http_st["failed"],
               "evictions": eng["evictions"], "peak_pages": eng["peak_pages"], "pages_in_use_idle": eng["pages_in_use"],
               "health_failures": len(health_bad)}
    print("soak:", json.dumps(figures))
    if os.environ.get("EPIKV_SOAK_OUT"):
        with open(os.environ["EPIKV_SOAK_OUT"], "w") as f:
            json.dump(figures, f, indent=1)
    assert len(ids) == answered == len(set(ids))  # every well-formed request answered once, ids distinct
    assert kinds.count("dropped") == 60 and kinds.count("malformed") == 30
    # the dropped ones: cancelled, or finished before the hang-up was seen; none failed, none left in flight
    assert http_st["completed"] + http_st["cancelled"] == answered + kinds.count("dropped")
    assert http_st["failed"] == 0 and http_st["in_flight"] == 0
    assert idle["engine"]["pages_in_use"] == 0 and eng["pages_in_use"] == 0 and eng["pages_free"] == eng["num_blocks"]
    assert eng["evictions"] > 0  # requests really crossed K
    assert rss_after <= 1.10 * rss_warm, (rss_warm, rss_after)
    assert not health_bad, health_bad[:3]
    # /metrics of the real engine agrees with /stats
    fams = {f.name: f for f in text_string_to_metric_families(s.get_text("/metrics"))}
    val = {(smp.name, smp.labels.get("outcome")): smp.value for f in fams.values() for smp in f.samples}
    assert val[("epikv_requests_total", "completed")] == http_st["completed"]
    assert val[("epikv_requests_total", "invalid")] == kinds.count("malformed")
    assert val[("epikv_cache_pages_in_use", None)] == 0
    assert val[("epikv_cache_pages_free", None)] == eng["num_blocks"]
    assert val[("epikv_evictions_total", None)] == eng["evictions"]
    assert val[("epikv_time_to_first_token_seconds_count", None)] >= answered
