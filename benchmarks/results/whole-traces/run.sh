#!/usr/bin/env bash
# Issue 57 item 3: the per-token policies judged on whole traces through the llama.cpp engine. The 28 shared R1
# traces, whole (no reasoning or answer cap), the embedded SmolLM2-135M GGUF, F16 cells, one llama.cpp thread, flash
# attention on (as equal-bytes/f16). Budgets K = 512 and 1,024 (the issue's goal), tau as each policy ships: 16, and
# 128 for epikv-seg-q. Each record is against the same trace's whole cache (`full`).
# One trace at a time, one trace of each of the 7 problems first (the bootstrap resamples problems). Resumable: a
# killed run goes on with the same command. Two workers split the traces by ORDER:
#   R=benchmarks/results/whole-traces
#   ORDER="0 2 17 26 3 5 7 9 12 15 18 20 22 24" setsid nohup bash $R/run.sh > $R/log-1.txt 2>&1 &
#   ORDER="1 11 13 4 6 8 10 14 16 19 21 23 25 27" setsid nohup bash $R/run.sh > $R/log-2.txt 2>&1 &
set -uo pipefail
R=${R:-benchmarks/results/whole-traces}
EPIKV=${EPIKV:-epikv}
POLICIES=${POLICIES:-'full,epikv-learned-decay,epikv-learned-window,epikv-learned-age,epikv-learned-mean,random,streaming,epikv-seg-q[tau=128]'}
FIRST='0 1 2 11 17 13 26'
ORDER=${ORDER:-"$FIRST $(seq 0 27 | grep -vxE "${FIRST// /|}" | tr '\n' ' ')"}
for i in $ORDER; do
  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $EPIKV retention --engine llama.cpp --model smollm2 --threads 1 \
    --flash-attn on --no-report --tau 16 --traces shared-28 --skip "$i" --limit 1 \
    --budgets ${BUDGETS:-512,1024} --policies "$POLICIES" --out "$R/llamacpp" || exit $?
done
