#!/usr/bin/env bash
# Issue 40: llama.cpp's own `llama-server` as the yardstick for `epikv serve --engine llama.cpp`. The same GGUF (the
# embedded SmolLM2 Q4_1), the same llama.cpp (the source llama-cpp-python 0.3.36 vendors, built by
# benchmarks/build_llama_server.sh: portable CPU build), 2 threads, 256-token batches (llama-server -b 256 -ub 256,
# epikv --max-batch-tokens 256), F16 K and V, flash attention at llama.cpp's choice in both, the same client
# (`epikv bench serve`; for llama-server `--url`, which counts its tokens from its per-token timings and usage),
# the same 8 MATH-500 chat requests (templated prompt <= 160 tokens), all sent at once, greedy, forced length.
# llama-server runs with --parallel 8 and its default split cache (a stream of n_ctx / 8 cells a slot; its log says
# kv_unified = 'false'), 10,240 cells: 1,280 a slot, enough for 160 + 1,024 tokens.
#   A. 8 x 1,024 tokens: llama-server; epikv `full` (unified, 10,240 cells); epikv K = 256 on a quarter of the cells
#      (2,560: unified, as 8 streams would be rounded up to 512 cells each by llama.cpp).
#   B. 8 x 3,072 tokens on the same 10,240 cells: llama-server (a request outgrows its 1,280-cell slot: what it
#      does is in the row and its log) and epikv K = 1,024 on 8 streams of 1,280 cells (the same cells a slot).
#   C. 8 x 1,024 again with epikv on streams as llama-server's slots are: `full` on 8 streams of 1,280 cells (the
#      10,240 cells: every request fits its stream) and K = 256 on 8 streams of 512 (4,096 cells: llama.cpp's
#      smallest stream for K + a 256-token chunk), with llama-server run again beside them.
# Rows run whole, one server at a time. Resumable: finished rows in each results.jsonl are reused.
#   LLAMA_SERVER=path/to/llama-server bash benchmarks/results/serve/llama-server/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src
PY=${PY:-.venv/bin/python}
LS=${LLAMA_SERVER:-${EPIKV_CACHE_DIR:-$HOME/.cache/epikv}/llama-server/build/bin/llama-server}
R=benchmarks/results/serve/llama-server
GGUF=$("$PY" -c "from epikv.models import _gguf_folder, _GGUF_NAME; print(_gguf_folder() / _GGUF_NAME)")
[ -x "$LS" ] || { echo "no llama-server at $LS: run benchmarks/build_llama_server.sh" >&2; exit 2; }
common=(--model smollm2 --max-batch-tokens 256 --requests 8 --concurrency 8 --max-prompt-tokens 160 --threads 2
        --timeout 3600)

llama_server_row() {  # $1: max tokens, $2: out folder
  local port log pid
  mkdir -p "$2"
  if grep -qs '"label": "llama-server"' "$2/results.jsonl"; then
    echo "llama-server x $1: reusing $2" >&2; return; fi
  port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  log="$2/llama-server.log"
  "$LS" -m "$GGUF" -c 10240 --parallel 8 -t 2 -tb 2 -b 256 -ub 256 --host 127.0.0.1 --port "$port" --no-webui \
    > "$log" 2>&1 &
  pid=$!
  trap "kill $pid 2>/dev/null || true" EXIT
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  "$PY" -m epikv.cli bench serve "${common[@]}" --max-tokens "$1" --policies full --url "http://127.0.0.1:$port" \
    --label llama-server --out "$2"
  kill $pid; wait $pid 2>/dev/null || true
  trap - EXIT
}

# A: 8 x 1,024
llama_server_row 1024 $R/r8x1024
"$PY" -m epikv.cli bench serve "${common[@]}" --max-tokens 1024 --engine llama.cpp --sequences 8 --kv unified \
  --ctx 10240 --policies full --out $R/r8x1024
"$PY" -m epikv.cli bench serve "${common[@]}" --max-tokens 1024 --engine llama.cpp --sequences 8 --kv unified \
  --ctx 2560 --policies epikv --budgets 256 --out $R/r8x1024
# B: 8 x 3,072 on the same cells
llama_server_row 3072 $R/r8x3072
"$PY" -m epikv.cli bench serve "${common[@]}" --max-tokens 3072 --engine llama.cpp --sequences 8 --kv streams \
  --ctx 10240 --policies epikv --budgets 1024 --out $R/r8x3072
# C: 8 x 1,024, epikv on streams
llama_server_row 1024 $R/r8x1024-streams
"$PY" -m epikv.cli bench serve "${common[@]}" --max-tokens 1024 --engine llama.cpp --sequences 8 --kv streams \
  --ctx 10240 --policies full --out $R/r8x1024-streams
"$PY" -m epikv.cli bench serve "${common[@]}" --max-tokens 1024 --engine llama.cpp --sequences 8 --kv streams \
  --ctx 4096 --policies epikv --budgets 256 --out $R/r8x1024-streams
