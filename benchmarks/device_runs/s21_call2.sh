#!/usr/bin/env bash
# Twenty-first session, call 2 (H200): three levers side by side, each checked first.
# (1) scaled_q_abs with the power of two from its own f32 result's amax (scale="amax": no
#     squares loop) beside the default (bound, apart) at prefill-9000's 9000 rows;
# (2) the attend's split merge at 8 columns per program past 16 splits (decode-b1's 33) and
#     (3) the prep's slots by a program of their own, against the library's earlier merge and
#     prep (mosaic-lib-mc32, -slots0, -s20) on decode-b1's attend ("d") and 64x1 ("a");
# then decode-b1's kernel list on the new defaults, then the GPU tests of the attend and
# scaled_q_abs (the amax cases compiled).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 150 python3 benchmarks/h200_scaled_q.py --amax --out $OUT/h200-scaled-q.json 2>&1 | grep -v "^WARNING" | cut -c1-330
timeout 230 python3 benchmarks/h200_attend.py --groups mosaic-all --shapes da --limit-s 220 --base mosaic-lib --variants mosaic-lib-mc32,mosaic-lib-slots0,mosaic-lib-s20 --out $OUT/h200-attend.json 2>&1 | tail -14
timeout 60 python3 benchmarks/h200_profile.py --top 30 --steps decode-b1-k1-tp1 --out $OUT/h200-profile.json 2>&1 | grep -v "^WARNING" | tail -1
python3 -c "
import json; r = json.load(open('$OUT/h200-profile.json'))
for row in r['rows']:
    print(row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
    for k in row['first_call']: print('   %8.2f %s' % (k['us'], k['name'][:70]))"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python3 -m pytest -q -m gpu tests/test_attend_kernel.py tests/test_scaled_q_abs.py > $OUT/h200-gpu-tests.log 2>&1; echo "rc=$?" >> $OUT/h200-gpu-tests.log
grep -E "passed|failed|rc=" $OUT/h200-gpu-tests.log | tail -2
grep -E "^FAILED|^ERROR|^E  " $OUT/h200-gpu-tests.log | head -10
