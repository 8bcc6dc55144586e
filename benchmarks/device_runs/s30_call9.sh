#!/usr/bin/env bash
# Thirtieth session, call 9: lever RRR (a lone selection call runs no pass before its kernels:
# the Mosaic scores kernel takes the candidate counts, the expanding top-k the positions,
# from pos and valid). First the library's call beside the 3-launch program it replaces (`==`
# checked) in 12 interleaved rounds, groups of 10 and 160; then the must-holds in three
# groups: the kernels' new tests and the selection kernels; the serving paths (a prompt's
# selection runs it; decode_k == serial); model, bitwise, the co-launched top-k (the pv path)
# and test_kernels' top-k and selection tests. On an H200 the bench first.
source benchmarks/device_runs/prelude.sh
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14;;
  *) echo "not an H200: no bench";;
esac
timeout 150 python3 benchmarks/h200_gaps.py --sections launches --calls selection-b64-3launch,selection-b64-lib,selection-b64-r4-3launch,selection-b64-r4-lib --inners 10,160 --rounds 12 --traced-rounds 1 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|==|Error|rounds|^errors" | head -30
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
