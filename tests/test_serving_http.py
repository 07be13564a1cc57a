"""`epikv serve` over real HTTP with the `openai` client, and `epikv bench serve` end to end.

One server (a random tiny llama, epikv at K=128 with pages of 16, so every answer here is evicted from) is started as
a subprocess on an ephemeral port for the module; each answer must equal the library's own run of the same prompt
(`epikv.serving.run_batch`, greedy, same weights) token for token.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from epikv.stops import cut_at_stop

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module", autouse=True)
def cb_internals():
    """Skip (naming what is missing) only on a transformers outside serving's tested range, whose refusal
    test_serving_versions.py asserts instead."""
    from epikv.serving import ServingUnsupported
    from epikv.serving.checks import check_internals

    try:
        check_internals()
    except ServingUnsupported as e:
        pytest.skip(f"transformers lacks {e.missing}")

SRC = str(Path(__file__).resolve().parents[1] / "src")
MODEL = "random:tiny"
K, PAGE, BLOCKS, MAX_TOK = 128, 16, 256, 90
SERVE = ["--model", MODEL, "--policy", "epikv", "--budget", str(K), "--page", str(PAGE), "--num-blocks", str(BLOCKS),
         "--max-batch-tokens", "64", "--max-tokens", str(MAX_TOK)]


def _env():
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("EPIKV_DEBUG", None)
    return env


def _cli(*argv, timeout=120, pre=""):
    code = pre + "import sys; from epikv.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          env=_env())


class Served:
    def __init__(self, argv):
        self.proc = subprocess.Popen([sys.executable, "-m", "epikv.cli", "serve", *argv, "--port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
        self.err: list[str] = []
        ready = threading.Event()
        self.url = None

        def read():
            for line in self.proc.stderr:
                self.err.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(120)
        assert self.url, "".join(self.err)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def get(self, path):
        return json.loads(self.get_text(path))

    def get_text(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def post_raw(self, path, body):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read().decode()


@pytest.fixture(scope="module")
def served():
    s = Served(SERVE)
    yield s
    s.proc.send_signal(signal.SIGTERM)
    rc = s.proc.wait(30)
    assert rc == 0, "".join(s.err)
    assert "epikv serve: stopped" in "".join(s.err)


@pytest.fixture(scope="module")
def lib():
    """The library's own run: run_batch on the same weights, greedy, same eos and page rule."""
    import torch
    from transformers import GenerationConfig

    from epikv import load_model
    from epikv.engine import eos_ids
    from epikv.serving import ServeSpec, run_batch

    torch.set_num_threads(1)
    lm = load_model(MODEL)
    eos = eos_ids(lm.model, lm.tokenizer)
    gc = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOK, eos_token_id=eos, pad_token_id=eos[0])
    spec = ServeSpec(policy="epikv", budget=K, page=PAGE, num_blocks=BLOCKS, max_batch_tokens=64)
    cache = {}

    def run(prompts: list[list[int]]) -> list[list[int]]:
        todo = [p for p in prompts if tuple(p) not in cache]
        if todo:
            outs, _ = run_batch(lm.model, spec, todo, MAX_TOK, generation_config=gc)
            for p, o in zip(todo, outs):
                cache[tuple(p)] = [t for t in o if t not in eos] if o and o[-1] in eos else o
        return [cache[tuple(p)] for p in prompts]

    run.tok = lm.tokenizer
    return run


def _prompt_ids(tok, text):
    return list(tok(text)["input_ids"])


def _chat_ids(tok, content):
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _texts(n):
    # prompts of different lengths (about 8 to 70 tokens): with 90 new tokens the longer ones cross K=128
    return [f"Problem {i}: " + " ".join(["the sum of the first odd numbers"] * (1 + (i * 5) % 8)) for i in range(n)]


def test_completion_matches_library_streamed_and_not(served, lib):
    text = _texts(4)[3]  # about 60 prompt tokens: with 90 new ones the cache crosses K
    ids = lib([_prompt_ids(lib.tok, text)])[0]
    r = served.client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOK)
    ch = r.choices[0]
    assert ch.model_extra["token_ids"] == ids
    assert ch.text == lib.tok.decode(ids, skip_special_tokens=True)
    assert r.usage.completion_tokens == MAX_TOK and ch.finish_reason == "length"
    parts = list(served.client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOK, stream=True))
    assert [p.choices[0].finish_reason for p in parts][-1] == "length"
    assert all(p.choices[0].finish_reason is None for p in parts[:-1])
    assert "".join(p.choices[0].text for p in parts) == ch.text
    assert sum((p.choices[0].model_extra["token_ids"] for p in parts), []) == ids
    st = served.get("/stats")["engine"]
    assert st["evictions"] > 0 and st["policy"] == "epikv"  # eviction really ran on these answers


