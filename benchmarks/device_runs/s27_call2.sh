#!/usr/bin/env bash
# Twenty-seventh session, call 2: the bench's decode, kernel, selection and prefill points on
# this session's tree, on an H200 only (call 1 ran on an H100: the device tool may run an
# nvidia-h200 call on either; on another card this exits at once). The tree's kernels are
# call 1's (its GPU must-hold groups passed there, on the H100).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
case "$gpu" in *H200*) ;; *) echo "not an H200: nothing run"; exit 3;; esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 165 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 135 --out $OUT --name h200-bench.json 2>&1 | tail -14
