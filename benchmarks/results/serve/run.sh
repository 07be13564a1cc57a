#!/usr/bin/env bash
# The serve benchmark committed here (CPU, one torch thread per process, 2 cores shared with other jobs).
# Scaled down from issue 25's 32 requests x 1,024 tokens to 12 x 768 so that three policies finish within the hour
# this CPU had (about 1-1.4 s per forward at 12 requests in flight); --num-blocks 232 lets full hold about 4
# requests at full length (prompt <= 160 + 768 tokens = at most 58 pages of 16), the same ratio as 300 blocks for
# 1,024 tokens. Each policy row is bounded at 20 minutes (--timeout 1200): a request unfinished by then counts as
# not completed (the tokens it streamed still count in tokens/s). Resumable: finished rows in results.jsonl are
# reused.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
exec "${PY:-.venv/bin/python}" -m epikv.cli bench serve --model smollm2 --policies full,epikv --budgets 256,512 \
  --page 16 --num-blocks 232 --max-batch-tokens 256 \
  --requests 12 --concurrency 12 --max-tokens 768 --max-prompt-tokens 160 --timeout 1200 \
  --equal-batch 4 --equal-batch-tokens 128 \
  --out benchmarks/results/serve