def test_chat_matches_library_streamed_and_not(served, lib):
    content = "What is 17 times 23? Think step by step."
    ids = lib([_chat_ids(lib.tok, content)])[0]
    msgs = [{"role": "user", "content": content}]
    r = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOK)
    assert r.choices[0].model_extra["token_ids"] == ids
    assert r.choices[0].message.content == lib.tok.decode(ids, skip_special_tokens=True)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    parts = list(served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOK, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == r.choices[0].message.content
    assert sum((p.choices[0].model_extra["token_ids"] for p in parts), []) == ids
    assert parts[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_the_answer(served, lib):
    text = _texts(2)[1]
    ids = lib([_prompt_ids(lib.tok, text)])[0]
    full = lib.tok.decode(ids, skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 6]
    want = full[:full.index(stop)]
    # the one stop rule (epikv.stops, as the library and `epikv generate --stop`): ids cut with the text
    _, want_ids, _ = cut_at_stop(lambda r: lib.tok.decode(r, skip_special_tokens=True), ids, [stop])
    assert len(want_ids) < len(ids)
    r = served.client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOK, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert r.choices[0].model_extra["token_ids"] == want_ids
    parts = list(served.client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOK, stop=stop,
                                                  stream=True))
    assert "".join(p.choices[0].text for p in parts) == want and parts[-1].choices[0].finish_reason == "stop"
    assert sum((p.choices[0].model_extra["token_ids"] for p in parts), []) == want_ids
    assert served.get("/stats")["http"]["in_flight"] == 0


def test_sse_wire_format(served):
    raw = served.post_raw("/v1/completions", {"prompt": "Hello world", "max_tokens": 5, "stream": True})
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and raw.endswith("\n\n")
    body = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert sum(len(b["choices"][0]["token_ids"]) for b in body) == 5
    assert body[-1]["choices"][0]["finish_reason"] == "length"


def test_twenty_concurrent_none_lost_none_duplicated(served, lib):
    texts = _texts(20)
    want = lib([_prompt_ids(lib.tok, t) for t in texts])
    before = served.get("/stats")["http"]

    def ask(i):
        if i % 2:  # half streamed, half not
            parts = list(served.client.completions.create(model=MODEL, prompt=texts[i], max_tokens=MAX_TOK,
                                                          stream=True))
            return i, parts[0].id, sum((p.choices[0].model_extra["token_ids"] for p in parts), [])
        r = served.client.completions.create(model=MODEL, prompt=texts[i], max_tokens=MAX_TOK)
        return i, r.id, r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(20) as ex:
        got = list(ex.map(ask, range(20)))
    assert len(got) == 20 and len({g[1] for g in got}) == 20  # none lost, ids distinct
    for i, _, ids in got:
        assert ids == want[i], f"request {i} differs from the library's run"
    after = served.get("/stats")
    assert after["http"]["completed"] - before["completed"] == 20 and after["http"]["in_flight"] == 0
    assert after["http"]["max_in_flight"] >= 10  # they really were concurrent
    assert after["engine"]["max_in_flight"] > 1


def test_models_health_stats(served):
    assert served.get("/health") == {"status": "ok"}
    m = served.get("/v1/models")
    assert [d["id"] for d in m["data"]] == [MODEL]
    assert [x.id for x in served.client.models.list().data] == [MODEL]
    st = served.get("/stats")
    assert st["server"]["budget"] == K and st["server"]["num_blocks"] == BLOCKS
    assert {"peak_pages", "pages_in_use", "pages_freed", "evictions", "max_in_flight", "preemptions"} <= set(st["engine"])
    # the KV bytes of its pages (bench serve compares engines at equal bytes): every layer's K and V, float32
    from epikv.models import PRESETS

    c = PRESETS["tiny"]
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"]) * 4
    assert st["engine"]["kv_bytes"] == BLOCKS * PAGE * per_token


@pytest.mark.parametrize("body, says", [
    ({"prompt": "hi", "temperature": -0.5}, "temperature must be"),
    ({"prompt": "hi", "temperature": 0.7, "seed": -1}, "seed must be"),
    ({"prompt": "hi", "temperature": 0.7, "top_k": 1.5}, "top_k must be"),
    ({"prompt": "hi", "n": 2}, "n must be 1"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "logit_bias": {}}, "unsupported field"),
    ({"prompt": "hi", "model": "gpt-4"}, "serves model"),
    ({"prompt": ""}, "empty"),
    ({"prompt": "hi", "max_tokens": 9000}, "positions"),
])
def test_bad_requests_answered_400(served, body, says):
    with pytest.raises(openai.BadRequestError) as e:
        extra = {k: body[k] for k in ("top_k", "min_p") if k in body}  # not in the client's signature
        served.client.completions.create(**{"model": MODEL, **{k: v for k, v in body.items() if k not in extra}},
                                         extra_body=extra or None)
    assert says in str(e.value)


