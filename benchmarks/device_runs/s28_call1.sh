#!/usr/bin/env bash
# Twenty-eighth session, call 1: the Pallas top-k's new variants (the winners sorted by a
# bitonic network, `rank="sort"`; the sample method, `select="sample"`) compiled and checked
# on the GPU (the top-k and slot tests of tests/test_selection_kernels.py), then timed side by
# side on the fused selection at b1-r4, b64 and b64-r4 (slots `==` the default's). Any card:
# the comparison is side by side; the card is in the JSON. Then, on an H200 only, the bench's
# decode, kernel, selection and prefill points on this tree (its top-k default unchanged).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 150 python3 -m pytest -q -m gpu tests/test_selection_kernels.py -k "topk or select_slots" > $OUT/gpu-tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed" $OUT/gpu-tests.log | tail -1
grep -E "^FAILED|^E  " $OUT/gpu-tests.log | head -8
timeout 240 python3 benchmarks/h200_select_levers.py --rounds 2 --cases b1-r4,b64,b64-r4 --splits split-kernel --topk s28 --out $OUT/select-levers.json 2>&1 | grep -v "^WARNING" | tail -20
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14;;
  *) echo "not an H200: no bench";;
esac
