#!/usr/bin/env bash
# Issue 40's engines load, rerun with a KV stream per sequence: 32 MATH-500 chat requests (templated prompt <= 160
# tokens) x 3,072 generated tokens, all sent at once, streamed, greedy, forced length; SmolLM2 on this 2-core CPU,
# 2 threads per server, one server per row, in sequence; epikv K = 512 (tau 1) in every row.
# EQUAL KV BYTES in every row: 24,576 llama.cpp cells of F16 K and V (23,040 bytes a cell: 540 MiB), which is
#   - streams (the default for an evicting policy): 32 streams of 768 cells (K + a 256-token prompt chunk, the --ctx
#     `serve` derives), every request in flight at once;
#   - unified: one cache of 24,576 cells shared by the 32 sequences (each holds at most 513 + its prompt);
#   - torch: 768 pages of 16 float32 tokens (46,080 bytes a token: the same 540 MiB), `epikv serve --engine torch`.
# Rows are bounded in time (--timeout; a cut request counts the tokens it streamed, its latency is censored) and the
# README compares tokens/s over the window every row covers (tokens_by_second in results.jsonl).
# Resumable: finished rows in each results.jsonl are reused.
# Nothing else ran beside the rows (the retention runs of issue 39 were stopped, SIGSTOP, while they ran: at nice 19
# they still cut the serving rate by 2.8x, 97 against 270 steps a minute, llama.cpp's threads waiting on each other).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
PY=${PY:-.venv/bin/python}
R=benchmarks/results/serve/engines-streams
common=(--model smollm2 --max-batch-tokens 256 --requests 32 --concurrency 32 --max-tokens 3072
        --max-prompt-tokens 160 --threads 2 --policies epikv --budgets 512)
llama=(--engine llama.cpp --ctx 24576 --sequences 32)
"$PY" -m epikv.cli bench serve "${common[@]}" "${llama[@]}" --kv streams --timeout 1500 --out $R/streams
"$PY" -m epikv.cli bench serve "${common[@]}" "${llama[@]}" --kv unified --timeout 900 --out $R/unified
"$PY" -m epikv.cli bench serve "${common[@]}" --page 16 --num-blocks 768 --timeout 600 --out $R/torch
