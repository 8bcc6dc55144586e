#!/usr/bin/env bash
# Thirtieth session, call 2: what a launch costs the host, with enough rounds to read a few us
# through the host's drift: 20 interleaved untraced rounds of Pallas Triton chains of 1, 2, 4, 8
# launches, Mosaic GPU chains of 1 and 4, one fusion of 1, 8, 16 inputs, and the attend point's
# call at 3 launches (also under per-program capture options), 2 (the prep's outputs given) and
# 1 (its Mosaic kernel alone). On an H200 first the bench (owed since the top-k's sort default).
source benchmarks/device_runs/prelude.sh
calls=attend-a-,chain-1,chain-2,chain-4,chain-8,args-1,args-8
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14;;
  *) echo "not an H200: no bench";;
esac
timeout 380 python3 benchmarks/h200_gaps.py --sections launches --calls $calls --rounds 20 --traced-rounds 0 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error|rounds|^errors" | head -60
