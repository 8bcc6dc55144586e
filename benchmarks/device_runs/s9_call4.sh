#!/usr/bin/env bash
# Ninth session, call 4 (H200): the pre-block and q_a RMSNorms read their stacked weights in
# place too. GPU tests of the norm and the model, the loop timed beside the model on XLA's
# GEMMs (gemm-xla, as in call 1), then the loop's bit checks at GLM shapes again.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 100 python3 -m pytest -q -m gpu -x tests/test_rms_norm_kernel.py tests/test_model.py -k "stacked or row_invariant or same_bits" 2>&1 | tee $OUT/pytest4.log | tail -4
timeout 170 python3 benchmarks/h200_loop.py --only loop --loop-variants default gemm-xla --reps 3 --out $OUT/h200-loop.json 2>&1 | tail -6
timeout 240 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json 2>&1 | tail -12
