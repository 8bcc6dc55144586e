#!/usr/bin/env bash
# Thirteenth session, call 3 (H200): pv_behind rewritten in FlashAttention 3's form (tile t's
# logits and tile t - 1's P @ V issued together, the logits waited for alone, the softmax
# beside that P @ V, both retired by the iteration's end: no wgmma in flight across the loop's
# back edge) beside the library's default (base mosaic-flashmla), which now reads the cache's
# scale in the kernel (no XLA concatenate, no zero row: two launches fewer per attend).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 300 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --base mosaic-flashmla --variants mosaic-flashmla-pvb \
  --shapes abp --limit-s 90,200 --out $OUT/h200-attend.json 2>&1 | tail -24
