#!/usr/bin/env bash
# Ninth session, call 2 (H200): the loop's bit checks at GLM-5.3-Flash shapes on the model with
# the row-invariant GEMMs in place (device loop == Python loop, speculative == plain with the
# n-gram and draft-model drafters, scanned == unrolled with a 1-row step), then the GPU
# serving tests.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 400 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json 2>&1 | tail -25
timeout 170 python3 -m pytest -q -m gpu tests/test_gpu_serving.py tests/test_serve_loop.py tests/test_model.py -k "glm or serving or engine or parity" 2>&1 | tee $OUT/pytest2.log | tail -8
