#!/usr/bin/env bash
# Fourteenth session, call 5 (H200): bound_scales as rebuilt after call 4 (XLA did not fuse a jnp scale and
# conversion into the U_k GEMM): the scale now on the GEMM's input, its f16 result the
# epilogue (projection.scaled_q_abs); no prep. The prefill-9000 and decode-b1 kernel lists first,
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
