#!/usr/bin/env bash
# Where `epikv serve --engine llama.cpp` spends its time (issue 50): py-spy samples every thread of the server while
# `epikv bench serve` sends 8 requests at once (the fair comparison's client and settings), then
# benchmarks/profile_summary.py splits the samples by thread and by the engine loop's parts.
#   bash benchmarks/profile_serve.sh POLICY K TOKENS OUTDIR     e.g. epikv-seg-q 256 1024 benchmarks/results/...
set -euo pipefail
POLICY=${1:?policy}; K=${2:?budget}; TOKENS=${3:?tokens}; OUT=${4:?out dir}
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 PYTHONPATH=src
mkdir -p "$OUT"
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
BUDGET=(); [ "$POLICY" != full ] && BUDGET=(--budget "$K")
CTX=(); [ "$POLICY" = full ] && CTX=(--ctx $((8 * ((TOKENS + 256 + 255) / 256 * 256))))
.venv/bin/py-spy record --threads --idle --format raw --rate 100 -o "$OUT/samples.txt" -- \
    $PY -m epikv.cli serve --engine llama.cpp --model smollm2 --host 127.0.0.1 --port "$PORT" --sequences 8 \
    --kv streams --threads 2 --max-batch-tokens 256 --flash-attn off --max-tokens "$TOKENS" --policy "$POLICY" \
    "${BUDGET[@]}" "${CTX[@]}" > "$OUT/server.log" 2>&1 &
SPY=$!
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
$PY -m epikv.cli bench serve --model smollm2 --max-batch-tokens 256 --requests 8 --concurrency 8 \
    --max-prompt-tokens 256 --threads 2 --timeout 7200 --max-tokens "$TOKENS" --policies full \
    --url "http://127.0.0.1:$PORT" --label "epikv $POLICY K=$K" --out "$OUT/client" > "$OUT/client.log" 2>&1
pkill -INT -f "epikv.cli serve --engine llama.cpp --model smollm2 --host 127.0.0.1 --port $PORT" || true
wait $SPY || true
gzip -f "$OUT/samples.txt"
rm -rf "$OUT/client"  # the client's own records: its one line is in client.log
$PY benchmarks/profile_summary.py "$OUT/samples.txt.gz" | tee "$OUT/summary.txt"
