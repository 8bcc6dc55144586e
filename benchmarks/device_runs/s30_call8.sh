#!/usr/bin/env bash
# Thirtieth session, call 8: what the selection points would gain without their XLA fusion
# before the kernels (each row's candidate count and position computed in the kernels): the
# 3-launch programs beside 2-launch ones given both (5 arguments either way, `==` checked),
# groups of 10 (the bench's) and 160, 16 interleaved untraced rounds, then one traced round.
source benchmarks/device_runs/prelude.sh
calls=selection-b64-3launch,selection-b64-2launch-pv,selection-b64-r4-3launch,selection-b64-r4-2launch-pv,chain-1
timeout 300 python3 benchmarks/h200_gaps.py --sections launches --calls $calls --inners 10,160 --rounds 16 --traced-rounds 0 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error|rounds|^errors" | head -40
timeout 200 python3 benchmarks/h200_gaps.py --sections launches --calls selection-b64 --out $OUT/gaps-traced.json 2>&1 | grep -E "cut ==|Error| r0 wall|^errors" | head -40
