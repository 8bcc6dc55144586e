#!/usr/bin/env bash
# Fourteenth session, call 4 (H200): MgpuTuning.bound_scales on in the default (a prompt's q
# scaled per head from projection.q_abs_bound, converted to f16 in jnp for XLA to fuse into the
# U_k GEMM; no prep, no f32 q read back). The prefill-9000 and decode-b1 kernel lists first,
# then the GPU tests that run prompts (kernels, model, serving paths, bitwise) in parallel.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 80 python3 benchmarks/h200_profile.py --top 16 --out $OUT/h200-profile.json 2>&1 | tail -34
export XLA_PYTHON_CLIENT_PREALLOCATE=false
(timeout 290 python3 -m pytest -q -m gpu tests/test_attend_kernel.py tests/test_kernels.py > $OUT/pytest0.log 2>&1; echo "rc=$?" >> $OUT/pytest0.log) &
(timeout 290 python3 -m pytest -q -m gpu tests/test_serving_paths.py > $OUT/pytest1.log 2>&1; echo "rc=$?" >> $OUT/pytest1.log) &
(timeout 290 python3 -m pytest -q -m gpu tests/test_model.py tests/test_bitwise.py > $OUT/pytest2.log 2>&1; echo "rc=$?" >> $OUT/pytest2.log) &
timeout 290 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR" $OUT/pytest*.log | head -10
grep -E "^E  " $OUT/pytest*.log | head -10
tail -12 $OUT/loop-checks.log
