#!/usr/bin/env bash
# Planned by the twenty-eighth session for the next one's first call (an H200 for the bench:
# check the card): the bench's decode, kernel, selection and prefill points on the top-k's
# sort default (LLL, measured on an H100 only), then every GPU must-hold group with the limits
# s28_call2.sh cut short (serving paths with decode_k == serial, model + bitwise, kernels,
# the loop's bit checks), six in parallel.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14;;
  *) echo "not an H200: no bench";;
esac
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G0="tests/test_attend_kernel.py tests/test_scaled_q_abs.py tests/test_matmul_kernel.py tests/test_output_projection.py tests/test_colaunch.py tests/test_row_meta.py"
G1="tests/test_kernels.py tests/test_write_kernels.py tests/test_rms_norm_kernel.py tests/test_pool_scores_mgpu.py"
G2="tests/test_selection_kernels.py"
G3="tests/test_serving_paths.py tests/test_gpu_serving.py"
G4="tests/test_model.py tests/test_bitwise.py"
G5="tests/test_pool_topk_triton.py"
for i in 0 1 2 3 4 5; do
  eval files=\$G$i
  (timeout 290 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 290 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2 3 4 5; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[0-5].log > $OUT/h200-gpu-tests.log; rm $OUT/pytest[0-5].log
