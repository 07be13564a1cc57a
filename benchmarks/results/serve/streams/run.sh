#!/usr/bin/env bash
# Issue 40, a short run (the issue's 32 x 3,072-token engines load takes hours on this shared 2-core CPU):
# `epikv serve --engine llama.cpp`, epikv K=256 (tau 1), with a KV stream per sequence (the new default) against the
# unified cache, at EQUAL KV cells and bytes: --ctx 4096 for both (8 streams of 512 cells: 256 + 64 rounded up to 256s; one cache of 4,096 cells),
# 8 MATH-500 chat requests (templated prompt <= 160 tokens) x 768 generated tokens (greedy, forced length), all sent
# at once, streamed, 2 llama.cpp threads, --max-batch-tokens 64. Each row runs whole (--timeout 900 is never reached:
# `completed` says so). Resumable: finished rows are reused.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
PY=${PY:-.venv/bin/python}
R=benchmarks/results/serve/streams
common=(--model smollm2 --engine llama.cpp --ctx 4096 --sequences 8 --max-batch-tokens 64 --requests 8
        --concurrency 8 --max-tokens 768 --max-prompt-tokens 160 --threads 2 --policies epikv --budgets 256
        --timeout 900)
"$PY" -m epikv.cli bench serve "${common[@]}" --kv streams --out $R/streams
"$PY" -m epikv.cli bench serve "${common[@]}" --kv unified --out $R/unified
# the same pair again in the other order (the CPU is shared: a load change between rows shows as a different ratio)
"$PY" -m epikv.cli bench serve "${common[@]}" --kv unified --out $R/repeat/unified
"$PY" -m epikv.cli bench serve "${common[@]}" --kv streams --out $R/repeat/streams
# the decode step at the engines load's shape (in process, layouts alternated): README.md
# PYTHONPATH=src python benchmarks/llamacpp_streams_step.py --sequences 24 --prompt 380 --new 80 --budget 512 \
#     --threads 2 --reps 2 --out benchmarks/results/serve/streams/step.jsonl
