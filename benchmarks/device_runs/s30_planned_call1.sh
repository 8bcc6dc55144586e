#!/usr/bin/env bash
# Planned by the twenty-ninth session for the next one's first call. On an H200 the bench's
# decode, kernel, selection and prefill points on the top-k's sort default (LLL, measured on
# H100s only), for BENCHMARKS.md. On any card: where a lone call's host time goes (NNN's open
# rows), interleaved rounds (2 after the bench, else 3), profiled in the first: the attend
# point's call at 3, 2 and 1 launches, the selection's, chains of Pallas Triton and Mosaic GPU
# launches, one fusion of 1, 8, 16 inputs, the trivial kinds, every array an argument.
source benchmarks/device_runs/prelude.sh
# 14 calls; the profiler traces (the slow part of a row) in the first round only.
calls=attend-a,selection-b64-,args,chain-1,mosaic-chain-4,kind-pallas-mosaic,kind-xla
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14
          rounds=2;;
  *) echo "not an H200: no bench"; rounds=3;;
esac
timeout 380 python3 benchmarks/h200_gaps.py --sections launches,kinds --calls $calls --rounds $rounds --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error| r[0-9] wall|^errors" | head -80
