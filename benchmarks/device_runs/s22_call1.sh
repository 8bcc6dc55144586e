#!/usr/bin/env bash
# Twenty-second session, call 1 (H200): the Triton top-k's prefix branches
# (`TritonTopkTuning.prefix`: a prompt row whose live pools all lie in the first quarter or
# half of its 4096 lanes is selected over those alone) against the same kernel without them on
# the 9000-row prompt's rows, each `==` lax.top_k; the attend prep at 4 and 8 warps (64x1 and
# decode-b1's attend, each checked); then prefill-9000 in the bench and its kernel list; last,
# the Triton top-k's GPU tests.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 150 python3 benchmarks/h200_topk_triton.py --prefill-only --budget-s 130 --out $OUT 2>&1 | grep -v "^WARNING" | cut -c1-400 | tail -8
timeout 170 python3 benchmarks/h200_attend.py --groups mosaic-all --shapes da --limit-s 160 --base mosaic-lib --variants mosaic-lib-pw4,mosaic-lib-pw8 --out $OUT/h200-attend.json 2>&1 | tail -12
timeout 100 python3 -m benchmarks --no-hf --no-progress --only prefill --budget-s 80 --out $OUT --name h200-bench.json 2>&1 | tail -6
timeout 80 python3 benchmarks/h200_profile.py --top 30 --steps prefill-9000 --out $OUT/h200-profile.json 2>&1 | grep -v "^WARNING" | tail -1
python3 -c "
import json; r = json.load(open('$OUT/h200-profile.json'))
for row in r['rows']:
    print(row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
    for k in row['first_call'][:40]: print('   %8.2f %s' % (k['us'], k['name'][:70]))"
timeout 150 python3 -m pytest -q -m gpu tests/test_pool_topk_triton.py 2>&1 | tail -4
