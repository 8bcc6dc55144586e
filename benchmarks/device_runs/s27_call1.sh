#!/usr/bin/env bash
# Twenty-seventh session, call 1 (H200): the selection levers (the Mosaic scores kernel
# splitting a decode row's qi itself, `kernel_heads`; the bench point through
# `select.select_slots`) checked and timed side by side, then the bench's decode, kernel,
# selection and prefill points on this tree (s26's f16 attend partials included), then every
# GPU must-hold group, six in parallel, with the loop's bit checks (as s26_call3.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 140 python3 benchmarks/h200_select_levers.py --rounds 2 --out $OUT/h200-select-levers.json 2>&1 | grep -v "^WARNING" | tail -16
timeout 160 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 140 --out $OUT --name h200-bench.json 2>&1 | tail -14
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G0="tests/test_attend_kernel.py tests/test_scaled_q_abs.py tests/test_matmul_kernel.py tests/test_output_projection.py tests/test_colaunch.py tests/test_row_meta.py"
G1="tests/test_kernels.py tests/test_write_kernels.py tests/test_rms_norm_kernel.py tests/test_pool_scores_mgpu.py"
G2="tests/test_selection_kernels.py"
G3="tests/test_serving_paths.py tests/test_gpu_serving.py"
G4="tests/test_model.py tests/test_bitwise.py"
G5="tests/test_pool_topk_triton.py"
for i in 0 1 2 3 4 5; do
  eval files=\$G$i
  (timeout 280 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 280 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2 3 4 5; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[0-5].log > $OUT/h200-gpu-tests.log; rm $OUT/pytest[0-5].log
