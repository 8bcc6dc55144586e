#!/usr/bin/env bash
# Planned by the twentieth session for the next one's first call: where prefill-9000's
# 9.87 -> 10.22 ms went (s19 call 3 -> s20 call 3). The bench's prefill point twice (the host's
# spread), then the step's kernel list, printed beside the last stored prefill kernel list
# (h200-profile-20261202-s13-call6.json) by kernel name: the norm, the latent and the index
# writes (whose loads now take a [1, N, W] ref) against the rest.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
for i in 1 2; do
  timeout 100 python3 -m benchmarks --no-hf --no-progress --only prefill --budget-s 80 --out $OUT --name h200-bench-$i.json 2>&1 | grep prefill-9000
done
timeout 120 python3 benchmarks/h200_profile.py --top 40 --steps prefill-9000 --out $OUT/h200-profile.json 2>&1 | grep -v "^WARNING" | tail -1
python3 -c "
import json
new = json.load(open('$OUT/h200-profile.json'))['rows'][0]
old = [r for r in json.load(open('benchmarks/results/h200-profile-20261202-s13-call6.json'))['rows']
       if r['step'].startswith('prefill')][0]
o = {k['name']: '%.1f' % k['us_per_step'] for k in old['top']}
print('kernel_us', round(new['kernel_us'], 1), 'was', round(old['kernel_us'], 1))
for k in new['top']:
    print('   %9.1f  %9s  %s' % (k['us_per_step'], o.get(k['name'], '-'), k['name'][:60]))"
