#!/usr/bin/env bash
# Thirteenth session, call 2 (H200): where the attend-kernel-64x1 and selection-b64 calls'
# wall time goes beyond their kernels, under four XLA command-buffer flag sets, each in a
# fresh process: the bench's calls, the attend on its arrays only, 8 attends in one program,
# the selection with cfg bound; per kernel the device's idle time before it.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 500 python3 benchmarks/h200_gaps.py --flags default,min1,all-min1,off \
  --out $OUT/h200-gaps.json 2>&1 | grep -v "^ *$" | cut -c1-400 | tail -40
