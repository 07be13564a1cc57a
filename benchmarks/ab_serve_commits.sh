#!/usr/bin/env bash
# `epikv serve --engine llama.cpp` at an earlier commit against the working tree, interleaved (old, new, old, new,
# ...), with benchmarks/serve_vs_llama_server.py's client and settings: is a change faster on this machine today?
#   bash benchmarks/ab_serve_commits.sh OLD_COMMIT ROW TOKENS REPEATS OUTDIR
#   e.g. bash benchmarks/ab_serve_commits.sh a8fc81f epikv-seg-q:256 1024 3 benchmarks/results/serve/llama-server/ab-issue50
set -euo pipefail
OLD=${1:?old commit}; ROW=${2:?row}; TOKENS=${3:?tokens}; REPEATS=${4:?repeats}; OUT=$(realpath -m "${5:?out dir}")
HERE=$(pwd)
PY=$HERE/.venv/bin/python
# both sides read this tree's shipped data (an older commit may not ship it)
export EPIKV_DATA_DIR=${EPIKV_DATA_DIR:-$HERE/src/epikv/datasets}
TREE=$(mktemp -d)/old
git worktree add --detach "$TREE" "$OLD" > /dev/null
trap 'git worktree remove --force "$TREE"' EXIT
for n in $(seq "$REPEATS"); do
  for side in old new; do
    if [ "$side" = old ]; then R=$TREE; else R=$HERE; fi
    # each side runs its own copy of the script (its ROOT/src is the code measured); it is resumable:
    # --repeats n runs this side's repeat n - 1 only
    (cd "$R" && PYTHONPATH=src "$PY" benchmarks/serve_vs_llama_server.py run --tokens "$TOKENS" \
        --repeats "$n" --rows "$ROW" --out "$OUT/$side") | grep -E "tok/s|x $TOKENS" || true
  done
done
"$PY" - "$OUT" <<'PYEOF'
import json, statistics, sys
out = sys.argv[1]
rate = {s: [json.loads(l)["tokens_per_s"] for l in open(f"{out}/{s}/results.jsonl")] for s in ("old", "new")}
pairs = [n / o for o, n in zip(rate["old"], rate["new"])]
print(f"old {rate['old']}, new {rate['new']}: new / old paired {[round(p, 2) for p in pairs]}, "
      f"median {statistics.median(pairs):.2f}x")
PYEOF
