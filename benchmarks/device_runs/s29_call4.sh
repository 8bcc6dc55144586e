#!/usr/bin/env bash
# Twenty-ninth session, call 4 (the device time's last ~5 minutes): NNN's open rows with every
# array an argument, wall and enqueue only (no profiler traces: the quick rows), two rounds
# interleaved: the attend point's call at 3, 2 and 1 launches (5, 7, 7 arguments), the
# one fusion of 1, 8, 16 inputs, a Pallas Triton launch, a
# Mosaic GPU launch and a chain of 4.
source benchmarks/device_runs/prelude.sh
timeout 130 python3 benchmarks/h200_gaps.py --sections launches --calls attend-a,args,chain-1,mosaic-chain-4 --rounds 2 --traced-rounds 0 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error| r[0-9] wall|^errors" | head -40
