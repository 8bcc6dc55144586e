#!/usr/bin/env bash
# Sixteenth session, call 2 (H200): the default with EE (a prompt's q_b GEMM writing bf16 q,
# the scaled_q_abs kernel's apart form for bf16 rows: ScaledQAbsTuning.squares_apart None) and
# the raw Triton top-k for 16+ rows (PoolTopkTuning(backend="auto"), the gpu extra's
# jax-triton installed from the carried wheel): the prefill-9000 and decode-b1 kernel lists,
# the GPU must-hold tests in parallel with the loop's bit checks, then the bench.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 100 python3 benchmarks/h200_profile.py --top 18 --out $OUT/h200-profile.json 2>&1 | grep -v "^WARNING" | tail -40
export XLA_PYTHON_CLIENT_PREALLOCATE=false
(timeout 300 python3 -m pytest -q -m gpu tests/test_attend_kernel.py tests/test_kernels.py tests/test_scaled_q_abs.py tests/test_selection_kernels.py tests/test_pool_topk_triton.py > $OUT/pytest0.log 2>&1; echo "rc=$?" >> $OUT/pytest0.log) &
(timeout 300 python3 -m pytest -q -m gpu tests/test_serving_paths.py > $OUT/pytest1.log 2>&1; echo "rc=$?" >> $OUT/pytest1.log) &
(timeout 300 python3 -m pytest -q -m gpu tests/test_model.py tests/test_bitwise.py > $OUT/pytest2.log 2>&1; echo "rc=$?" >> $OUT/pytest2.log) &
timeout 300 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR" $OUT/pytest*.log | head -10
grep -E "^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest0.log $OUT/pytest1.log $OUT/pytest2.log > $OUT/h200-gpu-tests.log; rm $OUT/pytest*.log
unset XLA_PYTHON_CLIENT_PREALLOCATE
timeout 200 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 170 --out $OUT --name h200-bench.json 2>&1 | tail -12
