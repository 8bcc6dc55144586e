#!/usr/bin/env bash
# Twenty-second session, call 4 (H200), the session's last device seconds: the selection as the
# selection-b64 / -r4 points time it with the Pallas top-k (the default for decode rows) and the
# raw Triton top-k ("sample" at 4- and 8-bit digits), each selection `==` the Pallas one's, wall
# and kernel time side by side (`h200_topk_triton._run_selection`).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 85 python3 -c "
import time
from benchmarks import h200_topk_triton as h
from benchmarks.device_script import command, index_config, utc_now
cfg = index_config(False).replace(implementation='pallas')
res = {'command': command('h200_topk_triton.py', ['(selection rows only: s22_call4.sh)']),
       'date': utc_now(), 't0': time.monotonic(), 'deadline': time.monotonic() + 75,
       'results': [], 'errors': []}
path = '$OUT/h200-topk-triton.json'
for case, r in (('selection-b64', 1), ('selection-b64-r4', 4)):
    h._run_selection(res, path, cfg, case, 64, r, False, ['pallas', 'triton-sample4-w8'])
" 2>&1 | grep -v "^WARNING" | cut -c1-330
