#!/usr/bin/env bash
# Thirteenth session, call 1 (H200): the pv_behind lever of the FlashMLA-split attend kernel
# (warpgroup 0's softmax of tile t beside its P @ V of tile t - 1; its last tile now run
# unconditionally, no wgmma under a branch) beside the library's default (base
# mosaic-flashmla: bitwise equal expected), checked on every case then timed on A, B, P; then
# where the short calls' wall time goes beyond their kernels (h200_gaps.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 300 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --base mosaic-flashmla --variants mosaic-flashmla-pvb \
  --shapes abp --limit-s 90,200 --out $OUT/h200-attend.json 2>&1 | tail -30
timeout 150 python3 benchmarks/h200_gaps.py --out $OUT/h200-gaps.json 2>&1 | tail -8
