#!/usr/bin/env bash
# Fifteenth session, call 2 (H200): the scaled_q_abs kernel rebuilt after call 1 (one K loop, Triton-pipelined, the power of two on the f32 result), its tilings and the q_b GEMM writing bf16; a prompt scaled f16 q
# (pallas/scaled_q_abs.py) at prefill-9000's rows against XLA's forms, checked first; then, with
# bound_scales on in the default (the layer's prompt rows through that kernel, no prep), the
# prefill-9000 and decode-b1 kernel lists and the GPU must-hold tests in parallel.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 150 python3 benchmarks/h200_scaled_q.py --out $OUT/h200-scaled-q.json 2>&1 | grep -v "^WARNING" | tail -16
timeout 90 python3 benchmarks/h200_profile.py --top 16 --out $OUT/h200-profile.json 2>&1 | tail -34
export XLA_PYTHON_CLIENT_PREALLOCATE=false
(timeout 280 python3 -m pytest -q -m gpu tests/test_attend_kernel.py tests/test_kernels.py tests/test_scaled_q_abs.py > $OUT/pytest0.log 2>&1; echo "rc=$?" >> $OUT/pytest0.log) &
(timeout 280 python3 -m pytest -q -m gpu tests/test_serving_paths.py > $OUT/pytest1.log 2>&1; echo "rc=$?" >> $OUT/pytest1.log) &
(timeout 280 python3 -m pytest -q -m gpu tests/test_model.py tests/test_bitwise.py > $OUT/pytest2.log 2>&1; echo "rc=$?" >> $OUT/pytest2.log) &
timeout 280 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR" $OUT/pytest*.log | head -10
grep -E "^E  " $OUT/pytest*.log | head -10
tail -12 $OUT/loop-checks.log
