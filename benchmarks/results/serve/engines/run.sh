#!/usr/bin/env bash
# Issue 32's benchmark: `epikv serve --engine llama.cpp` against `epikv serve` on transformers (torch), the same
# 32 MATH-500 chat requests (templated prompt <= 160 tokens) x 3,072 generated tokens (greedy, forced length:
# ignore_eos), all sent at once, streamed, on this 2-core CPU.
# KV capacity: 12,928 tokens for every row: full holds 4 requests at full length (4 x (160 + 3,072)), as
# 808 pages of 16 tokens for torch and 12,928 cells for llama.cpp. Equal tokens, not equal bytes: llama.cpp stores
# K and V in f16 (23,040 bytes a token for SmolLM2), torch on the CPU in float32 (46,080 bytes), so the torch
# server has twice the KV bytes; at equal bytes it would get 404 pages, half the requests in flight.
# Both servers use 2 threads (--threads 2: llama.cpp's threads / torch.set_num_threads); llama-cpp-python 0.3.36 in
# install.sh's portable build (AVX2, no AVX-512: the row's server.system_info says which).
# Rows are bounded in time (--timeout: requests unfinished then count the tokens they streamed): the llama.cpp
# epikv rows at 1,800 s (they finish well within it), llama.cpp's full row at 900 s, the torch rows at 600 s each
# (torch decodes this load at a fraction of llama.cpp's rate: whole torch rows would take hours on this CPU).
# Resumable: finished rows in each results.jsonl are reused; the last command writes the llama.cpp table with all
# three rows (reused).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
PY=${PY:-.venv/bin/python}
R=benchmarks/results/serve/engines
common=(--model smollm2 --max-batch-tokens 256 --requests 32 --concurrency 32 --max-tokens 3072
        --max-prompt-tokens 160 --threads 2)
llama=(--engine llama.cpp --ctx 12928 --sequences 32 --out $R/llama.cpp)
"$PY" -m epikv.cli bench serve "${common[@]}" "${llama[@]}" --policies epikv --budgets 512,256 --timeout 1800
"$PY" -m epikv.cli bench serve "${common[@]}" "${llama[@]}" --policies full --timeout 900
"$PY" -m epikv.cli bench serve "${common[@]}" --policies epikv,full --budgets 512 --page 16 --num-blocks 808 \
  --timeout 600 --out $R/torch
"$PY" -m epikv.cli bench serve "${common[@]}" "${llama[@]}" --policies full,epikv --budgets 256,512 --timeout 900
