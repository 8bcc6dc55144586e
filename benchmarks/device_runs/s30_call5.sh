#!/usr/bin/env bash
# Thirtieth session, call 5: how much of a device-bound lone call's wall beyond its kernels is
# the bench's grouping (each group of `inner` calls starts with an idle device and ends with a
# wait): the same calls timed in groups of 10 (the bench's plan), 40 and 160, 10 interleaved
# untraced rounds. On an H200 the bench first.
source benchmarks/device_runs/prelude.sh
calls=busy-1,attend-a-3launch,attend-a-1launch,selection-b64-r4-3launch,selection-b64-3launch,chain-1
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14;;
  *) echo "not an H200: no bench";;
esac
timeout 400 python3 benchmarks/h200_gaps.py --sections launches --calls $calls --inners 10,40,160 --rounds 10 --traced-rounds 0 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error|rounds|^errors" | head -60
