#!/usr/bin/env bash
# Eleventh session, call 2 (H200): the must-hold after the attend default became the FlashMLA
# split (AttendTuning.mosaic = MgpuTuning(design="flashmla"), one design for prompt and decode
# rows): every `pytest -m gpu` test in 4 processes, beside the serving loop's bit checks
# (device loop == Python loop, speculative == plain, decode_k == serial, scanned == unrolled).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
G1="tests/test_serving_paths.py tests/test_bitwise.py tests/test_attend_kernel.py"
G2="tests/test_model.py tests/test_gpu_serving.py tests/test_serve_loop.py tests/test_index_ring.py"
G3="tests/test_kernels.py tests/test_selection_kernels.py tests/test_pool_scores_mgpu.py tests/test_pool_topk_triton.py tests/test_rms_norm_kernel.py"
G4="tests/test_write_kernels.py tests/test_matmul_kernel.py tests/test_implementation.py tests/test_dispatch.py tests/test_checkpoint.py tests/test_step_errors.py tests/test_reliability_properties.py tests/test_reliability_findings.py tests/test_hf_parity.py"
i=0
for g in "$G1" "$G2" "$G3" "$G4"; do
  i=$((i+1))
  (timeout 330 python3 -m pytest -q -m gpu $g > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 330 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 1 2 3 4; do tail -4 $OUT/pytest$i.log; done
tail -14 $OUT/loop-checks.log
