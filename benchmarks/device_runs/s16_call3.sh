#!/usr/bin/env bash
# Sixteenth session, call 3 (H200): the default after call 2 with the raw Triton top-k only for
# a prompt's rows (AUTO_TRITON_MIN_ROWS 2048: decode and verify steps back on the Pallas
# kernel). First two sweeps at prefill-9000's rows (the scaled_q_abs apart form's tiles from
# bf16 q; the Triton top-k's digits and warps), then every GPU must-hold test (five groups in
# parallel with the loop's bit checks), then the bench.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 100 python3 benchmarks/h200_scaled_q.py --bf16-sweep --out $OUT/h200-scaled-q.json 2>&1 | grep -v "^WARNING" | cut -c1-200 | tail -10
timeout 100 python3 benchmarks/h200_topk_triton.py --prefill-only --budget-s 80 --out $OUT 2>&1 | grep -v "^WARNING" | python3 -c "
import sys, json
for l in sys.stdin:
    try: r = json.loads(l)
    except Exception: print(l.rstrip()[:200]); continue
    print(r.get('variant'), r.get('ok'), r.get('kernel_us'), r.get('wall_us'), r.get('error', ''))"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G0="tests/test_attend_kernel.py tests/test_scaled_q_abs.py"
G1="tests/test_kernels.py tests/test_selection_kernels.py tests/test_pool_topk_triton.py"
G2="tests/test_serving_paths.py"
G3="tests/test_model.py tests/test_bitwise.py"
for i in 0 1 2 3; do
  eval files=\$G$i
  (timeout 330 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 330 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2 3; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR" $OUT/pytest*.log | head -10
grep -E "^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[0-3].log > $OUT/h200-gpu-tests.log; rm $OUT/pytest[0-3].log
unset XLA_PYTHON_CLIENT_PREALLOCATE
timeout 200 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 170 --out $OUT --name h200-bench.json 2>&1 | tail -12
