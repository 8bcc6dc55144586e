#!/usr/bin/env bash
# Ninth session, call 3 (H200): the rest of issue 15's points on the model with the
# row-invariant GEMMs in place: speculation (spec-b1-l8-k3), the README's public decode, the
# engine at 64 sequences, one compile across contexts and depths.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 520 python3 benchmarks/h200_loop.py --only spec public engine compile --out $OUT/h200-loop-rest.json 2>&1 | tail -25
