#!/usr/bin/env bash
# Run by the seventeenth session as s17_call1.sh and s17_call2.sh (its groups there).
# Planned by the sixteenth session (its device time ran out before it: "too little device-machine
# time is left"). First make the two defaults that call 3's sweeps measured faster alone (both
# checked on the GPU there at prefill-9000's rows): ScaledQAbsTuning's apart form at 64 x 512
# for bf16 rows (642.6 vs 714.6 us, h200-scaled-q-20261202-s16-call3.json) and
# TritonTopkTuning's "auto" radix with 4-bit digits for a prompt's rows (635.3 vs 698.2 us,
# h200-topk-triton-20261202-s16-call3.json); predicted prefill-9000 10.07 -> ~9.94 ms. Then
# this call: the prefill bench point, then the two kernels' GPU tests; then the must-hold
# groups of s16_call3.sh (give tests/test_kernels.py a group of its own: with the selection and
# top-k files beside it the group ran past 330 s in calls 2 and 3, no failure seen).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 110 python3 -m benchmarks --no-hf --no-progress --only prefill --budget-s 90 --out $OUT --name h200-bench.json 2>&1 | tail -4
timeout 60 python3 -m pytest -q -m gpu tests/test_scaled_q_abs.py tests/test_pool_topk_triton.py > $OUT/h200-gpu-tests.log 2>&1; tail -3 $OUT/h200-gpu-tests.log
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G0="tests/test_attend_kernel.py tests/test_scaled_q_abs.py tests/test_pool_topk_triton.py"
G1="tests/test_kernels.py"
G2="tests/test_selection_kernels.py"
G3="tests/test_serving_paths.py"
G4="tests/test_model.py tests/test_bitwise.py"
for i in 0 1 2 3 4; do
  eval files=\$G$i
  (timeout 330 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 330 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2 3 4; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[0-4].log >> $OUT/h200-gpu-tests.log; rm $OUT/pytest[0-4].log
