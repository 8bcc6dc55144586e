#!/usr/bin/env bash
# Twelfth session, call 3 (H200): qk_ahead rewritten a third time (per tile one wait for all in
# flight, then tile t + 1's logits and tile t's P @ V issued together: no accumulator written
# while a wgmma flies; calls 1-2 made ptxas serialize, C7515) beside the default (base
# mosaic-flashmla: bitwise equal required), every case checked, timed on A, B, P. Then the
# decode-b64 step's host cost: dispatch time per call, cycled inputs vs one input block.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 230 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --base mosaic-flashmla --variants mosaic-flashmla-qk \
  --shapes abp --limit-s 70,150 --out $OUT/h200-attend.json 2>&1 | tail -16
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/h200-attend.json"))
for k, g in d["groups"].items():
    print(k, *[l[:160] for l in g.get("ptxas", []) if "C75" in l or "spill" in l or "Used" in l], sep="\n  ")
PY
timeout 200 python3 benchmarks/h200_launch.py --shapes 1x64x1 default 2>&1 | tail -8
