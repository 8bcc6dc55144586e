#!/usr/bin/env bash
# Thirteenth session, call 4 (H200): pv_behind in FlashAttention 3's form (call 3's) with P
# converted to f16 only after P @ V of tile t - 1 retired (call 3's ptxas: C7513, P's
# registers defined while that wgmma flew), beside the library's default (base
# mosaic-flashmla: bitwise equal expected), checked on every case, timed on A, B, P.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 300 python3 benchmarks/h200_attend.py --groups mosaic-smoke,mosaic-all \
  --base mosaic-flashmla --variants mosaic-flashmla-pvb \
  --shapes abp --limit-s 90,200 --out $OUT/h200-attend.json 2>&1 | tail -24
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/h200-attend.json"))
for g, v in d["groups"].items():
    print(g, [l[:200] for l in v.get("ptxas") or [] if "C75" in l or "spill" in l])
PY
