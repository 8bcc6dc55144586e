#!/usr/bin/env bash
# Twelfth session, call 5 (H200; the last device minutes): what paces the attend kernel's
# tiles. Timing-only converters (benchmarks/attend_diag.py, patched in for one variant each,
# outputs wrong by design): no global loads of the latent rows (bytes from the slot indices,
# still converted and stored), and no loads, conversion or stores at all; beside the default,
# on A (64 x 1) and the prompt chunk P.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 170 python3 benchmarks/h200_attend.py --groups mosaic-all --base mosaic-flashmla \
  --variants diag-noload,diag-nostore --shapes ap --limit-s 160 \
  --out $OUT/h200-attend.json 2>&1 | grep -vE "^ +(input|loop)" | tail -14
