#!/usr/bin/env bash
# Twelfth session, call 4 (H200; the device budget's last): the split merge's blocks (new
# default 8192 elements per program at 4 warps: 256 columns at 2 splits, 32 at 16) beside
# 1024 (the old 32 columns at 2 splits), 4096, and 8 warps, each checked (derived bound, equality
# to the base recorded) and timed on A and B. Then the must-hold on the new default, three
# processes without preallocation: decode_k == serial and the serving paths, the model and
# bitwise tests (pytest -m gpu), and the serving loop's bit checks.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 170 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --base mosaic-flashmla \
  --variants mosaic-flashmla-m1024,mosaic-flashmla-m4096,mosaic-flashmla-m8192w8,mosaic-flashmla-m16384w8 \
  --shapes ab --limit-s 50,115 --out $OUT/h200-attend.json 2>&1 | grep -vE "^ +(anon|input)" | tail -34
export XLA_PYTHON_CLIENT_PREALLOCATE=false
(timeout 320 python3 -m pytest -q -m gpu tests/test_serving_paths.py > $OUT/pytest1.log 2>&1; echo "rc=$?" >> $OUT/pytest1.log) &
(timeout 320 python3 -m pytest -q -m gpu tests/test_model.py tests/test_bitwise.py > $OUT/pytest2.log 2>&1; echo "rc=$?" >> $OUT/pytest2.log) &
timeout 320 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 1 2; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR" $OUT/pytest*.log | head -10
tail -14 $OUT/loop-checks.log
