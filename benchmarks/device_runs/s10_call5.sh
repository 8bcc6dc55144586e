#!/usr/bin/env bash
# Tenth session, call 5 (H200, tree 62be610): the bench for BENCHMARKS.md after bf16 pool keys
# and the top-k's early exit (decode, kernels, selection, prefill, memory), then the loop.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 280 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill,memory \
  --budget-s 160 --out $OUT --name h200-bench.json 2>&1 | tail -20
timeout 100 python3 benchmarks/h200_loop.py --only loop --loop-variants default --reps 3 \
  --out $OUT/h200-loop.json 2>&1 | tail -5