def test_prompt_over_the_budget_is_served_evicted_inside(served, lib):
    """A multi-turn chat whose prompt alone is over K = 128 (and 94 prompt tokens, whose pages of 16 with the
    recency window's do not fit K) used to get a 400; now each is answered, its prompt evicted inside as
    `--no-protect-prompt` does, token for token the library's own run (mutant: Policy.for_prompt returning self
    gives the 400 again)."""
    msgs = [{"role": "system", "content": "You answer questions about numbers briefly."}]
    for i in range(4):
        msgs += [{"role": "user", "content": f"What is the sum of the first {i + 3} odd numbers? Show the sum."},
                 {"role": "assistant", "content": f"It is {(i + 3) ** 2}: " + " + ".join(
                     str(2 * j + 1) for j in range(i + 3)) + "."}]
    msgs.append({"role": "user", "content": "And of the first ten?"})
    text = lib.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = list(lib.tok(text, add_special_tokens=False)["input_ids"])
    assert len(ids) > K
    before = served.get("/stats")["engine"]["prompts_evicted"]
    r = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20)
    assert r.choices[0].model_extra["token_ids"] == lib([ids])[0][:20]
    r = served.client.completions.create(model=MODEL, prompt=[100] * 94, max_tokens=20)
    assert r.choices[0].model_extra["token_ids"] == lib([[100] * 94])[0][:20]
    assert served.get("/stats")["engine"]["prompts_evicted"] == before + 2


def test_sampled_requests_reproducible_by_seed(served):
    """temperature 0.6, top-p 0.95 (DeepSeek's advice for R1): the same seed gives the same answer alone and among
    eight concurrent others, streamed or not; other seeds give other answers."""
    text = _texts(3)[2]
    kw = dict(model=MODEL, prompt=text, max_tokens=40, temperature=0.6, top_p=0.95)
    alone = served.client.completions.create(seed=11, **kw).choices[0]

    def ask(i):
        if i == 4:
            parts = list(served.client.completions.create(seed=11, stream=True, **kw))
            return "".join(p.choices[0].text for p in parts)
        other = dict(kw, prompt=_texts(9)[i], max_tokens=20 + 5 * i)
        return served.client.completions.create(seed=100 + i, **other).choices[0].text

    with ThreadPoolExecutor(9) as ex:
        got = list(ex.map(ask, range(9)))
    assert got[4] == alone.text and alone.model_extra["token_ids"]
    others = {served.client.completions.create(seed=s, **kw).choices[0].text for s in (12, 13, 14)}
    assert alone.text not in others and len(others) > 1
    greedy = served.client.completions.create(**dict(kw, temperature=0)).choices[0].text
    assert greedy != alone.text


def test_greedy_fields_accepted(served, lib):
    text = _texts(1)[0]
    ids = lib([_prompt_ids(lib.tok, text)])[0]
    r = served.client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_TOK, temperature=0, top_p=0.5,
                                         seed=7)
    assert r.choices[0].model_extra["token_ids"] == ids


