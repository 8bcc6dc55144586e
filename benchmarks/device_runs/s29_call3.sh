#!/usr/bin/env bash
# Twenty-ninth session, call 3 (the device time's last ~11 minutes): call 2's launch rows that
# its 170 s limit cut (the attend cut to 2 launches and to 1, the selection's cuts), with the
# host's cost per argument (one fusion of 1, 8, 16 inputs) and the trivial kinds, two rounds
# interleaved; then the must-hold groups call 2 ran without jax-triton (its script did not
# install the wheel: every failure there was the missing package's clear error): serving
# paths (decode_k == serial), model + bitwise, and test_kernels' top-k and selection tests.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
timeout 200 python3 benchmarks/h200_gaps.py --sections launches,kinds --calls attend-a,selection-b64-,args,kind-xla,kind-pallas --rounds 2 --out $OUT/gaps-launches.json 2>&1 | grep -E "cut ==|Error|error" | head
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/gaps-launches.json"))
for r in d["rows"]:
    print(f'{r["call"]:30s} r{r["round"]} wall {r["wall_us"]:6.1f} p10 {r["wall_p10_us"]:6.1f} enq {r["enqueue_us"]:6.1f} '
          f'kern {r["kernel_us"] or 0:6.1f} launches {r["launches"]}')
print("errors", d["errors"])
PY
export XLA_PYTHON_CLIENT_PREALLOCATE=false
G3="tests/test_serving_paths.py tests/test_gpu_serving.py"
G4="tests/test_model.py tests/test_bitwise.py"
(timeout 320 python3 -m pytest -q -m gpu tests/test_kernels.py -k "topk or select" > $OUT/pytest1.log 2>&1; echo "rc=$?" >> $OUT/pytest1.log) &
for i in 3 4; do
  eval files=\$G$i
  (timeout 320 python3 -m pytest -q -m gpu $files > $OUT/pytest$i.log 2>&1; echo "rc=$?" >> $OUT/pytest$i.log) &
done
wait
for i in 1 3 4; do grep -E "passed|failed|rc=" $OUT/pytest$i.log | tail -2; done
grep -E "^FAILED|^ERROR|^E  " $OUT/pytest*.log | head -10
cat $OUT/pytest[134].log > $OUT/gpu-tests.log; rm $OUT/pytest[134].log
