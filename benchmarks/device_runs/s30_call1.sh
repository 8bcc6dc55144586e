#!/usr/bin/env bash
# Thirtieth session, call 1: where the attend call's host time above a trivial call's goes.
# On an H200 first the bench's decode, kernel, selection and prefill points (the top-k's sort
# default, measured on H100s only so far). Then, on any card, interleaved rounds of the
# attend point's call (3 launches; under XLA's default capture, command buffers off, fusions
# only captured), its Mosaic kernel alone, Pallas Triton and Mosaic GPU chains of 1 and 4,
# one fusion of 1, 8, 16 inputs; the first round traced, with the host's events per call.
source benchmarks/device_runs/prelude.sh
calls=attend-a-3launch,attend-a-1launch,chain-1,chain-4,args-1,args-8
case "$gpu" in
  *H200*) timeout 170 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 145 --out $OUT --name h200-bench.json 2>&1 | tail -14
          rounds=2; limit=380;;
  *) echo "not an H200: no bench"; rounds=3; limit=540;;
esac
timeout $limit python3 benchmarks/h200_gaps.py --sections launches --calls $calls --rounds $rounds --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error| r[0-9] wall|^errors" | head -80
