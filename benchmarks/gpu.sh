#!/usr/bin/env bash
# Both performance benchmarks on one CUDA GPU with the DeepSeek-R1-Distill-Llama-8B shape (random weights), bf16.
# Budget: under 8 minutes on one H200 (model init about 30 s per command; speed about 4-5 min; memory about 2 min).
# Usage: bash benchmarks/gpu.sh [OUT_DIR]   (default benchmarks/results/bench/gpu)
# Each command is append-only (OUT/*.json.jsonl) and resumable: rerunning skips the budgets / points already done.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/bench/gpu}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
EPIKV=${EPIKV:-epikv}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" || true

# SDPA (flash kernels inside torch) for everything; attention-based policies switch to eager themselves.
# Default policy list: every registered attention-based policy + epikv + lag-kv + full + streaming, tau 1 and 128.
timeout 330 $EPIKV bench speed --model random:llama-8b --device cuda --dtype bfloat16 --attn sdpa \
  --budgets 1024 --taus 1,128 --gen-tokens 256 --round-steps 128 \
  --long-policies full,epikv --long-budget 1024 --long-lengths 512,1024,2048 \
  --out "$OUT/speed_llama8b.json"

# One forward pass per point; eager + attention weights of all 32 layers is expected to run out of memory at 8192
# (32 layers x 32 heads x n^2 bf16 = 128 GiB), so larger eager points are skipped automatically.
timeout 150 $EPIKV bench memory --model random:llama-8b --device cuda --dtype bfloat16 --attn sdpa \
  --lengths 2048,4096,8192,16384,32768,65536 --out "$OUT/memory_llama8b.json"
echo "done: $OUT"
