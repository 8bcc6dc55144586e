#!/usr/bin/env bash
# Thirteenth session, call 6 (H200; the budget's remainder): the kernels of the bench's
# prefill-9000 and decode-b1 steps on main's final tree, listed per kernel (the next
# session's levers for the two kernel-paced targets).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 200 python3 benchmarks/h200_profile.py --top 40 --out $OUT/h200-profile.json 2>&1 | tail -90
