#!/usr/bin/env bash
# Sixteenth session, call 1 (planned by the fifteenth session for its successor's first call; the fifteenth's device time ran
# out before it: four calls, then refusals): the scaled_q_abs kernel's squares_apart form (the
# bound's squares in a loop of their own, bf16 rows read as they are; off by default, never run on
# a GPU) checked and timed beside the default from f32 and bf16 q, its GPU tests; then the bench
# on the default of the fifteenth session's calls 1-2 (bound_scales on, the one-loop kernel from
# f32 q; every GPU must-hold passed on it in call 2). If the apart form is right and faster, the
# next step is squares_apart on with a prompt's q_b GEMM writing bf16 (git show 8d25d17 --
# dsa_jax/projection.py) and the must-hold tests again.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 90 python3 benchmarks/h200_scaled_q.py --out $OUT/h200-scaled-q.json 2>&1 | grep -v "^WARNING" | cut -c1-260 | tail -12
timeout 120 python3 -m pytest -q -m gpu tests/test_scaled_q_abs.py > $OUT/pytest0.log 2>&1; tail -3 $OUT/pytest0.log
timeout 200 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 170 --out $OUT --name h200-bench.json 2>&1 | tail -8
