#!/usr/bin/env bash
# Twenty-first session, call 3 (H200): the split merge's warps and columns at decode-b1's 33
# splits and 64x1's 2 ("d", "a"; the library's merge at 4 warps and 32 columns the base, the
# prep's slots now by a program of their own), then prefill-9000 with scale_q_abs's new
# default (scale "amax" for a prompt's bf16 rows): the bench point and its kernel list, and
# decode-b1's kernel list.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 200 python3 benchmarks/h200_attend.py --groups mosaic-all --shapes da --limit-s 190 --base mosaic-lib --variants mosaic-lib-mw8,mosaic-lib-mc16-w8,mosaic-lib-mc64-w8,mosaic-lib-mw2 --out $OUT/h200-attend.json 2>&1 | tail -14
timeout 100 python3 -m benchmarks --no-hf --no-progress --only prefill --budget-s 80 --out $OUT --name h200-bench.json 2>&1 | grep prefill-9000
timeout 150 python3 benchmarks/h200_profile.py --top 30 --steps prefill-9000 decode-b1-k1-tp1 --out $OUT/h200-profile.json 2>&1 | grep -v "^WARNING" | tail -1
python3 -c "
import json; r = json.load(open('$OUT/h200-profile.json'))
for row in r['rows']:
    print(row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
    for k in row['top'][:14]: print('   %9.2f %s' % (k['us_per_step'], k['name'][:70]))"
