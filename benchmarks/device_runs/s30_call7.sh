#!/usr/bin/env bash
# Thirtieth session, call 7: the bench's kernel and selection points with their call floors
# (new) and the attend point on the arrays it reads (new), on whatever card comes (an H100's
# file is kept apart: BENCHMARKS.md shows H200 runs only).
source benchmarks/device_runs/prelude.sh
case "$gpu" in
  *H200*) name=h200-bench.json; only=decode,kernels,selection,prefill; budget=300;;
  *) name=h100-bench.json; only=kernels,selection; budget=200;;
esac
timeout 420 python3 -m benchmarks --no-hf --no-progress --only $only --budget-s $budget --out $OUT --name $name 2>&1 | tail -24
