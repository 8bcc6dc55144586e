#!/usr/bin/env bash
# Twenty-ninth session, call 2: what one launch costs the host in a lone call (h200_gaps.py
# --sections launches,kinds): chains of 1-8 trivial Pallas Triton kernels, the attend point's
# call cut to 2 launches (the prep's outputs given) and 1 (the Mosaic kernel alone), the
# selection point's call cut to 2 (each row's candidate count given) and 1 (the scores), each
# cut call checked `==` its part of the whole. It decides whether fewer launches (the prep or
# the merge in the Mosaic attend, the row metadata in the scores kernel) move the lone calls'
# walls. Any card (side by side). Then the must-hold groups call 1 (an H100, six groups in
# parallel) cut at 290 s: the kernels + writes + norm + Mosaic scores, the serving paths
# (decode_k == serial) and model + bitwise, three in parallel.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
export PYTHONPATH=.
timeout 170 python3 benchmarks/h200_gaps.py --sections launches,kinds --out $OUT/gaps-launches.json 2>&1 | grep -v "^WARNING" | cut -c1-400 | tail -20
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/gaps-launches.json"))
for r in d["rows"]:
    print(f'{r["call"]:32s} wall {r["wall_us"]:7.1f} p10 {r["wall_p10_us"]:7.1f} enq {r["enqueue_us"]:6.1f} '
          f'kern {r["kernel_us"] or 0:6.1f} launches {r["launches"]}')
print("errors", d["errors"])
PY
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G1="tests/test_kernels.py tests/test_write_kernels.py tests/test_rms_norm_kernel.py tests/test_pool_scores_mgpu.py"
G3="tests/test_serving_paths.py tests/test_gpu_serving.py"
G4="tests/test_model.py tests/test_bitwise.py"
for i in 1 3 4; do
  eval files=\$G$i
  (timeout 370 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
wait
for i in 1 3 4; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
cat $OUT/pytest[134].log > $OUT/gpu-tests.log; rm $OUT/pytest[134].log
