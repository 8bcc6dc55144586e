#!/usr/bin/env bash
# Ninth session, call 6 (H200): every GPU test of the RMSNorm kernel (changed for the stacked
# weights) and the GPU serving tests (the engine's speculative == plain compiled, dsa-jax
# parity) on the final kernels.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 200 python3 -m pytest -q -m gpu tests/test_rms_norm_kernel.py tests/test_gpu_serving.py 2>&1 | tee $OUT/pytest6.log | tail -4