def _one_line_exit_2(r):
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_refusals_exit_2_one_line():
    base = ["serve", "--model", MODEL, "--page", "16", "--num-blocks", "64"]
    block = ("import sys\nclass _NoFastAPI:\n    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] == 'fastapi': raise ImportError(name)\n"
             "sys.meta_path.insert(0, _NoFastAPI())\n")
    with socket.socket() as busy:  # a port in use
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        cases = [
            ((*base, "--policy", "nope", "--port", "0"), "", "unknown policy"),
            # a setting check_serving refuses: the policy's page must be the cache's page
            ((*base, "--policy", "epikv", "--set", "epikv.page=8", "--port", "0"), "", "page"),
            (("serve", "--model", MODEL, "--port", "0"), "", "num-blocks"),
            ((*base, "--port", "70000"), "", "port"),
            ((*base, "--port", str(busy.getsockname()[1])), "", "cannot listen on 127.0.0.1"),
            ((*base, "--port", "0"), block, "pip install 'epikv[serve]'"),  # fastapi missing: the extra is named
            ((*base, "--drain-timeout", "-1"), "", "drain-timeout"),
            ((*base, "--max-waiting", "0"), "", "max-waiting"),
            ((*base, "--reasoning-parser", "nope"), "", "reasoning-parser"),
        ]
        with ThreadPoolExecutor(3) as ex:  # each is a fresh interpreter: run a few at once
            runs = list(ex.map(lambda c: _cli(*c[0], pre=c[1]), cases))
    for (argv, _, says), r in zip(cases, runs):
        assert says in _one_line_exit_2(r), (argv, r.stderr)


def test_bench_serve_end_to_end(tmp_path):
    out = tmp_path / "b"
    r = _cli("bench", "serve", "--model", MODEL, "--policies", "full,epikv", "--budgets", "128", "--page", "16",
             "--num-blocks", "40", "--requests", "3", "--concurrency", "3", "--max-tokens", "16",
             "--max-prompt-tokens", "60", "--timeout", "120", "--out", str(out), timeout=200)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [x["label"] for x in rows] == ["full", "epikv K=128"]
    for x in rows:
        assert x["completed"] == 3 and x["complete_length"] == 3 and x["generated_tokens"] == 3 * 16
        assert x["max_in_flight"] >= 1 and x["peak_pages"] >= 1 and x["tokens_per_s"] > 0
    assert (out / "serve.png").stat().st_size > 0 and "| epikv K=128 | 3/3 |" in (out / "table.md").read_text()
    # a second run reuses both rows instead of serving again
    r2 = _cli("bench", "serve", "--model", MODEL, "--policies", "full,epikv", "--budgets", "128", "--page", "16",
              "--num-blocks", "40", "--requests", "3", "--concurrency", "3", "--max-tokens", "16",
              "--max-prompt-tokens", "60", "--timeout", "120", "--out", str(out), timeout=200)
    assert r2.returncode == 0 and r2.stderr.count("reusing the finished row") == 2, r2.stderr
    # sampled (temperature 0.6, top-p 0.95, a seed per request): new rows beside the greedy ones, not reused
    r3 = _cli("bench", "serve", "--model", MODEL, "--policies", "full,epikv", "--budgets", "128", "--page", "16",
              "--num-blocks", "40", "--requests", "3", "--concurrency", "3", "--max-tokens", "16",
              "--max-prompt-tokens", "60", "--timeout", "120", "--temperature", "0.6", "--top-p", "0.95",
              "--out", str(out), timeout=200)
    assert r3.returncode == 0 and "reusing" not in r3.stderr, r3.stderr
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [x["settings"].get("sampling") for x in rows] == [None, None] + [
        {"temperature": 0.6, "top_p": 0.95, "seed": 0}] * 2
    assert "sampled (temperature 0.6, top-p 0.95, seed 0 + i)" in (out / "table.md").read_text()


def test_bench_summary_counts_cut_requests():
    from epikv.bench.serve import Row, percentile, summarize

    recs = [{"latency_s": 2.0, "ttft_s": 0.5, "tokens": 8, "finish": "length"},
            {"latency_s": 4.0, "ttft_s": 0.7, "tokens": 8, "finish": "length"},
            {"unfinished": True, "tokens": 3}, {"error": "APIError: boom"}]
    stats = {"engine": {"max_in_flight": 2, "steps": 10, "peak_pages": 5}, "http": {"max_in_flight": 3}}
    s = summarize(Row("epikv", 64), {"records": recs, "wall_s": 2.0, "timed_out": 1}, stats, 4, 4, 8)
    assert (s["completed"], s["unfinished"], s["failed"]) == (2, 1, 1)
    assert s["generated_tokens"] == 19 and s["tokens_per_s"] == 9.5  # the cut request's 3 tokens count
    assert s["latency_p50_s"] == 3.0 and s["ms_per_step"] == 200.0 and s["label"] == "epikv K=64"
    assert percentile([1, 2, 3, 4], 0.95) == pytest.approx(3.85) and percentile([], 0.5) is None


