#!/usr/bin/env bash
# Thirtieth session, call 10: call 9's one failure was test_model's count of the co-launched
# top-k's operands (5 -> 6: pos and valid in place of a computed pv), before its bit checks:
# test_model's GPU tests again, beside the loop's bit checks (scanned == unrolled, device
# loop == Python loop, speculative == plain, decode_k == serial decodes).
source benchmarks/device_runs/prelude.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
(timeout 300 python3 -m pytest -q -m gpu tests/test_model.py > $OUT/pytest-model.log 2>&1; echo "rc=$?" >> $OUT/pytest-model.log) &
timeout 300 python3 benchmarks/h200_loop.py --only checks --out $OUT/loop-checks.json > $OUT/loop-checks.log 2>&1
wait
grep -E "passed|failed|rc=" $OUT/pytest-model.log | tail -2
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest-model.log | head -8
tail -8 $OUT/loop-checks.log
