#!/usr/bin/env bash
# The whole-trace retention run (issue 12 item 3): all 28 shared traces, no reasoning or answer cap, budgets 1024,
# then 512, then 2048 (each budget complete over all traces before the next starts). tau 16, except the Seg family at
# its shipped schedule (tau 128), with `epikv` at tau 128 as its like-for-like row. Settings are the defaults.
#
# Start it in two processes at once (one per core): they share the folders and split the records through the
# store's claims; a killed run resumes with the same command (finished records are skipped).
#   R=benchmarks/results/retention-full; for i in 1 2; do setsid nohup bash $R/run.sh > $R/log-$i.txt 2>&1 & done
# EPIKV (default: `epikv` on PATH) may name another entry point, e.g. a frozen export's.
set -euo pipefail
R=${R:-benchmarks/results/retention-full}
EPIKV=${EPIKV:-epikv}
run() { OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $EPIKV retention --model smollm2 --batch-traces 4 --no-report "$@"; }
P16=full,epikv,epikv-raw,lag-kv,h2o,h2o-global,rkv,keydiff,streaming,random
for K in 1024 512 2048; do
  if [ "$K" = 2048 ]; then p=$P16; else p=$P16,tova,snapkv; fi  # at 2048 tova and snapkv come last (droppable)
  run --tau 16 --budgets "$K" --policies "$p" --out "$R/tau16"
  run --tau 16 --budgets "$K" --policies epikv --set epikv.reserve=16 --out "$R/tau16"
  run --tau 128 --budgets "$K" --policies full,epikv-seg,epikv-seg-q,epikv --out "$R/tau128"
done
run --tau 16 --budgets 2048 --policies tova,snapkv --out "$R/tau16"
