#!/usr/bin/env bash
# Twenty-sixth session, call 3 (H200), the final kernels (the Mosaic attend's f16 partials,
# `MgpuTuning.half_partials`, now the library's default). First the bench's
# decode, kernel, selection and prefill points (with the host's call floor in its ceilings)
# and decode-b1's kernel list, then every GPU must-hold group, six in parallel (the Triton top-k's alone: its compiles) with the loop's bit checks (as s22_call2.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 150 python3 -m benchmarks --no-hf --no-progress --only decode,kernels,selection,prefill --budget-s 130 --out $OUT --name h200-bench.json 2>&1 | tail -14
timeout 60 python3 benchmarks/h200_profile.py --top 30 --steps decode-b1-k1-tp1 --out $OUT/h200-profile.json 2>&1 | grep -v "^WARNING" | tail -1
python3 -c "
import json; r = json.load(open('$OUT/h200-profile.json'))
for row in r['rows']:
    print(row['step'], round(row['wall_us'], 1), round(row['kernel_us'], 1), row['launches'])
    for k in row['first_call'][:16]: print('   %8.2f %s' % (k['us'], k['name'][:70]))"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G0="tests/test_attend_kernel.py tests/test_scaled_q_abs.py tests/test_matmul_kernel.py tests/test_output_projection.py tests/test_colaunch.py tests/test_row_meta.py"
G1="tests/test_kernels.py tests/test_write_kernels.py tests/test_rms_norm_kernel.py"
G2="tests/test_selection_kernels.py"
G3="tests/test_serving_paths.py"
G4="tests/test_model.py tests/test_bitwise.py"
G5="tests/test_pool_topk_triton.py"
for i in 0 1 2 3 4 5; do
  eval files=\$G$i
  (timeout 330 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
timeout 330 python3 benchmarks/h200_loop.py --only checks --out $OUT/h200-loop-checks.json > $OUT/loop-checks.log 2>&1
wait
for i in 0 1 2 3 4 5; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
tail -6 $OUT/loop-checks.log
cat $OUT/pytest[0-5].log > $OUT/h200-gpu-tests.log; rm $OUT/pytest[0-5].log
