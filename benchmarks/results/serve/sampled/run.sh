#!/usr/bin/env bash
# bench serve with sampling on (temperature 0.6, top-p 0.95, request i seeded 0 + i), SmolLM2 on the CPU, at exactly
# the settings of the greedy rows in ../ (run.sh there: 12 requests x 768 tokens forced, 232 blocks, concurrency 12,
# rows bounded at 20 minutes), for full and epikv K = 512. Resumable: finished rows in results.jsonl are reused.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
exec "${PY:-.venv/bin/python}" -m epikv.cli bench serve --model smollm2 --policies full,epikv --budgets 512 \
  --page 16 --num-blocks 232 --max-batch-tokens 256 \
  --requests 12 --concurrency 12 --max-tokens 768 --max-prompt-tokens 160 --timeout 1200 \
  --temperature 0.6 --top-p 0.95 --seed 0 \
  --out benchmarks/results/serve/sampled
