#!/usr/bin/env bash
# Fifteenth session, call 3 (H200): the scaled_q_abs kernel's tilings from f32 and from bf16 q
# (call 2's list stopped at a tiling ptxas refused, now recorded), and the q_b GEMM writing bf16
# itself (its bits against the f32 result rounded).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 200 python3 benchmarks/h200_scaled_q.py --out $OUT/h200-scaled-q.json 2>&1 | grep -v "^WARNING" | cut -c1-400 | tail -24
