#!/usr/bin/env bash
# How many requests the cache holds depends on page counts and the scheduler only (every request is forced to the
# same length, greedy), not on the weights: a tiny random model (random:tiny, SmolLM2's tokenizer, 4 blocks) stands
# in for SmolLM2 where SmolLM2 would take hours on this CPU. Its tokens/s say nothing about SmolLM2's.
#  1. 32 x 1,024 at 300 pages, exactly ../r32x1024's settings: checks the stand-in against SmolLM2's rows.
#  2. 32 x 3,072 at 808 pages (full holds 4 requests at full length: a prompt of at most 160 + 3,072 tokens is at
#     most 202 pages of 16), where the issue's 3x is in reach for K = 512 too (see ../README.md).
# Resumable: a finished row is kept.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
PY=${PY:-.venv/bin/python}
R=benchmarks/results/serve/stand-in
common=(--model random:tiny --policies full,epikv --budgets 256,512 --page 16 --max-batch-tokens 256
        --requests 32 --concurrency 32 --max-prompt-tokens 160)
"$PY" -m epikv.cli bench serve "${common[@]}" --num-blocks 300 --max-tokens 1024 --timeout 3600 --out $R/r32x1024
"$PY" -m epikv.cli bench serve "${common[@]}" --num-blocks 808 --max-tokens 3072 --timeout 3600 --out $R/r32x3072
