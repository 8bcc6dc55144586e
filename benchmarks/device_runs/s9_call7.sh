#!/usr/bin/env bash
# Ninth session, call 7 (H200), the last ~4 device minutes: the latent write's norm and the
# indexer write's LayerNorm and ape read their stacked weights in place too (every weight of
# a layer now). The write kernels' stacked GPU test, the loop timed (default only), then
# scanned == unrolled at 8 GLM-5.3 layers x 1K with a 1-row step (what reading weights in
# place could break).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 60 python3 -m pytest -q -m gpu -x tests/test_write_kernels.py -k stacked 2>&1 | tee $OUT/pytest7.log | tail -2 || exit 1
timeout 75 python3 benchmarks/h200_loop.py --only loop --loop-variants default --reps 3 --out $OUT/h200-loop.json 2>&1 | tail -4
timeout 120 python3 -c "
import time; t = time.perf_counter()
from benchmarks.loop_checks import check_scan_equals_unrolled
from dsa_jax.shapes import glm53_flash
cfg = glm53_flash(implementation='pallas', max_context=1024, indexer_types=('full', 'shared') * 4)
print('scan_equals_unrolled[glm8,ctx1024]', check_scan_equals_unrolled(cfg, 256), round(time.perf_counter() - t, 1), 's')
" 2>&1 | tail -2 | tee $OUT/scan-check.txt
