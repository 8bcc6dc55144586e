#!/usr/bin/env bash
# Thirtieth session, call 3: each unmet lone-call point beside its floor on this host (a
# one-fusion program with the point's exact arguments and outputs: no implementation of the
# call can dispatch for less), with a one-kernel call of 1 and of 1, 8, 16 inputs; 16
# interleaved rounds, the first traced (launches, host events). On an H200 the bench first.
source benchmarks/device_runs/prelude.sh
calls=attend-a-3launch,attend-a-floor,attend-a-1launch,selection-b64-3launch,selection-b64-floor,selection-b64-r4,chain-1,args-1,args-8
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14;;
  *) echo "not an H200: no bench";;
esac
timeout 400 python3 benchmarks/h200_gaps.py --sections launches --calls $calls --rounds 16 --traced-rounds 1 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error|rounds|^errors" | head -60
