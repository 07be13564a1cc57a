#!/usr/bin/env bash
# Per-step cost of eviction at equal batch on the CPU, where epikv really evicts: SmolLM2-135M's shape (random
# weights; per-step time depends on shapes), float32, 4 requests of 64 prompt tokens forced to 448 new ones (512 in
# all) against budgets 128 and 256, pages of 16; full, epikv and padded model.generate interleaved over 2 repeats
# after a warm-up. One torch thread (2 cores shared with other jobs).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
R=benchmarks/results/serve/cpu-equal-batch-evicting
"${PY:-.venv/bin/python}" benchmarks/serve_equal_batch.py --preset smollm2-135m --device cpu --dtype float32 \
  --batch 4 --prompt 64 --new 448 --budgets 128,256 --page 16 --max-batch-tokens 256 --repeats 2 \
  --out $R/results.jsonl | tee $R/run.log
