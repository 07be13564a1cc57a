#!/usr/bin/env bash
# Issue 26 item 1: the whole-trace rows of the rolling-window change, at K = 1024 on all 28 shared traces, no caps.
# New default (window_over=decode, the authors' reading) for epikv, epikv-raw, kv-key, kv-val (tau 16) and epikv-seg
# (its shipped tau 128); kv-key and kv-val also as the old reading (window_over=all) in the same run, since no
# committed rows of theirs exist. The old rows of epikv, epikv-raw (../retention-full/tau16) and epikv-seg
# (../retention-full/tau128) are the committed ones, same engine and settings; README.md pairs them.
# Two processes share the folders through the store's claims (start one at S, one at G); a killed run resumes.
#   R=benchmarks/results/window-over
#   setsid nohup bash $R/run.sh S > $R/log-1.txt 2>&1 &  setsid nohup bash $R/run.sh G > $R/log-2.txt 2>&1 &
# EPIKV (default: the repo's .venv entry point) may name another, e.g. a frozen checkout's
# (EPIKV="env PYTHONPATH=/path/src .venv/bin/python -m epikv.cli").
set -euo pipefail
R=${R:-benchmarks/results/window-over}
EPIKV=${EPIKV:-.venv/bin/epikv}
run() { OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_SDPA_FORCE_GQA=1 \
        $EPIKV retention --model smollm2 --batch-traces 4 --no-report --budgets 1024 "$@"; }
S() { run --tau 16 --policies "full,epikv,epikv-raw,kv-key,kv-val,kv-key[window_over=all],kv-val[window_over=all]" \
          --out "$R/tau16"; }
G() { run --tau 128 --policies full,epikv-seg --out "$R/tau128"; }
case ${1:-S} in
  S) S; G ;;
  G) G; S ;;
  *) echo "run.sh: unknown start $1 (S or G)" >&2; exit 2 ;;
esac
