#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp that llama-cpp-python 0.3.36 vendors (the same kernels as
# `epikv serve --engine llama.cpp`), offline once the source is here: CMake, CPU only, portable (GGML_NATIVE off, as
# scripts/install.sh builds llama-cpp-python), no web UI download, no HTTPS. Not a test dependency: a yardstick for
# benchmarks (issue 40).
#
#   bash benchmarks/build_llama_server.sh [SDIST_DIR_OR_TARBALL] [BUILD_DIR]
#
# SDIST_DIR_OR_TARBALL: an unpacked llama_cpp_python-0.3.36 folder or its .tar.gz (default: fetched once with
# `pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36` into $EPIKV_CACHE_DIR/llama-server/).
# BUILD_DIR: default $EPIKV_CACHE_DIR/llama-server/build. Prints the binary's path last.
# Tried (issue 40): these CMake options configure offline and build llama-server in about 8 minutes on 2 shared
# cores; `llama-server --version` then reports the vendored commit. No side-by-side run yet: bench serve counts the
# token_ids epikv streams, which llama-server does not send.
set -euo pipefail
VERSION=0.3.36
CACHE=${EPIKV_CACHE_DIR:-$HOME/.cache/epikv}/llama-server
SRC=${1:-}
BUILD=${2:-$CACHE/build}
JOBS=${JOBS:-$(nproc)}
PY=${PY:-python3}
mkdir -p "$CACHE"
if [ -z "$SRC" ]; then
  tarball=$(ls "$CACHE"/llama_cpp_python-$VERSION.tar.gz 2>/dev/null || true)
  if [ -z "$tarball" ]; then
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$CACHE" >&2
    tarball="$CACHE/llama_cpp_python-$VERSION.tar.gz"
  fi
  SRC=$tarball
fi
if [ -f "$SRC" ]; then
  tar -xzf "$SRC" -C "$CACHE"
  SRC="$CACHE/llama_cpp_python-$VERSION"
fi
LLAMA="$SRC/vendor/llama.cpp"
[ -f "$LLAMA/tools/server/server-context.cpp" ] || { echo "no llama.cpp server source under $LLAMA" >&2; exit 2; }
cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$BUILD" --target llama-server -j "$JOBS" >&2
ls "$BUILD"/bin/llama-server
