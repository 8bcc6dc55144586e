#!/usr/bin/env bash
# Planned by the thirtieth session for the next one's first call. On an H200: the bench's
# decode, kernel, selection and prefill points (owed since the top-k's sort default, LLL, and
# RRR: each lone-call point now records its call floor), then the must-holds on the H200 in
# three groups (RRR's kernels and the selection kernels; the serving paths with decode_k ==
# serial; model, bitwise, co-launch, row metadata). On another card: the groups only.
source benchmarks/device_runs/prelude.sh
case "$gpu" in
  *H200*) timeout 200 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 175 --out $OUT --name h200-bench.json 2>&1 | tail -16;;
  *) echo "not an H200: no bench";;
esac
export XLA_PYTHON_CLIENT_PREALLOCATE=false
GA="tests/test_pool_scores_mgpu.py::test_gpu_counts_from_positions_same_bits tests/test_selection_kernels.py"
GB="tests/test_serving_paths.py tests/test_gpu_serving.py"
GC="tests/test_model.py tests/test_bitwise.py tests/test_colaunch.py tests/test_row_meta.py"
for g in A B C; do
  eval files=\$G$g
  (timeout 350 python3 -m pytest -q -m gpu $files > $OUT/pytest$g.log 2>&1; echo "rc=$?" >> $OUT/pytest$g.log) &
done
wait
for g in A B C; do echo "group $g"; grep -E "passed|failed|rc=" $OUT/pytest$g.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -12
cat $OUT/pytest[ABC].log > $OUT/gpu-tests.log; rm $OUT/pytest[ABC].log
