#!/usr/bin/env bash
# Twentieth session, call 1 (H200): the step's row metadata in one program beside the x
# projection's GEMM (`pallas/row_meta.py`, `layer.meta_and_x_projection`). First the bench's
# decode points and decode-b1's kernel list with the co-launches on and off (the GPU alone
# for the timings), then the GPU groups the change touches, in parallel with the loop's bit
# checks.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 130 python3 -m benchmarks --no-hf --no-progress --only decode --budget-s 110 --out $OUT --name h200-bench.json 2>&1 | tail -8
for c in on off; do
  flag=""; [ $c = off ] && flag="--colaunch off"
  timeout 60 python3 benchmarks/h200_profile.py --top 30 --steps decode-b1-k1-tp1 $flag --out $OUT/h200-profile-colaunch-$c.json 2>&1 | grep -v "^WARNING" | tail -1
done
python3 -c "
import json
for c in ('on', 'off'):
    r = json.load(open('$OUT/h200-profile-colaunch-%s.json' % c))
    for row in r['rows']:
        print(c, row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
        for k in row['first_call']: print('   %8.2f %s' % (k['us'], k['name'][:70]))"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G0="tests/test_row_meta.py tests/test_colaunch.py tests/test_write_kernels.py tests/test_matmul_kernel.py"
G1="tests/test_selection_kernels.py"
G2="tests/test_serving_paths.py"
G3="tests/test_model.py tests/test_bitwise.py"
for i in 0 1 2 3; do
  eval files=\$G$i
  (timeout 250 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 250 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2 3; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[0-3].log > $OUT/h200-gpu-tests.log; rm $OUT/pytest[0-3].log
