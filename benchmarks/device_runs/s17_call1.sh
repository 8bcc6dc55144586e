#!/usr/bin/env bash
# Seventeenth session, call 1 (H200): the two defaults sixteenth-session sweeps measured faster
# alone (scaled_q_abs 64 x 512 tiles for bf16 rows; the Triton top-k's "auto" radix with 4-bit
# digits for a prompt's rows) and qi's bf16 parts split inside the Mosaic pool-scores kernel
# (MgpuScoresTuning.split_q, default where rows x Hp is a multiple of 64: a prompt's rows).
# First the three kernels' GPU tests, then the kernel list of prefill-9000 and decode-b1, then
# the bench's decode, kernel, selection and prefill points.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 150 python3 -m pytest -q -m gpu tests/test_pool_scores_mgpu.py tests/test_scaled_q_abs.py tests/test_pool_topk_triton.py > $OUT/h200-gpu-tests.log 2>&1; echo "rc=$?" >> $OUT/h200-gpu-tests.log
grep -E "passed|failed|rc=" $OUT/h200-gpu-tests.log | tail -2; grep -E "^FAILED|^ERROR|^E  " $OUT/h200-gpu-tests.log | head -12
timeout 100 python3 benchmarks/h200_profile.py --top 18 --out $OUT/h200-profile.json 2>&1 | grep -v "^WARNING" | tail -3
python3 -c "
import json; r = json.load(open('$OUT/h200-profile.json'))
for row in r['rows']:
    print(row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
    for k in row['top']: print('   %8.1f %s' % (k['us_per_step'], k['name'][:70]))"
timeout 200 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 170 --out $OUT --name h200-bench.json 2>&1 | tail -14
