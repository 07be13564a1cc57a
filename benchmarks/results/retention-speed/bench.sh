#!/bin/bash
# usage: [TRACES=file.jsonl] bench.sh OUT [extra retention args]; prints CPU seconds of the process and tokens per CPU-second
out=$1; shift
cd "$(dirname "$0")/../../.."  # the repository root
rm -rf "$out"
nice -n 10 env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python - "$out" "$@" <<'PY'
import sys, time, json, torch
from epikv.cli import main
out = sys.argv[1]
argv = ["retention", "--model", "smollm2", "--traces", __import__("os").environ.get("TRACES", "src/epikv/datasets/reasoning_traces.jsonl"), "--limit", "4",
        "--max-reasoning-tokens", "512", "--max-answer-tokens", "32", "--policies", "full,epikv,h2o,lag-kv",
        "--budgets", "256", "--tau", "16", "--no-report", "--out", out] + sys.argv[2:]
t0, w0 = time.process_time(), time.perf_counter()
rc = main(argv)
cpu, wall = time.process_time() - t0, time.perf_counter() - w0
recs = [json.loads(l) for l in open(out + "/results.jsonl")]
tok = sum(r["reasoning_tokens"] + r["answer_tokens"] for r in recs)
print(json.dumps({"argv": " ".join(sys.argv[2:]), "rc": rc, "records": len(recs), "tokens": tok, "cpu_s": round(cpu, 1),
                  "wall_s": round(wall, 1), "tokens_per_cpu_s": round(tok / cpu, 1), "threads": torch.get_num_threads()}))
PY
