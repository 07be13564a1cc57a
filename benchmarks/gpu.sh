#!/usr/bin/env bash
# The three performance benchmarks on one CUDA GPU with the DeepSeek-R1-Distill-Llama-8B shape (random weights,
# bf16, SDPA): decode speed + long generations, the single-pass memory wall, throughput under a KV-memory cap.
# Budget: the whole script stays under 8 minutes on one H200. Each step gets a share (speed 250 s, throughput 150 s,
# memory the rest) and never runs past the script's deadline (470 s); a step that times out leaves its finished
# records in OUT/*.json.jsonl and the next step still runs. Rerunning resumes: finished budgets / points / batches
# are read back from the journals, not measured again.
# Estimates (not yet measured on a GPU): model init about 20 s per command; a decode step about 30-40 ms.
# Usage: bash benchmarks/gpu.sh [OUT_DIR]   (default benchmarks/results/bench/gpu)
# The command is the repository's own venv entry point (.venv/bin/epikv), not whatever `epikv` is on PATH; set
# EPIKV=/path/to/epikv to use another. Exit status: 0 only when every step finished; otherwise 1 and the failed,
# timed-out or skipped steps are named on the last line (2 when the entry point itself is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/bench/gpu}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
EPIKV=${EPIKV:-$PWD/.venv/bin/epikv}
if ! command -v "$EPIKV" > /dev/null; then
  echo "gpu.sh: error: no epikv entry point at $EPIKV (run the set-up in README.md, or set EPIKV=/path/to/epikv)" >&2
  exit 2
fi
mkdir -p "$OUT" || exit 2
# MATH-500 prompts for the throughput step: $EPIKV_DATA_DIR, else the copy shipped with epikv
DATA=${EPIKV_DATA_DIR:-src/epikv/datasets}
DEADLINE=470  # seconds after the start of this script
MODEL=(--model random:llama-8b --device cuda --dtype bfloat16 --attn sdpa)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2> /dev/null || true
FAILED=()  # "name (why)" of each step that did not finish

step() {  # step NAME SHARE_S COMMAND...: run with timeout min(SHARE_S, time left), log, never abort the script
  local name=$1 share=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  local limit=$((share < left ? share : left))
  if ((limit < 30)); then
    echo "$name: skipped, ${left} s left" | tee -a "$OUT/steps.txt"
    FAILED+=("$name (skipped: ${left} s left)")
    return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" 2> >(tee "$OUT/$name.log" >&2)
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
  if ((rc == 124)); then
    FAILED+=("$name (timed out after $limit s; rerun to resume)")
  elif ((rc != 0)); then
    FAILED+=("$name (exit $rc, see $OUT/$name.log)")
  fi
}

# 1. Decode speed at K = 512 and 2048, tau 1 and 128 (attention-based policies switch to eager themselves), 2
#    interleaved rounds of 128 steps, with both references of the eviction overhead: the `full` policy in our cache
#    and transformers' own generate + DynamicCache at the same length; then long generations of full vs epikv to
#    2048 tokens (tokens/s, KV and peak memory). About 2 x 8 configs x 260 steps + 2 x 2048 steps.
step speed 250 $EPIKV bench speed "${MODEL[@]}" \
  --policies h2o,epikv,full,streaming --budgets 512,2048 --taus 1,128 --gen-tokens 256 --round-steps 128 \
  --long-policies full,epikv --long-budget 1024 --long-lengths 512,1024,2048 \
  --out "$OUT/speed_llama8b.json"

# 2. Throughput under a 512 MiB KV cap (128 KiB per token and sequence: 32 layers x 8 KV heads x 128 x 2 x bf16):
#    12 MATH-500 prompts of <= 128 tokens, 512 forced new tokens each, K = 256. Expected largest batches: full 4
#    (its buffers double to 1024 slots: 128 MiB a sequence), epikv 12 (321 slots + 2 hidden states), h2o 8 (its
#    prefill attention weights, 32 layers x 32 heads x width^2, count too). Static batches, interleaved; 8 batches of
#    511 decode steps in all.
step throughput 150 $EPIKV bench throughput "${MODEL[@]}" \
  --policies full,epikv,h2o --budgets 256 --cap-mib 512 --requests 12 --max-prompt-tokens 128 \
  --max-new-tokens 512 --ladder 0 --data math500 --data-dir "$DATA" \
  --out "$OUT/throughput_llama8b.json"
# 3. One forward pass per point; eager + attention weights of all 32 layers is expected to run out of memory at 8192
#    (32 layers x 32 heads x n^2 bf16 = 128 GiB), so larger eager points are skipped automatically.
step memory 120 $EPIKV bench memory "${MODEL[@]}" \
  --lengths 2048,4096,8192,16384,32768,65536 --out "$OUT/memory_llama8b.json"

if ((${#FAILED[@]})); then
  echo "gpu.sh: ${#FAILED[@]} of 3 steps failed after $SECONDS s: $(IFS=';'; echo "${FAILED[*]}" | sed 's/;/; /g')" >&2
  exit 1
fi
echo "done in $SECONDS s: $OUT"
