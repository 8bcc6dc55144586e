#!/usr/bin/env bash
# Written in the thirteenth session for the next one (its device time ran out before this
# ran): the Mosaic attend writing a prompt's bf16 result itself (MgpuTuning.direct_out, one
# split; off by default until this passes) beside the f32 partial and the merge kernel's
# cast, bitwise and timed on the 2048-row prompt chunk; then the prefill-9000 and decode-b1
# kernels (h200_profile.py) on the default.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 60 python3 benchmarks/h200_direct_out.py --out $OUT/h200-direct-out.json 2>&1 | tail -4
timeout 70 python3 benchmarks/h200_profile.py --top 14 --out $OUT/h200-profile.json 2>&1 | tail -32
