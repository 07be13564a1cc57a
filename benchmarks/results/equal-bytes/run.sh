#!/usr/bin/env bash
# Issue 56 item 4: eviction at equal peak KV bytes through the llama.cpp engine, against KV quantization alone and
# llama.cpp's context shift. The 28 shared R1 traces, whole (no reasoning or answer cap), the embedded SmolLM2-135M
# GGUF, one llama.cpp thread, flash attention on in every folder (a quantized V cache needs it). One folder a cell
# type (f16/, q8_0/, q4_0/), each with its own whole-cache reference (`full`: the quantization-alone row; the report
# takes answer-NLL increases against the whole F16 cache of f16/). Byte budgets 12 MiB and 24 MiB (about F16
# K = 512 and K = 1,024 with tau 16); `--kv-memory` gives each policy the largest K whose planned peak (cells and the
# policy's buffers) fits, and every record carries the measured peak (kv_peak_bytes). tau 16 for every policy but
# epikv-seg-q (its shipped tau 128); context-shift keeps the whole prompt (n_keep -1), as the other policies protect
# it.
# Trace by trace, each trace through the three folders in turn, so a partial run is paired across rows. Resumable:
# a killed run goes on with the same command; two copies (one per core) split the work through the store's claims.
#   R=benchmarks/results/equal-bytes
#   setsid nohup bash $R/run.sh > $R/log-1.txt 2>&1 &  setsid nohup bash $R/run.sh > $R/log-2.txt 2>&1 &
# POLICIES, ORDER (trace indices) and TYPES (cell types, in order) may be set to split the work between workers
# (each invocation claims its cells in the store, so workers on one trace and type split its budgets).
set -uo pipefail
R=${R:-benchmarks/results/equal-bytes}
EPIKV=${EPIKV:-epikv}
POLICIES=${POLICIES:-'full,random,streaming,context-shift[n_keep=-1],epikv-seg-q[tau=128],epikv-learned-mean'}
# one trace of each of the 7 problems first (the bootstrap resamples problems: 5 are needed for an interval), the
# shortest of each problem not yet covered, then the rest in file order
FIRST='0 1 2 11 17 13 26'
ORDER=${ORDER:-"$FIRST $(seq 0 27 | grep -vxE "${FIRST// /|}" | tr '\n' ' ')"}
for i in $ORDER; do
  for T in ${TYPES:-f16 q8_0 q4_0}; do
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $EPIKV retention --engine llama.cpp --model smollm2 --threads 1 \
      --flash-attn on --cache-type-k $T --cache-type-v $T --no-report --tau 16 --traces shared-28 \
      --skip "$i" --limit 1 --kv-memory 12MiB,24MiB --policies "$POLICIES" --out "$R/$T" || exit $?
  done
done
