#!/usr/bin/env bash
# Tenth session, call 2 (H200, warm after call 1): pool keys stored in the index cache dtype (bf16 for GLM-5.3),
# Call 1 stopped at the compiled Triton kernel's == claim for widened bf16 keys (the bound held; the
# claim is now made for the twin and interpret mode only); its earlier tests passed (the log).
# the Mosaic pool-scores kernel's "bf16x3" path for them. GPU tests of the kernels that read
# or write the keys (parity within the derived bound, batch independence with ==, the write
# kernels), the scores probe side by side (fp32 keys as before vs bf16 keys, the same values),
# then the bench's selection, memory and decode points.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 170 python3 -m pytest -q -m gpu -x \
  "tests/test_selection_kernels.py::test_pool_scores_of_bf16_keys" \
  "tests/test_selection_kernels.py::test_pool_scores_seq_range_bits_at_glm53_flash_shapes" \
  2>&1 | tee $OUT/pytest2.log | tail -3 || exit 1
timeout 170 python3 benchmarks/h200_pool_scores_mgpu.py --budget-s 80 --row-timeout-s 40 \
  --subsets triton mosaic-nohi-fuse-s4 bf16keys bf16keys-s2 bf16keys-s8 bf16keys-1c-s4 \
  bf16keys-bp128 bf16keys-triton --independence bf16keys \
  --out $OUT 2>&1 | grep -v "^start" | cut -c1-400 | tail -40
timeout 200 python3 -m benchmarks --no-hf --no-progress --only selection,memory,decode \
  --budget-s 120 --out $OUT --name h200-bench.json 2>&1 | tail -25
