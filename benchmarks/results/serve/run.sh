#!/usr/bin/env bash
# The serve benchmark committed here (CPU, one torch thread per process, 2 cores shared with other jobs).
# Scaled down from issue 25's 32 requests x 1,024 tokens to 16 x 1,024 so that three policies finish in about
# an hour on this CPU; --num-blocks 300 lets full hold about 4 requests at full length (prompt <= 160 + 1,024
# tokens = 74 pages of 16). Resumable: finished rows in results.jsonl are reused.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
exec python -m epikv.cli bench serve --model smollm2 --policies full,epikv --budgets 256,512 \
  --page 16 --num-blocks 300 --max-batch-tokens 256 \
  --requests 16 --concurrency 16 --max-tokens 1024 --max-prompt-tokens 160 --timeout 1500 \
  --equal-batch 4 --equal-batch-tokens 256 \
  --out benchmarks/results/serve
