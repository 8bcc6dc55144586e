#!/usr/bin/env bash
# Fourteenth session, call 3 (H200): the bench's decode, kernel, selection and prefill points
# on the default with direct_out and scale_heads=16, then the prefill-9000 and decode-b1
# kernel lists (h200_profile.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 300 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill \
  --budget-s 170 --out $OUT --name h200-bench.json 2>&1 | tail -16
timeout 80 python3 benchmarks/h200_profile.py --top 14 --out $OUT/h200-profile.json 2>&1 | tail -32
