#!/usr/bin/env bash
# Fourteenth session, call 1 (written in the thirteenth as planned_next_call1.sh, whose device
# time ran out first): the two attend levers built then, each off by default, lowered on the CPU only.
# 1. MgpuTuning.direct_out: a prompt's one-split bf16 result written by the Mosaic kernel
#    itself, beside the f32 partial and the merge kernel's cast: bitwise and timed on the
#    2048-row prompt chunk (h200_direct_out.py).
# 2. MgpuTuning.scale_heads=16/32: one q scale per head group, the prep one program per (row,
#    group): checked on every case against the derived bound (other last bits than the base,
#    RESCALED), timed on A, B, P beside the library's default (h200_attend.py).
# Then the prefill-9000 and decode-b1 kernels on the default (h200_profile.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 60 python3 benchmarks/h200_direct_out.py --out $OUT/h200-direct-out.json 2>&1 | tail -4
timeout 300 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --base mosaic-flashmla --variants mosaic-flashmla-sh16,mosaic-flashmla-sh32 \
  --shapes abp --limit-s 90,200 --out $OUT/h200-attend.json 2>&1 | tail -24
timeout 70 python3 benchmarks/h200_profile.py --top 14 --out $OUT/h200-profile.json 2>&1 | tail -32
