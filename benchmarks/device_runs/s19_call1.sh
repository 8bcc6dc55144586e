#!/usr/bin/env bash
# Nineteenth session, call 1 (H200): decode-b1's kernels at the bench's own rows (1 row under
# the row-invariant GEMMs; earlier profiles ran max_verify rows), each launch in order, and
# its HLO; the row-invariant GEMM at 1 and 64 rows with one K part and narrow or deep tiles
# (h200_gemm.py's S19 set); the Mosaic attend of one decode row at 11, 16 (default), 17 and 33
# splits (shape "d"), each checked against the library's default first.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
export PYTHONPATH=.
timeout 80 python3 benchmarks/h200_profile.py --top 30 --steps decode-b1-k1-tp1 --hlo $OUT/hlo --out $OUT/h200-profile.json 2>&1 | grep -v "^WARNING" | tail -1
python3 -c "
import json; r = json.load(open('$OUT/h200-profile.json'))
for row in r['rows']:
    print(row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
    for k in row['first_call']: print('   %8.2f %s' % (k['us'], k['name'][:70]))"
gzip -9 $OUT/hlo/*.txt
timeout 250 python3 benchmarks/h200_gemm.py --out $OUT --variants s19 --rows 1 64 --budget-s 225 > $OUT/gemm.log 2>&1
python3 -c "
import json; r = json.load(open('$OUT/h200-gemm.json'))
for x in r['results']:
    t = x.get('tuning') or {}
    print('%-9s %-19s m=%-3d sp=%s bn=%s bk=%s st=%s w=%s  %7.2f us %5.2f TB/s err/bound %.3g eq256 %s' % (
        x['gemm'], x['variant'], x['m'], t.get('splits'), t.get('block_n'), t.get('block_k'),
        t.get('num_stages'), t.get('num_warps'), x.get('kernel_us') or -1, x.get('weight_tb_s') or -1,
        x.get('max_err_over_bound') or -1, x.get('rows_equal_256')))
print('errors', len(r['errors']), [e if isinstance(e, dict) else e[-300:] for e in r['errors'][:3]])"
timeout 200 python3 benchmarks/h200_attend.py --out $OUT/h200-attend.json --groups mosaic-all --base mosaic-lib --variants mosaic-lib-ms11,mosaic-lib-ms17,mosaic-lib-ms33 --shapes d --limit-s 190 2>&1 | tail -30
