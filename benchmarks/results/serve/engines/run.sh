#!/usr/bin/env bash
# Issue 32's benchmark: `epikv serve --engine llama.cpp` against `epikv serve` on transformers (torch), the same
# 32 MATH-500 chat requests (templated prompt <= 160 tokens) x 3,072 generated tokens (greedy, forced length:
# ignore_eos), all sent at once, streamed, on this 2-core CPU.
# KV capacity: 12,928 tokens for every row: full holds 4 requests at full length (4 x (160 + 3,072)), as
# 808 pages of 16 tokens for torch and 12,928 cells for llama.cpp. Equal tokens, not equal bytes: llama.cpp stores
# K and V in f16 (23,040 bytes a token for SmolLM2), torch on the CPU in float32 (46,080 bytes), so the torch
# server has twice the KV bytes; at equal bytes it would get 404 pages, half the requests in flight.
# Both servers use 2 threads (--threads 2: llama.cpp's threads / torch.set_num_threads).
# Rows are bounded in time (--timeout: requests unfinished then count the tokens they streamed), the llama.cpp rows
# at 1,800 s and the torch rows at 900 s (torch decodes this load at about a tenth of llama.cpp's rate: a whole
# torch row would take hours). Resumable: finished rows in each results.jsonl are reused.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
PY=${PY:-.venv/bin/python}
R=benchmarks/results/serve/engines
common=(--model smollm2 --policies epikv,full --budgets 512,256 --max-batch-tokens 256 --requests 32
        --concurrency 32 --max-tokens 3072 --max-prompt-tokens 160 --threads 2)
"$PY" -m epikv.cli bench serve "${common[@]}" --engine llama.cpp --ctx 12928 --sequences 32 --timeout 1800 \
  --out $R/llama.cpp
"$PY" -m epikv.cli bench serve "${common[@]}" --budgets 512 --page 16 --num-blocks 808 --timeout 900 --out $R/torch
