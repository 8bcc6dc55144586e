#!/usr/bin/env bash
# Eleventh session, call 3 (H200): (1) the FlashMLA split with L2 prefetches of the rows 1 or
# 2 tiles past the gathered ones (MgpuTuning.prefetch) beside prefetch 0, each checked on every
# case and timed; (2) the must-hold with the library default now design="flashmla",
# prefetch=2 for every row: every `pytest -m gpu` test in 4 processes beside the serving
# loop's bit checks (device loop == Python loop, speculative == plain, decode_k == serial,
# scanned == unrolled).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 175 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --variants mosaic-flashmla,mosaic-flashmla-pf1,mosaic-flashmla-pf2 --shapes abp \
  --limit-s 50,120 --out $OUT/h200-attend.json 2>&1 | tail -24
G1="tests/test_serving_paths.py tests/test_bitwise.py tests/test_attend_kernel.py"
G2="tests/test_model.py tests/test_gpu_serving.py tests/test_serve_loop.py tests/test_index_ring.py"
G3="tests/test_kernels.py tests/test_selection_kernels.py tests/test_pool_scores_mgpu.py tests/test_pool_topk_triton.py tests/test_rms_norm_kernel.py"
G4="tests/test_write_kernels.py tests/test_matmul_kernel.py tests/test_implementation.py tests/test_dispatch.py tests/test_checkpoint.py tests/test_step_errors.py tests/test_reliability_properties.py tests/test_reliability_findings.py tests/test_hf_parity.py"
i=0
for g in "$G1" "$G2" "$G3" "$G4"; do
  i=$((i+1))
  (timeout 300 python3 -m pytest -q -m gpu $g > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 300 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 1 2 3 4; do grep -E "passed|failed|error|rc=" $OUT/pytest$i.log | tail -3; done
grep -E "FAILED|Error" $OUT/pytest*.log | head -10
tail -14 $OUT/loop-checks.log
