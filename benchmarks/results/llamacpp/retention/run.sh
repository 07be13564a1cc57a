#!/usr/bin/env bash
# Whole-trace retention through the llama.cpp engine (issue 35 item 4), beside the torch rows of
# benchmarks/results/retention-full/tau16 (its run.sh, invocation A, at K = 1024): all 28 shared traces, no
# reasoning or answer cap, tau 16, K = 1024, the policies llama.cpp runs among that run's (full, epikv, random,
# epikv-raw, streaming; the others read attention, keys or queries and are refused by name). One trace at a time
# (llama.cpp decodes one sequence), one llama.cpp thread. A killed run resumes with the same command.
#   R=benchmarks/results/llamacpp/retention
#   setsid nohup bash $R/run.sh > $R/log.txt 2>&1 &
# Finished for issue 39 (2026-12-05) with the policies that issue compares that the Seg run does not (full, random,
# streaming; epikv, epikv-seg and epikv-seg-q are ../retention-seg at the Seg family's tau 128): epikv-raw and
# epikv at tau 16 were dropped after 6 and 7 traces (their records stay). Two processes may run it at once (one per
# core): they split the traces through the store's claims.
set -euo pipefail
R=${R:-benchmarks/results/llamacpp/retention}
EPIKV=${EPIKV:-epikv}
OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $EPIKV retention --engine llama.cpp --model smollm2 --threads 1 --no-report \
  --tau 16 --budgets 1024 --policies full,random,streaming --out "$R"
