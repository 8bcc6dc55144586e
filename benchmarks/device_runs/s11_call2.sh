#!/usr/bin/env bash
# Eleventh session, call 2 (H200): FlashMLA-split variants beside the exchange design, each
# checked on every case (derived bound, unselected rows NaN) then timed on A, B and the prompt
# chunk P: the split with slots staged in shared memory (the new default), call 1's kernel
# (slots read per tile), and 2 converter warpgroups (half the rows each, two tiles ahead).
# The 2-converter kernel runs in its own invocation: a setmaxnreg hang there costs only it.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 300 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --variants mosaic-flashmla,mosaic-flashmla-noslots --shapes abp --limit-s 80,200 \
  --out $OUT/h200-attend.json 2>&1 | tail -40
timeout 230 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --variants mosaic-flashmla-c2 --shapes abp --limit-s 60,160 \
  --out $OUT/h200-attend-c2.json 2>&1 | tail -22
