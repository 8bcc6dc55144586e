#!/usr/bin/env bash
# Eleventh session, call 4 (H200; the device budget's last): the must-hold on the final
# default (AttendTuning.mosaic = MgpuTuning(design="flashmla"), slots staged, for every row):
# decode_k == serial decodes, chunked/ragged prefills, scanned == unrolled and the bitwise
# options (pytest -m gpu, two processes, no preallocation: call 3's parallel runs ran out of
# memory), beside the serving loop's bit checks; then the bench alone on the GPU.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT
(timeout 220 python3 -m pytest -q -m gpu tests/test_serving_paths.py > $OUT/pytest1.log 2>&1; echo "rc=$?" >> $OUT/pytest1.log) &
(timeout 220 python3 -m pytest -q -m gpu tests/test_model.py tests/test_bitwise.py > $OUT/pytest2.log 2>&1; echo "rc=$?" >> $OUT/pytest2.log) &
timeout 220 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 1 2; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED" $OUT/pytest*.log | head -10
tail -14 $OUT/loop-checks.log
unset XLA_PYTHON_CLIENT_PREALLOCATE
timeout 250 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill,memory \
  --budget-s 150 --out $OUT --name h200-bench.json 2>&1 | tail -22
