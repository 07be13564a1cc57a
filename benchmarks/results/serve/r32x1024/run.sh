#!/usr/bin/env bash
# The issue's own size (issue 25): 32 requests x 1,024 generated tokens, all open at once, --num-blocks 300 so that
# full holds about 4 requests at full length (a prompt of at most 160 + 1,024 tokens is at most 74 pages of 16).
# One hour per policy row at most; no equal-batch part (../run.sh has it). Resumable: a finished row is kept.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
exec "${PY:-.venv/bin/python}" -m epikv.cli bench serve --model smollm2 --policies full,epikv --budgets 256,512 \
  --page 16 --num-blocks 300 --max-batch-tokens 256 \
  --requests 32 --concurrency 32 --max-tokens 1024 --max-prompt-tokens 160 --timeout 3600 \
  --out benchmarks/results/serve/r32x1024
