#!/usr/bin/env bash
# Ninth session, call 1 (H200): the model's GEMMs on the row-invariant kernel read in place
# (5233576+): GPU tests of the kernel and the model, then the loop side by side with the
# model on XLA's GEMMs (gemm-xla: main before this change).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 220 python3 -m pytest -q -m gpu -x tests/test_matmul_kernel.py tests/test_model.py 2>&1 | tee $OUT/pytest1.log | tail -15
timeout 300 python3 benchmarks/h200_loop.py --only loop --loop-variants default gemm-xla --reps 3 --out $OUT/h200-loop.json 2>&1 | tail -12
