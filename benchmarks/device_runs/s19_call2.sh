#!/usr/bin/env bash
# Nineteenth session, call 2 (H200): the co-launch (the decode's top-k and q_b GEMM in one
# launch, `pallas/topk_matmul.py`) compiled and checked bit for bit on the GPU; decode-b1's
# kernels with it and without (cfg.colaunch), with the attend's balanced splits (max_splits
# 64); the small GEMMs at one row timed on cold weights (copies past the L2, as a step reads
# them).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 -m pytest -q -m gpu tests/test_colaunch.py > $OUT/h200-gpu-tests.log 2>&1; echo "rc=$?" >> $OUT/h200-gpu-tests.log
grep -E "passed|failed|^FAILED|^E  |rc=" $OUT/h200-gpu-tests.log | head -12
for c in on off; do
  timeout 80 python3 benchmarks/h200_profile.py --top 30 --colaunch $c --steps decode-b1-k1-tp1 --out $OUT/h200-profile-colaunch-$c.json 2>&1 | grep -v "^WARNING" | tail -1
  python3 -c "
import json; r = json.load(open('$OUT/h200-profile-colaunch-$c.json'))
for row in r['rows']:
    print(row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
    for k in row['first_call']: print('   %8.2f %s' % (k['us'], k['name'][:70]))"
done
timeout 150 python3 benchmarks/h200_gemm.py --out $OUT --cold --rows 1 --budget-s 130 --variants default bk256_st4 s1_bn32 s1_bn32_bk256 s1_bn64_bk256 s1_bn128_bk128 > $OUT/gemm.log 2>&1
python3 -c "
import json; r = json.load(open('$OUT/h200-gemm.json'))
for x in r['results']:
    t = x.get('tuning') or {}
    print('%-9s %-19s m=%-3d sp=%s bn=%s bk=%s st=%s  %7.2f us %5.2f TB/s eq256 %s copies %s' % (
        x['gemm'], x['variant'], x['m'], t.get('splits'), t.get('block_n'), t.get('block_k'),
        t.get('num_stages'), x.get('kernel_us') or -1, x.get('weight_tb_s') or -1,
        x.get('rows_equal_256'), x.get('cold_copies')))
print('errors', len(r['errors']))"
