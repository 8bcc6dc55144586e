#!/usr/bin/env bash
# Twenty-second session, call 3 (H200), the same tree as call 2 (only h200_gaps.py's Mosaic
# row written as a `plgpu.kernel`): prefill-9000 in the bench (call 2's budget ran out before
# it), what a lone call's wall is made of (`h200_gaps.py`), and the must-hold groups that did
# not finish in call 2's limit (serving paths, model + bitwise, the Triton top-k) with the
# loop's bit checks, three groups in parallel.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 90 python3 -m benchmarks --no-hf --no-progress --only prefill --budget-s 70 --out $OUT --name h200-bench.json 2>&1 | tail -4
timeout 70 python3 benchmarks/h200_gaps.py --out $OUT/h200-gaps.json 2>&1 | grep -v "^WARNING" | cut -c1-200 | tail -10
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G3="tests/test_serving_paths.py"
G4="tests/test_model.py tests/test_bitwise.py"
G5="tests/test_pool_topk_triton.py"
for i in 3 4 5; do
  eval files=\$G$i
  (timeout 290 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 290 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 3 4 5; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[3-5].log > $OUT/h200-gpu-tests.log; rm $OUT/pytest[3-5].log
