#!/usr/bin/env bash
# Fourteenth session, call 2 (H200): the library default now has direct_out and scale_heads=16
# (call 1: bitwise / within the bound and faster). The must-hold on that tree, in four
# processes without preallocation: the attend and kernel parity tests (pytest -m gpu),
# decode_k == serial and the serving paths, the model and bitwise tests, the loop's bit checks.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
export XLA_PYTHON_CLIENT_PREALLOCATE=false
(timeout 290 python3 -m pytest -q -m gpu tests/test_attend_kernel.py tests/test_kernels.py tests/test_attend_prep.py > $OUT/pytest0.log 2>&1; echo "rc=$?" >> $OUT/pytest0.log) &
(timeout 290 python3 -m pytest -q -m gpu tests/test_serving_paths.py > $OUT/pytest1.log 2>&1; echo "rc=$?" >> $OUT/pytest1.log) &
(timeout 290 python3 -m pytest -q -m gpu tests/test_model.py tests/test_bitwise.py > $OUT/pytest2.log 2>&1; echo "rc=$?" >> $OUT/pytest2.log) &
timeout 290 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR" $OUT/pytest*.log | head -10
tail -14 $OUT/loop-checks.log
