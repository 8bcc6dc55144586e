#!/usr/bin/env bash
# Fifteenth session, call 4 (H200): the scaled_q_abs kernel with its bound's squares in a loop of
# their own (call 3: bf16 rows feeding both the dot and the squares came out wrong) and a
# prompt's q_b GEMM writing bf16 (the kernel then reads bf16 q): the kernel from f32 and bf16 q,
# checked and timed; the GPU must-hold tests in parallel; then the bench's prefill point.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 100 python3 benchmarks/h200_scaled_q.py --out $OUT/h200-scaled-q.json 2>&1 | grep -v "^WARNING" | cut -c1-300 | tail -12
export XLA_PYTHON_CLIENT_PREALLOCATE=false
(timeout 280 python3 -m pytest -q -m gpu tests/test_attend_kernel.py tests/test_kernels.py tests/test_scaled_q_abs.py > $OUT/pytest0.log 2>&1; echo "rc=$?" >> $OUT/pytest0.log) &
(timeout 280 python3 -m pytest -q -m gpu tests/test_serving_paths.py > $OUT/pytest1.log 2>&1; echo "rc=$?" >> $OUT/pytest1.log) &
(timeout 280 python3 -m pytest -q -m gpu tests/test_model.py tests/test_bitwise.py > $OUT/pytest2.log 2>&1; echo "rc=$?" >> $OUT/pytest2.log) &
timeout 280 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR" $OUT/pytest*.log | head -10
grep -E "^E  " $OUT/pytest*.log | head -10
tail -10 $OUT/loop-checks.log
unset XLA_PYTHON_CLIENT_PREALLOCATE
timeout 110 python3 -m benchmarks --no-hf --no-progress --only prefill --budget-s 90 --out $OUT --name h200-bench.json 2>&1 | tail -6
