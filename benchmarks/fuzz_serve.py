"""Fuzz `epikv serve` with schemathesis from its own /openapi.json (tests/test_serving_fuzz.py runs a bounded number
of examples per route; this script the longer run).

For every route of the document, schemathesis draws requests that follow the schema (positive) and requests that
break it (negative: wrong types, values out of range, missing and unknown fields), sends each to the running server
with a client timeout of the server's --request-timeout plus a margin, and checks each answer: no 5xx, a status and a
content type the document lists, a body that validates against the response model, and every schema-breaking
request refused with a 4xx. After the run: nothing in flight, no cells / pages held once idle, /health ok.

    python benchmarks/fuzz_serve.py --engine torch --examples 300 --out benchmarks/results/serve/fuzz/torch.json
    python benchmarks/fuzz_serve.py --engine llama.cpp --examples 300 --out benchmarks/results/serve/fuzz/llamacpp.json

(--url http://host:port fuzzes a server already running instead of starting one.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT = 10.0  # the server's --request-timeout: no answer may take longer than this plus MARGIN
MARGIN = 15.0

# each engine at a small size, with a request timeout; random:tiny (torch) and the embedded SmolLM2 (llama.cpp)
ENGINES = {
    "torch": ["--model", "random:tiny", "--policy", "epikv", "--budget", "64", "--page", "8", "--num-blocks", "128",
              "--max-batch-tokens", "64", "--max-tokens", "16"],
    "llama.cpp": ["--engine", "llama.cpp", "--sequences", "4", "--budget", "64", "--threads", "1",
                  "--max-batch-tokens", "64", "--max-tokens", "16"],
}


class Server:
    """`epikv serve` as a subprocess on an ephemeral port of 127.0.0.1."""

    def __init__(self, argv: list[str]):
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-m", "epikv.cli", "serve", *argv, "--port", "0",
                                      "--request-timeout", str(REQUEST_TIMEOUT)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.err: list[str] = []
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.err.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(180)
        if not self.url:
            self.proc.kill()
            raise RuntimeError("epikv serve did not start:\n" + "".join(self.err))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read().decode())


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """/stats once nothing is in flight and the engine holds no pages / cells (or after `timeout` s)."""
    end = time.monotonic() + timeout
    while True:
        st = get(url, "/stats")
        held = st["engine"].get("pages_in_use", st["engine"].get("cells_in_use"))
        if (not st["http"]["in_flight"] and not held) or time.monotonic() > end:
            return st


def fuzz(url: str, examples: int, seed: int = 0) -> dict:
    """Run schemathesis on every route of url/openapi.json, `examples` positive and `examples` negative cases
    each. Returns {"cases": n, "statuses": {route: {status: n}}, "failures": [...], "slowest_s": s}."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                    response_schema_conformance, status_code_conformance)

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]
    statuses: dict[str, Counter] = {}
    failures: list[dict] = []
    slowest = 0.0
    n = 0
    for result in schema.get_all_operations():
        op = result.ok()
        route = f"{op.method.upper()} {op.path}"
        statuses[route] = Counter()
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.lower() == "post" else [])
        for mode in modes:
            @hseed(seed)
            @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), print_blob=False)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal slowest, n
                t0 = time.monotonic()
                try:
                    resp = case.call(base_url=url, timeout=REQUEST_TIMEOUT + MARGIN)
                except Exception as e:  # noqa: BLE001 (a timeout or a dropped connection is a finding)
                    failures.append({"route": route, "mode": mode.value, "body": _body(case),
                                     "error": f"{type(e).__name__}: {e}"[:500]})
                    return
                took = time.monotonic() - t0
                slowest = max(slowest, took)
                n += 1
                statuses[route][resp.status_code] += 1
                try:
                    case.validate_response(resp, checks=checks)
                except Exception as e:  # noqa: BLE001 (schemathesis raises a group of failed checks)
                    failures.append({"route": route, "mode": mode.value, "status": resp.status_code,
                                     "body": _body(case), "response": resp.text[:300], "error": str(e)[:800]})

            run()
    return {"cases": n, "statuses": {r: dict(sorted(c.items())) for r, c in statuses.items()},
            "failures": failures, "slowest_s": round(slowest, 2)}


def _body(case) -> str:
    try:
        return json.dumps(case.body)[:300]
    except (TypeError, ValueError):
        return repr(case.body)[:300]


def fuzz_server(url: str, examples: int, seed: int = 0) -> dict:
    """fuzz() then the state once idle and /health."""
    t0 = time.monotonic()
    out = fuzz(url, examples, seed)
    out["seconds"] = round(time.monotonic() - t0, 1)
    st = wait_idle(url)
    eng = st["engine"]
    out["idle"] = {"in_flight": st["http"]["in_flight"], "held": eng.get("pages_in_use", eng.get("cells_in_use")),
                   "completed": st["http"]["completed"], "timeout": st["http"]["timeout"],
                   "failed": st["http"]["failed"], "cancelled": st["http"]["cancelled"]}
    out["health"] = get(url, "/health")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=sorted(ENGINES), default="torch")
    ap.add_argument("--examples", type=int, default=300, help="examples per route and mode (default 300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default=None, help="fuzz this running server instead of starting one")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    args = ap.parse_args(argv)
    server = None if args.url else Server(ENGINES[args.engine])
    url = args.url or server.url
    try:
        out = fuzz_server(url, args.examples, args.seed)
    finally:
        rc = server.stop() if server else None
    out.update(engine=args.engine, examples=args.examples, seed=args.seed, server_exit=rc,
               command="python " + " ".join(["benchmarks/fuzz_serve.py", *(argv or sys.argv[1:])]),
               argv=ENGINES[args.engine] if server else None)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    ok = not out["failures"] and not out["idle"]["in_flight"] and not out["idle"]["held"] and \
        out["health"] == {"status": "ok"} and rc in (0, None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
