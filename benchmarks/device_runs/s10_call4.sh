#!/usr/bin/env bash
# Tenth session, call 4 (H200): the serving loop's bit checks at GLM shapes (device loop ==
# Python loop, speculative == plain, decode_k == serial, scanned == unrolled) after bf16 pool
# keys and the top-k's early exit; then the top-k's ranking variants at 64 rows (call 3: the
# exit saved 6% there against 20% at one row).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 260 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json 2>&1 | tail -14
timeout 150 python3 benchmarks/h200_topk_exit.py --out $OUT --cases b1-r4 b64 b64-r4 \
  --variants exit exit-s1 exit-s4 exit-rb64 exit-rb16 exit-fused exit-w8 exit-s4-rb16 \
  exit-s1-rb64 2>&1 | cut -c1-260 | tail -30
