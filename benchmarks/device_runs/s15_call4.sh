#!/usr/bin/env bash
# Fifteenth session, call 4 (H200; ~5 device minutes were left): the scaled_q_abs kernel's
# squares_apart form (the bound's squares in a loop of their own, bf16 rows read as they are;
# off by default) checked and timed beside the default, from f32 and bf16 q; then the bench's
# prefill point on the default of calls 1-2 (bound_scales on, the one-loop kernel from f32 q;
# every GPU must-hold passed on it in call 2).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 90 python3 benchmarks/h200_scaled_q.py --out $OUT/h200-scaled-q.json 2>&1 | grep -v "^WARNING" | cut -c1-260 | tail -12
timeout 150 python3 -m benchmarks --no-hf --no-progress --only prefill --budget-s 100 --out $OUT --name h200-bench.json 2>&1 | tail -8
