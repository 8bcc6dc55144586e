#!/usr/bin/env bash
# Tenth session, call 3 (H200): the Pallas top-k's radix select stops at the first threshold
# with exactly k keys at or above it (`PoolTopkTuning.early_exit`). Its GPU tests (== the
# total order, the exits' cases), the exit on/off side by side on GLM pool scores, decode_k ==
# serial at GLM per-rank shapes on the default (row-invariant GEMM) decode, then the bench's
# selection, decode and prefill points (bf16 pool keys and the exit together).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 120 python3 -m pytest -q -m gpu -x tests/test_kernels.py tests/test_selection_kernels.py \
  -k "topk" 2>&1 | tee $OUT/pytest3.log | tail -3 || exit 1
timeout 150 python3 benchmarks/h200_topk_exit.py --out $OUT 2>&1 | cut -c1-300 | tail -22
timeout 200 python3 -m pytest -q -m gpu -x tests/test_serving_paths.py \
  -k "row_invariant_gemms_at_glm53" 2>&1 | tee $OUT/pytest3b.log | tail -3
timeout 170 python3 -m benchmarks --no-hf --no-progress --only selection,decode,prefill \
  --budget-s 110 --out $OUT --name h200-bench.json 2>&1 | tail -14
