#!/usr/bin/env bash
# Nineteenth session, call 4 (H200): the model's scan co-launches too (the top-k and the
# stacked q_b GEMM read in place, `model._block`): the GPU must-hold groups that run the scan
# or the step (serving paths, model + bitwise, the co-launch's tests; the kernel groups passed
# on these kernels in call 3) in parallel with the loop's bit checks, then the serving loop's
# points with cfg.colaunch on and off (the GPU alone; the default program only).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G0="tests/test_colaunch.py"
G3="tests/test_serving_paths.py"
G4="tests/test_model.py tests/test_bitwise.py"
for i in 0 3 4; do
  eval files=\$G$i
  (timeout 225 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 225 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 3 4; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[034].log > $OUT/h200-gpu-tests.log; rm $OUT/pytest[034].log
unset XLA_PYTHON_CLIENT_PREALLOCATE
for c in on off; do
  timeout 60 python3 benchmarks/h200_loop.py --only loop --loop-variants default --colaunch $c --out $OUT/h200-loop-colaunch-$c.json 2>&1 | tail -4
done
