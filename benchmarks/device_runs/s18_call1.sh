#!/usr/bin/env bash
# Eighteenth session, call 1 (H200): a prompt's U_v product by the per-head Pallas kernel
# writing bf16 (`projection.prompt_u_v_kernel`, lever MM) and the selection's expansion as a
# broadcast (`select.expand_selection`, lever NN). First the GEMM kernel's GPU tests, then the
# U_v sweep at prefill-9000's rows (XLA against kernel tiles, each checked), then prefill-9000's
# kernel list with the new default and with gemm="xla" (XLA's U_v GEMM), then the bench's
# prefill point.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 120 python3 -m pytest -q -m gpu tests/test_matmul_kernel.py tests/test_output_projection.py > $OUT/h200-gpu-tests.log 2>&1; echo "rc=$?" >> $OUT/h200-gpu-tests.log
grep -E "passed|failed|rc=" $OUT/h200-gpu-tests.log | tail -2; grep -E "^FAILED|^ERROR|^E  " $OUT/h200-gpu-tests.log | head -12
timeout 150 python3 benchmarks/h200_prompt_uv.py --out $OUT --budget-s 120 2>&1 | grep -v "^WARNING" | tail -2
python3 -c "
import json; r = json.load(open('$OUT/h200-prompt-uv.json'))
for x in r['results']: print(x['variant'], x.get('within_bound'), round(x.get('max_err_over_bound') or -1, 3), x.get('wall_us'), x.get('kernel_us'), x.get('error', '')[:200] if x.get('error') else '')"
for g in auto xla; do
timeout 100 python3 benchmarks/h200_profile.py --top 16 --gemm $g --steps prefill-9000 --out $OUT/h200-profile-gemm-$g.json 2>&1 | grep -v "^WARNING" | tail -1
python3 -c "
import json; r = json.load(open('$OUT/h200-profile-gemm-$g.json'))
for row in r['rows']:
    print(row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
    for k in row['top']: print('   %8.1f %s' % (k['us_per_step'], k['name'][:70]))"
done
timeout 150 python3 -m benchmarks --no-hf --no-progress --only prefill --budget-s 120 --out $OUT --name h200-bench.json 2>&1 | tail -6