def test_bench_table_in_flight_when_the_cache_was_full():
    """The 'in flight, cache full' cell and ratio: a mean over the cache-bound forwards, 'never full' (a lower bound,
    all requests) when there were none, '-' for a row recorded before the measure; an equal-batch part alone prints
    without the serve table."""
    from epikv.bench.serve import table

    base = dict(completed=4, requests=4, in_flight_p50=2, tokens_per_s=10.0, latency_p50_s=1, latency_p95_s=2,
                ttft_p50_s=0.1, peak_pages=9, num_blocks=9, preemptions=0, evictions=0, generated_tokens=40, steps=10)
    full = dict(base, label="full", policy="full", max_in_flight=4, in_flight_mean=2.0, in_flight_cache_full_mean=2.5,
                cache_full_steps=7)
    k = dict(base, label="epikv K=64", policy="epikv", max_in_flight=8, in_flight_mean=7.0,
             in_flight_cache_full_mean=None, cache_full_steps=0)
    k2 = dict(k, label="epikv K=96", in_flight_cache_full_mean=5.0, cache_full_steps=3)
    old = {x: y for x, y in k.items() if x not in ("in_flight_cache_full_mean", "cache_full_steps")}
    text = table([full, k, k2, dict(old, label="old")], [])
    assert "| full | 4/4 | 4 / 2.0 / 2 | 2.5 (7 fwd) |" in text
    assert "| epikv K=64 | 4/4 | 8 / 7.0 / 2 | never full (>= 8) |" in text
    assert "| old | 4/4 | 8 / 7.0 / 2 | - |" in text
    assert ">= 3.20x full's in flight when its cache was full" in text  # 8 / 2.5
    assert "; 2.00x full's in flight when the cache was full" in text  # 5.0 / 2.5
    eq = [{"engine": "continuous batching", "label": "full", "batch": 2, "tokens_per_s": 10.0, "ms_per_step": 100.0},
          {"engine": "continuous batching", "label": "epikv K=64", "batch": 2, "tokens_per_s": 8.0,
           "ms_per_step": 125.0}]
    alone = table([], eq)
    assert alone.startswith("Equal batch") and "| policy | completed" not in alone
    assert "epikv K=64: per-step time 1.25x the engine's full at batch 2" in alone


def test_serve_equal_batch_script(tmp_path):
    """benchmarks/serve_equal_batch.py (the GPU per-step comparison at a preset's shape) runs end to end on CPU."""
    out = tmp_path / "eq.jsonl"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_equal_batch.py"
    r = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
                        "--batch", "2", "--prompt", "16", "--new", "96", "--budgets", "64", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["label"] for x in recs] == ["full", "epikv K=64", "full (generate)"]
    assert all(x["tokens"] == 2 * 96 and x["preset"] == "tiny" for x in recs)
    assert "| continuous batching | epikv K=64 | 2 |" in r.stdout
    # a budget the engine refuses: one line, exit 2, before any row has run (nothing appended)
    bad = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
                          "--batch", "2", "--prompt", "16", "--new", "8", "--budgets", "64,48", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [x for x in bad.stderr.splitlines() if x.strip() and "Skipping" not in x]
    assert bad.returncode == 2 and len(lines) == 1 and "budget 48 is under 4 pages" in lines[0], bad.stderr
    assert "equal batch" not in bad.stdout and len(out.read_text().splitlines()) == len(recs)


