"""The locust scenario of benchmarks/load_serve.py: a rising request rate against an OpenAI-compatible server.

Each user sends streamed completions (a prompt drawn from a fixed list, greedy, `max_tokens` MAX_TOKENS) paced at
one request per second (`constant_pacing(1)`), so the offered rate is about the number of users while answers take
under a second; the shape adds users stage by stage (STAGES: users, seconds). Every request is written as one JSON
line to $EPIKV_LOCUST_OUT: start time, the stage's users, status, latency, time to first token, tokens.

    locust -f benchmarks/locust_serve.py --headless --host http://127.0.0.1:8000 --only-summary
"""

import json
import os
import threading
import time

from locust import HttpUser, LoadTestShape, constant_pacing, task

MAX_TOKENS = int(os.environ.get("EPIKV_LOCUST_MAX_TOKENS", "32"))
STAGE_S = float(os.environ.get("EPIKV_LOCUST_STAGE_S", "20"))
STAGES = [int(x) for x in os.environ.get("EPIKV_LOCUST_USERS", "1,2,4,8,16").split(",")]
PROMPTS = [f"Problem {i}: " + " ".join(["the sum of the first odd numbers"] * (1 + (i * 5) % 8)) for i in range(16)]
_out = open(os.environ.get("EPIKV_LOCUST_OUT", os.devnull), "a")
_lock = threading.Lock()
_t0 = time.time()


def _stage_users(t: float) -> int:
    return STAGES[min(int(t // STAGE_S), len(STAGES) - 1)]


class Client(HttpUser):
    wait_time = constant_pacing(1)

    @task
    def completion(self):
        i = int(time.time() * 1000) % len(PROMPTS)
        start = time.time()
        users = _stage_users(start - _t0)
        ttft, tokens, status, err = None, 0, None, None
        body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "stream": True}
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name="/v1/completions (stream)") as r:
            status = r.status_code
            if status == 200:
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        err = ev["error"]["message"]
                        break
                    n = len(ev["choices"][0].get("token_ids", [])) if ev.get("choices") else 0
                    if n and ttft is None:
                        ttft = time.time() - start
                    tokens += n
                if err:
                    r.failure(err)
                else:
                    r.success()
            elif status == 429:
                r.failure("429")
        row = {"t": round(start - _t0, 3), "users": users, "status": status, "latency": round(time.time() - start, 4),
               "ttft": None if ttft is None else round(ttft, 4), "tokens": tokens, "error": err}
        with _lock:
            _out.write(json.dumps(row) + "\n")
            _out.flush()


class Rising(LoadTestShape):
    """STAGES users for STAGE_S seconds each, then stop."""

    def tick(self):
        t = self.get_run_time()
        if t >= STAGE_S * len(STAGES):
            return None
        users = _stage_users(t)
        return users, users
