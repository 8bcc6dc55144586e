#!/usr/bin/env bash
# Eleventh session, call 1 (H200): the attend kernel's FlashMLA split (MgpuTuning
# design="flashmla") beside the default: smoke case first (a hang costs 80 s), then every
# check case (parity against the jnp twin's bound, every unselected row NaN) and timings of
# A (64x1), B (128x2) and the 2048-row prompt chunk P.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 340 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --variants mosaic-flashmla --shapes abp --limit-s 80,240 --out $OUT/h200-attend.json 2>&1 | tail -40
