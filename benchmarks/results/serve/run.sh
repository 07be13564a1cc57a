#!/usr/bin/env bash
# The serve benchmark committed here (CPU, one torch thread per process, 2 cores shared with other jobs).
# Scaled down from issue 25's 32 requests x 1,024 tokens to 12 x 1,024 so that three policies finish in under an
# hour on this CPU (about 1.2 s per forward at 13-16 requests in flight); --num-blocks 300 lets full hold about 4
# requests at full length (prompt <= 160 + 1,024 tokens = at most 74 pages of 16). Each policy row is bounded at
# 18 minutes (--timeout 1080): a request unfinished by then counts as not completed. Resumable: finished rows in
# results.jsonl are reused.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
exec python -m epikv.cli bench serve --model smollm2 --policies full,epikv --budgets 256,512 \
  --page 16 --num-blocks 300 --max-batch-tokens 256 \
  --requests 12 --concurrency 12 --max-tokens 1024 --max-prompt-tokens 160 --timeout 1080 \
  --equal-batch 4 --equal-batch-tokens 128 \
  --out benchmarks/results/serve
