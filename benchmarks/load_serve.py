"""A load test with locust (benchmarks/locust_serve.py, headless): a rising request rate against `epikv serve` on one
machine, the single server and Ray Serve with 1 and 2 replicas, one after the other in one run, the same model,
engine options and --max-waiting in each. Per stage of the rate: requests, p50 / p95 / p99 latency, p50 / p95 time
to first token, tokens/s, errors, 429s; and the stage at which 429s begin.

    pip install -e '.[load,ray,serve]'
    python benchmarks/load_serve.py --out benchmarks/results/serve/load --stage-s 15 --users 1,2,4,8,16

On a machine of 2 cores shared with other work the replicas compete for the same cores: two cannot raise the
throughput here; the per-replica figures (the 1-replica row) are what a machine with a core set per replica would
multiply.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz_serve  # noqa: E402  (its launcher of `epikv serve`)

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ["--model", "random:tiny", "--policy", "epikv", "--budget", "128", "--page", "16", "--num-blocks", "256",
          "--max-batch-tokens", "64", "--max-tokens", "32", "--max-waiting", "4", "--threads", "1"]
CONFIGS = {"single": [], "ray-1": ["--ray", "--replicas", "1"], "ray-2": ["--ray", "--replicas", "2"]}


def pct(xs: list[float], q: float):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def summarize(rows: list[dict], stage_s: float) -> list[dict]:
    out = []
    for users in sorted({r["users"] for r in rows}):
        rs = [r for r in rows if r["users"] == users]
        ok = [r for r in rs if r["status"] == 200 and not r["error"]]
        lat = [r["latency"] for r in ok]
        ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        out.append({"users": users, "requests": len(rs), "ok": len(ok),
                    "ok_per_s": round(len(ok) / stage_s, 2),
                    "p50_s": pct(lat, 0.5), "p95_s": pct(lat, 0.95), "p99_s": pct(lat, 0.99),
                    "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
                    "tokens_per_s": round(sum(r["tokens"] for r in ok) / stage_s, 1),
                    "429": sum(r["status"] == 429 for r in rs),
                    "errors": sum(r["status"] not in (200, 429) or bool(r["error"]) for r in rs)})
    return out


def run_one(name: str, extra: list[str], out: Path, stage_s: float, users: str) -> dict:
    fuzz_serve.REQUEST_TIMEOUT = 120.0
    server = fuzz_serve.Server(extra + ENGINE)
    rows_path = out / f"{name}.jsonl"
    rows_path.unlink(missing_ok=True)
    try:
        env = dict(os.environ, EPIKV_LOCUST_OUT=str(rows_path), EPIKV_LOCUST_STAGE_S=str(stage_s),
                   EPIKV_LOCUST_USERS=users)
        cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "benchmarks" / "locust_serve.py"), "--headless",
               "--host", server.url, "--only-summary", "--loglevel", "WARNING"]
        subprocess.run(cmd, env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=stage_s * len(users.split(",")) + 120)
        stats = fuzz_serve.get(server.url, "/stats")
    finally:
        rc = server.stop()
    rows = [json.loads(x) for x in rows_path.read_text().splitlines() if x.strip()]
    stages = summarize(rows, stage_s)
    first_429 = next((s["users"] for s in stages if s["429"]), None)
    return {"config": name, "argv": extra + ENGINE, "stages": stages, "429_from_users": first_429,
            "server_exit": rc, "replicas_seen": len(stats.get("replicas", {})) or 1}


def table(results: list[dict]) -> str:
    head = ("| config | users (req/s offered) | ok | ok/s | p50 s | p95 s | p99 s | TTFT p50 s | TTFT p95 s | "
            "tokens/s | 429 | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in results:
        for s in r["stages"]:
            lines.append(f"| {r['config']} | {s['users']} | {s['ok']} | {s['ok_per_s']} | {s['p50_s']} | {s['p95_s']} "
                         f"| {s['p99_s']} | {s['ttft_p50_s']} | {s['ttft_p95_s']} | {s['tokens_per_s']} | "
                         f"{s['429']} | {s['errors']} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/serve/load")
    ap.add_argument("--stage-s", type=float, default=20.0)
    ap.add_argument("--users", default="1,2,4,8,16", help="users per stage (each about 1 request/s)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.configs.split(","):
        t0 = time.monotonic()
        results.append(run_one(name, CONFIGS[name], out, args.stage_s, args.users))
        results[-1]["wall_s"] = round(time.monotonic() - t0, 1)
        (out / "load.json").write_text(json.dumps({"command": "python benchmarks/load_serve.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "nproc": os.cpu_count(), "results": results}, indent=1) + "\n")
    write_md(out, json.loads((out / "load.json").read_text()))
    print(table(results))
    return 0


def write_md(out: Path, doc: dict) -> None:
    """load.md: the table of load.json, its command and the machine's condition."""
    (out / "load.md").write_text(
        f"`{doc['command']}` (os.cpu_count() {doc['nproc']}). Measured on a machine shared with other agents' work "
        "(its load varied during the run): compare the configurations within this run only.\n\n" +
        table(doc["results"]))


if __name__ == "__main__":
    sys.exit(main())
