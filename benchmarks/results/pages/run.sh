#!/usr/bin/env bash
# Retention cost of page-granular eviction (docs/SERVING.md): epikv at K = 512, tau 16, token granularity and
# pages of 8 / 16 / 32 slots, against one full-cache reference per trace (page_policies.py names the page sizes).
# Reasoning cut at 2048 tokens, 64 answer tokens scored. LIMIT traces (default 6).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/pages
nice -n 10 env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 EPIKV_POLICIES=$OUT/page_policies.py .venv/bin/epikv retention \
  --model smollm2 --traces src/epikv/datasets/reasoning_traces.jsonl --limit "${LIMIT:-6}" --max-reasoning-tokens 2048 \
  --max-answer-tokens 64 --budgets 512 --tau 16 --out "$OUT" --no-report \
  --policies full,epikv,epikv-page8,epikv-page16,epikv-page32
EPIKV_POLICIES=$OUT/page_policies.py .venv/bin/epikv report "$OUT" --reference epikv
