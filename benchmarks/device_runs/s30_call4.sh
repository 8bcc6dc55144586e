#!/usr/bin/env bash
# Thirtieth session, call 4: does one execution idle the device by itself? A device-bound call
# (one ~50 us GEMM, and 4 in one program) beside the attend (3 launches, and its Mosaic kernel
# alone), the selection at 4 rows and a one-kernel call; 12 interleaved rounds, the first
# traced (kernel time, the idle before each kernel, the host's events). On an H200 the bench.
source benchmarks/device_runs/prelude.sh
calls=busy-,attend-a-3launch,attend-a-1launch,selection-b64-r4-3launch,chain-1
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14;;
  *) echo "not an H200: no bench";;
esac
timeout 400 python3 benchmarks/h200_gaps.py --sections launches --calls $calls --rounds 12 --traced-rounds 1 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error|rounds|^errors" | head -60
