#!/usr/bin/env bash
# Twenty-eighth session, call 2: every GPU must-hold group after the top-k's default became
# rank="sort" (one program per row), six in parallel, with the loop's bit checks (as
# s27_call1.sh); then, on an H200 only, the bench's selection points (the device time left
# allowed no more).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G0="tests/test_attend_kernel.py tests/test_scaled_q_abs.py tests/test_matmul_kernel.py tests/test_output_projection.py tests/test_colaunch.py tests/test_row_meta.py"
G1="tests/test_kernels.py tests/test_write_kernels.py tests/test_rms_norm_kernel.py tests/test_pool_scores_mgpu.py"
G2="tests/test_selection_kernels.py"
G3="tests/test_serving_paths.py tests/test_gpu_serving.py"
G4="tests/test_model.py tests/test_bitwise.py"
G5="tests/test_pool_topk_triton.py"
for i in 0 1 2 3 4 5; do
  eval files=\$G$i
  (timeout 250 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 250 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2 3 4 5; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[0-5].log > $OUT/h200-gpu-tests.log; rm $OUT/pytest[0-5].log
case "$gpu" in
  *H200*) timeout 80 python3 -m benchmarks --no-hf --no-progress --only selection --budget-s 60 --out $OUT --name h200-bench.json 2>&1 | tail -6;;
  *) echo "not an H200: no bench";;
esac
