#!/usr/bin/env bash
# Thirtieth session, call 6: the attend point's call as the bench makes it (the state pytree:
# 8 leaves, 3 read) beside the same call on its 5 arrays and their floor, and the selection
# points beside their floors, on another host; groups of 10 (the bench's) and 160 calls, 12
# interleaved untraced rounds. On an H200 the bench first.
source benchmarks/device_runs/prelude.sh
calls=attend-a-state,attend-a-3launch,attend-a-floor,selection-b64-3launch,selection-b64-floor,selection-b64-r4,chain-1
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14;;
  *) echo "not an H200: no bench";;
esac
timeout 400 python3 benchmarks/h200_gaps.py --sections launches --calls $calls --inners 10,160 --rounds 12 --traced-rounds 0 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error|rounds|^errors" | head -60
