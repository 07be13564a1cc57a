#!/usr/bin/env bash
# The whole-trace retention run (issue 12 item 3): all 28 shared traces, no reasoning or answer cap, budgets 1024,
# then 512, then 2048 (each budget complete over all traces before the next starts). tau 16, except the Seg family at
# its shipped schedule (tau 128), with `epikv` at tau 128 as its like-for-like row. Settings are the defaults.
#
# Each budget runs four stages, the headline comparison first: (0) tau 16: full, epikv, random, h2o; (1) tau 128:
# full, epikv-seg, epikv-seg-q, epikv; (2) tau 16: the other baselines; (3) tau 16: epikv with the value reserve.
# Start it in two processes at once (one per core), the second at another stage (`run.sh 1`): they share the
# folders and split the records through the store's claims, and each runs every stage before the next budget, so
# nothing is left out. A killed run resumes with the same command (finished records are skipped).
#   R=benchmarks/results/retention-full
#   setsid nohup bash $R/run.sh 0 > $R/log-1.txt 2>&1 &  setsid nohup bash $R/run.sh 1 > $R/log-2.txt 2>&1 &
# EPIKV (default: `epikv` on PATH) may name another entry point, e.g. a frozen export's.
set -euo pipefail
R=${R:-benchmarks/results/retention-full}
EPIKV=${EPIKV:-epikv}
START=${1:-0}
run() { OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $EPIKV retention --model smollm2 --batch-traces 4 --no-report "$@"; }
stage() {  # stage N K
  case $1 in
    0) run --tau 16 --budgets "$2" --policies full,epikv,random,h2o --out "$R/tau16" ;;
    1) run --tau 128 --budgets "$2" --policies full,epikv-seg,epikv-seg-q,epikv --out "$R/tau128" ;;
    2) local p=full,epikv-raw,lag-kv,h2o-global,rkv,keydiff,streaming
       [ "$2" = 2048 ] || p=$p,tova,snapkv  # at 2048 tova and snapkv come last (the first rows to drop)
       run --tau 16 --budgets "$2" --policies "$p" --out "$R/tau16" ;;
    3) run --tau 16 --budgets "$2" --policies epikv --set epikv.reserve=16 --out "$R/tau16" ;;
  esac
}
for K in 1024 512 2048; do
  for j in 0 1 2 3; do stage $(((j + START) % 4)) "$K"; done
done
run --tau 16 --budgets 2048 --policies tova,snapkv --out "$R/tau16"
