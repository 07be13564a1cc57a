#!/usr/bin/env bash
# The value reserve before and after its statistic moved to arrival (2026-12-02), as the whole-trace run uses it:
# `epikv` and `epikv[reserve=16]` at K = 512, tau 16, `--batch-traces 4` on the 4 shared traces of one problem
# (problem_2238: one batch, one prompt length) cut at 1,500 reasoning tokens, computed by the previous commit (OLD: a
# checkout of it, e.g. `git worktree add /tmp/oldtree ea1c42c`) and by this one. The machine is busy (the run of
# `../retention-full`), so compare the reserve with plain epikv within one invocation: the ratio of their forward
# seconds.
# Usage (repository root): OLD=/tmp/oldtree bash benchmarks/results/reserve-refill/run.sh > benchmarks/results/reserve-refill/result.txt
set -euo pipefail
OLD=${OLD:?a checkout of the commit before}
# the shared data as this checkout finds it (a checkout elsewhere would look next to itself)
DATA=$(.venv/bin/python -c "from epikv.data import data_dir; print(data_dir())")
TRACES=/tmp/reserve-refill-traces.jsonl  # the 4 traces of problem_2238, read from the shared data (not committed)
grep '/problem_2238/' "$DATA/reasoning_traces.jsonl" > "$TRACES"
one() {  # $1: source folder, $2: out folder
  rm -rf "$2" "$2.log"
  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_SDPA_FORCE_GQA=1 PYTHONPATH="$1/src" \
    .venv/bin/python -m epikv.cli retention --model smollm2 --no-report --tau 16 --budgets 512 --batch-traces 4 \
    --max-reasoning-tokens 1500 --policies "epikv,epikv[reserve=16]" --traces "$TRACES" --out "$2" > /dev/null 2> "$2.log" || { tail -3 "$2.log" >&2; exit 1; }
  .venv/bin/python - "$2" "$3" <<'PY'
import json, sys
rs = [json.loads(line) for line in open(sys.argv[1] + "/results.jsonl")]
for r in rs:
    if r["policy"] != "full":
        name = r["policy"] + ("[reserve=16]" if r["settings"] else "")
        print(f"{sys.argv[2]:<4} {r['trace_id'][-32:]:<32} {name:<18} {r['seconds']:6.1f} s  answer NLL "
              f"{r['answer_nll']:.6f}  KL {r['kl']:.6f}  top-1 {r['top1_agreement']:.4f}  evictions {r['evictions']}")
sec = {n: sum(r["seconds"] for r in rs if r["policy"] == "epikv" and bool(r["settings"]) == n) for n in (False, True)}
print(f"{sys.argv[2]}: reserve / epikv forward seconds = {sec[True] / sec[False]:.2f}")
PY
}
one "$OLD" /tmp/reserve-old old
one "$PWD" /tmp/reserve-new new