def test_bench_percentiles_count_cut_requests_with_their_time_so_far():
    """A request cut by the timeout counts in the latency / TTFT percentiles with its time so far and makes the
    percentile it reaches a lower bound ('>=' in the table); rows are also compared over the same window."""
    from epikv.bench.serve import Row, censored_percentile, summarize, table

    fin = [{"latency_s": float(x), "ttft_s": 0.5, "tokens": 8, "finish": "length"} for x in (1, 2, 3)]
    cut = [{"unfinished": True, "censored": True, "tokens": 2, "latency_s": 9.0, "ttft_s": 4.0,
            "ttft_censored": False},
           {"unfinished": True, "censored": True, "tokens": 0, "latency_s": 9.0, "ttft_s": 9.0, "ttft_censored": True}]
    stats = {"engine": {"max_in_flight": 2, "steps": 10, "kv_bytes": 2**20}}
    s = summarize(Row("full", None), {"records": fin + cut, "wall_s": 9.0, "timed_out": 2,
                                      "tokens_by_second": [4, 4, 8, 8, 2]}, stats, 5, 5, 8)
    # over all five (1, 2, 3, 9, 9), not the three that finished (whose median would be 2)
    assert s["latency_p50_s"] == 3.0 and s["latency_p95_s"] == 9.0 and s["censored"] == 2
    assert s["lower_bound"] == {"latency_p50": False, "latency_p95": True, "ttft_p50": False, "ttft_p95": True}
    assert censored_percentile([(1.0, False), (5.0, True)], 0.5) == (3.0, True)
    assert censored_percentile([(1.0, False), (2.0, False), (5.0, True)], 0.5) == (2.0, False)
    other = dict(s, label="epikv K=64", policy="epikv", wall_s=3.5, tokens_by_second=[6, 6, 6, 6], lower_bound={})
    text = table([s, other], [])
    assert "tokens/s, first 3 s |" in text
    assert "| >= 9.0 |" not in text and "3.0 / >= 9.0 |" in text
    assert "| 5.33 |" in text and "| 6.0 |" in text  # (4 + 4 + 8) / 3 and 18 / 3 over the same 3 s
    assert "KV MiB" in text and "| 1.0 |" in text and "equal for every row" in text


def test_client_leaving_mid_stream_frees_its_pages(served):
    """A client that hangs up mid-stream: its request is cancelled in the engine and its pages return at once (it
    asked for 8,000 tokens, minutes of work on this engine), the server's counters say cancelled, and the next
    request is answered."""
    import http.client

    before = served.get("/stats")
    host = served.url.split("//")[1]
    c = http.client.HTTPConnection(host, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps({
        "model": MODEL, "prompt": "A long answer", "max_tokens": 8000, "stream": True, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    try:
        for _ in range(3):  # three events: the request runs and holds pages
            assert r.readline().startswith(b"data: ")
            r.readline()
        st = served.get("/stats")
    finally:
        c.close()
    assert st["http"]["in_flight"] == 1 and st["engine"]["pages_in_use"] > 0
    end = time.monotonic() + 20
    while time.monotonic() < end:
        st = served.get("/stats")
        if not st["http"]["in_flight"] and not st["engine"]["pages_in_use"]:
            break
        time.sleep(0.1)
    assert st["http"]["in_flight"] == 0 and st["engine"]["pages_in_use"] == 0, st
    assert st["http"]["cancelled"] == before["http"]["cancelled"] + 1
    assert st["http"]["completion_tokens"] == before["http"]["completion_tokens"]  # not counted as an answer
    assert served.client.completions.create(model=MODEL, prompt="next", max_tokens=4).choices[0].finish_reason


def test_client_leaving_a_whole_request_frees_its_pages(served):
    """Issue 55: a non-streamed request whose client hangs up is cancelled (nothing is sent before its answer, so
    the app watches for the disconnect) and its pages return within a second, not after its 8,000 tokens.
    Mutant: serving/app.py's _whole awaiting the answer alone (no _client_left): the pages stay held."""
    import socket

    before = served.get("/stats")
    host, port = served.url.split("//")[1].split(":")
    body = json.dumps({"model": MODEL, "prompt": "A long answer", "max_tokens": 8000, "ignore_eos": True}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    end = time.monotonic() + 30
    st = served.get("/stats")
    while not (st["engine"]["pages_in_use"] > 0 and st["http"]["running"] == 1) and time.monotonic() < end:
        time.sleep(0.05)
        st = served.get("/stats")
    assert st["http"]["in_flight"] == 1 and st["engine"]["pages_in_use"] > 0, st
    s.close()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        st = served.get("/stats")
        if not st["http"]["in_flight"] and not st["engine"]["pages_in_use"]:
            break
        time.sleep(0.05)
    assert st["http"]["in_flight"] == 0 and st["engine"]["pages_in_use"] == 0, st
    assert st["http"]["cancelled"] == before["http"]["cancelled"] + 1
