#!/usr/bin/env bash
# The engine, cache (drop-in, hybrid), press, CLI and serving tests against the other transformers versions epikv supports (default: the oldest
# supported, 5.0.0, and 5.17.0, the lent GPU machines' version), after the main suite ran on .venv's version.
#
# Each version is an overlay: `transformers==X` with its own dependency closure (huggingface_hub, tokenizers ...)
# installed by `pip --target` into a folder of its own, put first on PYTHONPATH in front of .venv's python, which
# supplies torch, accelerate and epikv. .venv itself is never modified. A finished overlay is reused (idempotent:
# it is built in a temporary folder and moved into place only once complete), so a second run costs only the tests.
#
#   bash scripts/test-matrix.sh                       # default versions and tests
#   EPIKV_TF_VERSIONS="5.2.0" bash scripts/test-matrix.sh tests/test_engine.py -k drop_in
#   EPIKV_TF_DIR=/somewhere/else ...                  # where overlays live (default ~/.cache/epikv/transformers)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=${EPIKV_TF_VERSIONS:-"5.0.0 5.17.0"}
ROOT=${EPIKV_TF_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/epikv/transformers}
PY=.venv/bin/python
[ -x "$PY" ] || bash scripts/install.sh

if [ $# -gt 0 ]; then
    TESTS=("$@")
else
    TESTS=()
    for t in tests/test_engine.py tests/test_dropin.py tests/test_refill.py tests/test_hybrid.py tests/test_press.py tests/test_custom_policy.py tests/test_cli.py tests/test_speed_reference.py \
             tests/test_serving.py tests/test_serving_versions.py tests/test_serving_http.py tests/test_serving_sampling.py \
             tests/test_serving_app.py; do
        [ -f "$t" ] && TESTS+=("$t")
    done
fi

install_overlay() {  # transformers==version and its dependencies into $ROOT/version, unless already there
    local v=$1 dir=$ROOT/$1
    if [ ! -f "$dir/.epikv-complete" ]; then
        echo "== installing transformers $v into $dir" >&2
        mkdir -p "$ROOT"
        rm -rf "$dir.partial"
        # numpy pinned to .venv's: one numpy for torch and scipy, whichever path wins
        local numpy
        numpy=$("$PY" -c 'import numpy; print(numpy.__version__)')
        # (pip's notes about this machine's local index folders are dropped; its errors are kept)
        "$PY" -m pip install -q --disable-pip-version-check --no-input --target "$dir.partial" \
            "transformers==$v" "numpy==$numpy" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
        touch "$dir.partial/.epikv-complete"
        rm -rf "$dir"
        mv "$dir.partial" "$dir"
    fi
}

failed=()
for v in $VERSIONS; do
    install_overlay "$v"
    dir=$ROOT/$v
    export_pp="$dir${PYTHONPATH:+:$PYTHONPATH}"
    got=$(PYTHONPATH="$export_pp" "$PY" -c 'import transformers; print(transformers.__version__)')
    if [ "$got" != "$v" ]; then
        echo "overlay $dir imports transformers $got, not $v" >&2
        exit 1
    fi
    # .venv's newer transformers pulls in `kernels`, whose current release an older transformers cannot import
    # (5.0: "Either a revision or a version must be specified" at import of any model). An environment with only
    # that transformers installed has no `kernels`: where the import fails, hide it behind a stub that raises
    # ImportError, which transformers treats as "not installed" (kernels only matter for CUDA hub kernels).
    if ! PYTHONPATH="$export_pp" "$PY" -c 'import transformers.activations' 2>/dev/null; then
        shadow=$ROOT/$v.no-kernels
        mkdir -p "$shadow/kernels"
        echo 'raise ImportError("kernels hidden by scripts/test-matrix.sh: too new for this transformers")' \
            > "$shadow/kernels/__init__.py"
        export_pp="$shadow:$export_pp"
        if ! PYTHONPATH="$export_pp" "$PY" -c 'import transformers.activations'; then
            echo "overlay $dir: transformers $v cannot import its models, even without kernels" >&2
            exit 1
        fi
        echo "== transformers $v: .venv's kernels hidden (too new for it)"
    fi
    echo "== transformers $v: ${TESTS[*]}"
    if ! PYTHONPATH="$export_pp" HF_HUB_OFFLINE=1 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"; then
        failed+=("$v")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "test-matrix: failures with transformers ${failed[*]}" >&2
    exit 1
fi
echo "test-matrix: all passed with transformers $VERSIONS"
