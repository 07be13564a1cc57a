#!/usr/bin/env bash
# Whole-trace retention through the llama.cpp engine for the Seg family (issue 39), beside the torch rows of
# benchmarks/results/retention-full/tau128 (its run.sh, invocation C, at K = 1024): all 28 shared traces, no
# reasoning or answer cap, tau 128 (Seg and Seg-Q's shipped schedule), K = 1024, full, epikv-seg, epikv-seg-q and
# epikv at tau 128 as its like-for-like row. One trace at a time, one llama.cpp thread. A killed run resumes with the
# same command (finished records are skipped).
#   R=benchmarks/results/llamacpp/retention-seg
#   EPIKV="python -m epikv.cli" setsid nohup nice -n 10 bash $R/run.sh > $R/log.txt 2>&1 &
set -euo pipefail
R=${R:-benchmarks/results/llamacpp/retention-seg}
EPIKV=${EPIKV:-epikv}
OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $EPIKV retention --engine llama.cpp --model smollm2 --threads 1 --no-report \
  --tau 128 --budgets 1024 --policies full,epikv-seg,epikv-seg-q,epikv --out "$R"
