#!/usr/bin/env bash
# Twelfth session, call 1 (H200): two levers of the FlashMLA-split attend kernel beside the
# library's default (base mosaic-flashmla: every other variant must equal it bitwise), each
# checked on every case (derived bound, unselected rows NaN) then timed on A, B and the prompt
# chunk P: qk_ahead (the next tile's logits issued behind P @ V) and qk_ahead + early_gather
# (the converter's first two tiles' loads issued together). Then the bench's decode, kernel
# and selection points on this host (decode-b64 and verify-b1-k3 with their kernel time).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 280 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --base mosaic-flashmla --variants mosaic-flashmla-qk,mosaic-flashmla-qk-eg \
  --shapes abp --limit-s 80,200 --out $OUT/h200-attend.json 2>&1 | tail -40
timeout 230 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection \
  --budget-s 140 --out $OUT --name h200-bench.json 2>&1 | tail -22
