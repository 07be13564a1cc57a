"""The HTTP layer of `epikv serve` on a scripted engine behind the same Backend interface (serving/backend.py): the
reasoning parser (whole and streamed, tags split across chunks), 429 past --max-waiting with Retry-After, the
per-request timeout, and /metrics read back with prometheus_client's own parser. A real `openai` client throughout;
127.0.0.1 only."""

import json
import queue
import socket
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from epikv.serving.backend import Backend, Output  # noqa: E402
from epikv.serving.reasoning import ReasoningSplit  # noqa: E402

ANSWER = "<think>Let me add 2 and 2: that is 4.</think>\n\nThe answer is 4."


class Scripted(Backend):
    """Answers every request with the tokens of one text, one output per token; `gate` holds all of them back
    until set (requests then wait for their first token); `finish` False: they never end."""

    sampling_fields = frozenset({"temperature", "top_p", "seed"})
    per_request_eos = True

    def __init__(self, tok, text=ANSWER, eos=None, finish=True):
        self.tokens = list(tok(text, add_special_tokens=False)["input_ids"]) + ([eos] if eos is not None else [])
        self.out: queue.Queue = queue.Queue()
        self.gate = threading.Event()
        self.gate.set()
        self.finish = finish
        self.cancelled, self.released, self.submitted = set(), [], []

    def submit(self, rid, input_ids, max_tokens, *, sampling, seed, ignore_eos):
        self.submitted.append((rid, sampling, seed))
        toks = self.tokens[:max_tokens]

        def run():
            self.gate.wait()
            for i in range(len(toks) if self.finish else 10**9):
                if rid in self.cancelled:
                    return
                self.out.put(Output(rid, toks[:i + 1] if self.finish else toks[:1] * (i + 1),
                                    self.finish and i == len(toks) - 1))
                time.sleep(0.002)

        threading.Thread(target=run, daemon=True).start()

    def next_output(self, timeout):
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self, rid, completed=False):
        self.cancelled.add(rid)

    def release(self, rid):
        self.released.append(rid)

    def healthy(self):
        return True

    def prompt_refusal(self, n_prompt):
        return None

    def stats(self):
        return {"engine": "scripted"}

    def gauges(self):
        return {"pages_in_use": 3, "pages_free": 61, "evictions": 7, "evicted_tokens": 112, "preemptions": 1}

    def stop(self):
        pass


class App:
    """build_app over a Server on `backend`, run by uvicorn in a thread on 127.0.0.1."""

    def __init__(self, backend, tok, **kw):
        import uvicorn

        from epikv.commands.serve import _QuietServer
        from epikv.serving.app import Server, build_app

        self.server = Server(backend, tok, model_name="scripted", eos=[tok.eos_token_id], **kw)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        self.uv = _QuietServer(uvicorn.Config(build_app(self.server), log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        end = time.monotonic() + 30
        while not self.uv.started and time.monotonic() < end:
            time.sleep(0.01)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=30)

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def close(self):
        self.uv.should_exit = True
        self.thread.join(10)
        self.server.close()


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny.tokenizer


def _app(request, tok, backend=None, **kw):
    app = App(backend or Scripted(tok, eos=tok.eos_token_id), tok, **kw)
    request.addfinalizer(app.close)
    return app


MSGS = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize("text", [ANSWER, "<think>\nplain</think>answer", "no tags at all", "<thi", "a</thi"])
def test_reasoning_split_every_chunking(text):
    """Fed in two chunks cut anywhere (a tag split across them too), the streamed parts add up to the whole split,
    and no part ever holds a piece of a tag."""
    whole = ReasoningSplit().split(text, final=True)
    for cut in range(len(text) + 1):
        s = ReasoningSplit()
        parts = [s.step(text[:cut], final=False), s.step(text, final=True)]
        r = "".join(p[0] for p in parts)
        c = "".join(p[1] for p in parts)
        assert (r, c) == whole, cut
        first = parts[0][0] + parts[0][1]  # sent before the text was complete: never the start of a tag
        assert not any(first.endswith("</think>"[:k]) for k in range(2, 9)), (cut, parts)
    if "</think>" in text:
        assert whole[0].strip() and "think>" not in whole[0] + whole[1]


def test_reasoning_content_whole_and_streamed(request, tok):
    app = _app(request, tok, reasoning_parser="deepseek-r1")
    pieces = [tok.decode([t]) for t in tok("</think>", add_special_tokens=False)["input_ids"]]
    assert len(pieces) > 1  # one token per chunk: the closing tag really is split across chunks
    r = app.client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=100)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Let me add 2 and 2: that is 4."
    assert msg.content == "The answer is 4." and r.choices[0].finish_reason == "stop"
    parts = list(app.client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=100, stream=True))
    deltas = [p.choices[0].delta for p in parts]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("Let me add 2 and 2: that is 4.", "The answer is 4.")
    assert sum(1 for d in deltas if (d.model_extra or {}).get("reasoning_content")) > 3  # streamed, not at the end
    # a completion (no chat) and a server without the parser keep the raw text
    plain = _app(request, tok)
    assert plain.client.chat.completions.create(model="scripted", messages=MSGS).choices[0].message.content == ANSWER
    assert app.client.completions.create(model="scripted", prompt="x").choices[0].text == ANSWER


