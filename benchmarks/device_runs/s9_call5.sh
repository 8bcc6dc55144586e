#!/usr/bin/env bash
# Ninth session, call 5 (H200): call 4 again after the RMSNorm kernel's fix (one indexer for
# the stacked weight's row and columns). GPU tests of the norm and the model (stop if they
# fail), the loop beside the model on XLA's GEMMs, the loop's bit checks at GLM shapes.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 110 python3 -m pytest -q -m gpu -x tests/test_rms_norm_kernel.py tests/test_model.py -k "stacked or row_invariant or same_bits" 2>&1 | tee $OUT/pytest5.log | tail -4 || exit 1
timeout 170 python3 benchmarks/h200_loop.py --only loop --loop-variants default gemm-xla --reps 3 --out $OUT/h200-loop.json 2>&1 | tail -6
timeout 240 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json 2>&1 | tail -12
