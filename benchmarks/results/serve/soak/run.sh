#!/usr/bin/env bash
# The soak of tests/test_serving_soak.py with its figures kept: `epikv serve` (random:tiny, epikv K = 64, pages of
# 8, 256 pages) on 127.0.0.1, 100 warm-up requests then 500 (prompts of 1-40 random tokens, 1-40 new tokens, half
# sampled at temperature 0.6 / top-p 0.95, a third streamed, one in ten dropped after its first event, one in twenty
# malformed), 16 client threads; CPU, 2 cores shared with other jobs. Then the same soak on `epikv serve --engine
# llama.cpp` (the embedded GGUF, epikv K = 64, 1,280 cells, 16 sequences, 1 thread) into llamacpp.json.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD/src EPIKV_SOAK_OUT=benchmarks/results/serve/soak/figures.json
"${PY:-.venv/bin/python}" -m pytest -q tests/test_serving_soak.py -k test_metrics_of_the_real_engine_and_soak
EPIKV_SOAK_OUT=benchmarks/results/serve/soak/llamacpp.json \
  "${PY:-.venv/bin/python}" -m pytest -q tests/test_llamacpp_serving.py -k test_soak_on_llama_cpp