def test_429_past_max_waiting_with_retry_after(request, tok):
    backend = Scripted(tok, eos=tok.eos_token_id)
    app = _app(request, tok, backend=backend, max_waiting=2)
    backend.gate.clear()  # nothing gets a token: every admitted request waits
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        waiting = [ex.submit(app.client.completions.create, model="scripted", prompt="x") for _ in range(2)]
        end = time.monotonic() + 10
        while app.server.waiting() < 2 and time.monotonic() < end:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            app.client.completions.create(model="scripted", prompt="x")
        assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
        assert "--max-waiting" in str(e.value)
        backend.gate.set()
        assert [w.result().choices[0].text for w in waiting] == [ANSWER] * 2  # the waiting ones are served
    assert app.client.completions.create(model="scripted", prompt="x").choices[0].text == ANSWER  # room again
    st = json.loads(app.get("/stats"))["http"]
    assert st["rejected"] == 1 and st["completed"] == 3 and st["waiting"] == 0


def test_request_timeout(request, tok):
    backend = Scripted(tok, finish=False)
    app = _app(request, tok, backend=backend, request_timeout=0.5)
    with pytest.raises(openai.APIStatusError) as e:
        app.client.completions.create(model="scripted", prompt="x", max_tokens=5)
    assert e.value.status_code == 504 and "timed out after 0.5 s" in str(e.value)
    raw = urllib.request.urlopen(urllib.request.Request(
        app.url + "/v1/completions", data=json.dumps({"prompt": "x", "stream": True}).encode(),
        headers={"Content-Type": "application/json"}), timeout=30).read().decode()
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert "timed out" in events[-2] and events[-1] == "data: [DONE]"
    assert len(backend.cancelled) == 2  # the engine was told to stop both
    st = json.loads(app.get("/stats"))["http"]
    assert st["timeout"] == 2 and st["in_flight"] == 0


def test_metrics_parsed_by_prometheus_client(request, tok):
    from prometheus_client.parser import text_string_to_metric_families

    app = _app(request, tok)
    n_tokens = len(Scripted(tok, eos=tok.eos_token_id).tokens)
    for stream in (False, True, False):
        list(app.client.completions.create(model="scripted", prompt="hello there", stream=stream) if stream else [
            app.client.completions.create(model="scripted", prompt="hello there")])
    with pytest.raises(openai.BadRequestError):
        app.client.completions.create(model="scripted", prompt="")
    fams = {f.name: f for f in text_string_to_metric_families(app.get("/metrics"))}

    def value(name, suffix="", **labels):
        for s in fams[name].samples:
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        raise KeyError(name + suffix)

    assert value("epikv_requests", "_total", outcome="completed") == 3
    assert value("epikv_requests", "_total", outcome="invalid") == 1
    assert value("epikv_requests", "_total", outcome="rejected") == 0
    n_prompt = len(tok("hello there")["input_ids"])
    assert value("epikv_prompt_tokens", "_total") == 3 * n_prompt
    assert value("epikv_generation_tokens", "_total") == 3 * n_tokens
    assert value("epikv_time_to_first_token_seconds", "_count") == 3
    assert value("epikv_inter_token_latency_seconds", "_count") == 3 * (n_tokens - 1)
    assert value("epikv_request_latency_seconds", "_count") == 3
    assert 0 < value("epikv_inter_token_latency_seconds", "_sum") / (3 * (n_tokens - 1)) < 1
    assert value("epikv_requests_waiting") == 0 and value("epikv_requests_running") == 0
    assert value("epikv_cache_pages_in_use") == 3 and value("epikv_cache_pages_free") == 61
    assert value("epikv_evictions", "_total") == 7 and value("epikv_preemptions", "_total") == 1
    assert value("epikv_evicted_tokens", "_total") == 112


