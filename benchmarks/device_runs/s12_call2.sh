#!/usr/bin/env bash
# Twelfth session, call 2 (H200): qk_ahead rewritten so that no wgmma is issued under a branch
# and no accumulator is written while one is in flight (call 1's version made ptxas serialize
# every wgmma, C7515: slower), alone and with early_gather, beside the library's default
# (base mosaic-flashmla: each must equal it bitwise), checked on every case, timed on A, B, P.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 280 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --base mosaic-flashmla --variants mosaic-flashmla-qk,mosaic-flashmla-qk-eg \
  --shapes abp --limit-s 80,200 --out $OUT/h200-attend.json 2>&1 | tail -30
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/h200-attend.json"))
for k, g in d["groups"].items():
    print(k, *[l[:160] for l in g.get("ptxas", []) if "C75" in l or "spill" in l or "Used" in l], sep="\n  ")
PY