def test_bench_drive_samples_each_request_with_its_seed(request, tok):
    """bench serve's load generator: with sampling, request i carries temperature, top_p and seed + i."""
    import asyncio

    from epikv.bench.serve import drive

    backend = Scripted(tok, eos=tok.eos_token_id)
    app = _app(request, tok, backend=backend)
    res = asyncio.run(drive(app.url, "scripted", [MSGS] * 3, 2, 5, 30, ignore_eos=False,
                            sampling={"temperature": 0.6, "top_p": 0.95, "seed": 3}))
    assert all(r["tokens"] == 5 for r in res["records"])
    assert sorted(seed for _, _, seed in backend.submitted) == [3, 4, 5]
    assert {(s.temperature, s.top_p, s.draw) for _, s, _ in backend.submitted} == {(0.6, 0.95, "gumbel")}
    asyncio.run(drive(app.url, "scripted", [MSGS], 1, 5, 30, ignore_eos=False))
    assert backend.submitted[-1][1] is None  # greedy


def test_chat_content_as_a_list_of_text_parts(request, tok):
    """OpenAI's content parts: text parts are joined in order (newline, as vLLM joins them) into the same prompt a
    string gives, on any engine (the app builds the prompt); any other part type is refused by name with a 400."""
    class Recording(Scripted):
        def submit(self, rid, input_ids, max_tokens, **kw):
            self.ids = list(input_ids)
            super().submit(rid, input_ids, max_tokens, **kw)

    be = Recording(tok, eos=tok.eos_token_id)
    app = _app(request, tok, backend=be)
    sys_msg = {"role": "system", "content": "Be brief."}
    app.client.chat.completions.create(model="scripted", messages=[sys_msg, {
        "role": "user", "content": "What is 2 + 2?\nAnswer in words."}])
    want = be.ids
    parts = [{"type": "text", "text": "What is 2 + 2?"}, {"type": "text", "text": "Answer in words."}]
    r = app.client.chat.completions.create(model="scripted", messages=[sys_msg, {"role": "user", "content": parts}])
    assert be.ids == want and r.choices[0].message.content
    app.client.chat.completions.create(model="scripted", messages=[sys_msg, {"role": "user", "content": parts[::-1]}])
    assert be.ids != want  # in order
    for bad, needle in [([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                         "messages[1].content[0]: part type 'image_url' is not supported"),
                        ([parts[0], {"type": "input_audio", "input_audio": {}}], "part type 'input_audio'"),
                        ([{"type": "text", "text": 3}], "messages[1].content[0] must be {type: text"),
                        ([], "messages[1].content is an empty list of parts")]:
        with pytest.raises(openai.BadRequestError) as e:
            app.client.chat.completions.create(model="scripted", messages=[sys_msg, {"role": "user", "content": bad}])
        assert e.value.status_code == 400 and needle in e.value.message and "\n" not in e.value.message, \
            e.value.message


def test_metrics_of_several_replicas_merge_with_a_replica_label():
    """`serve --ray`'s /metrics: every replica's series in one exposition, each sample labelled with its replica,
    values untouched (a sum over replicas gives the deployment's totals); a replica's unparsable text is left out."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from epikv.serving.metrics import merge_replicas

    def text(done, seconds):
        reg = CollectorRegistry()
        Counter("epikv_requests", "Requests by outcome", ["outcome"], registry=reg).labels("completed").inc(done)
        h = Histogram("epikv_request_latency_seconds", "latency", buckets=(1.0, 5.0), registry=reg)
        for s in seconds:
            h.observe(s)
        return generate_latest(reg).decode()

    out = merge_replicas({"r1": text(2, [0.5]), "r2": text(5, [2.0, 7.0]), "broken": "epikv_x{ 1"}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(out)}
    done = {s.labels["replica"]: s.value for s in fams["epikv_requests"].samples if s.name == "epikv_requests_total"}
    assert done == {"r1": 2.0, "r2": 5.0}
    assert all(s.labels["outcome"] == "completed" for s in fams["epikv_requests"].samples)
    lat = fams["epikv_request_latency_seconds"]
    count = {s.labels["replica"]: s.value for s in lat.samples if s.name.endswith("_count")}
    le5 = {s.labels["replica"]: s.value for s in lat.samples if s.name.endswith("_bucket") and s.labels["le"] == "5.0"}
    assert count == {"r1": 1.0, "r2": 2.0} and le5 == {"r1": 1.0, "r2": 1.0}
    assert lat.type == "histogram" and "broken" not in out
