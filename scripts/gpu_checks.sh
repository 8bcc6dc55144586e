#!/usr/bin/env bash
# On a GPU machine (offline; jax with CUDA, triton, torch, transformers preinstalled): the GPU
# correctness tests (`pytest -m gpu --long`: every GPU test, the long ones too), then the
# benchmark suite (`python -m benchmarks`), with the jax-triton wheel from benchmarks/wheels/
# installed without network into /tmp/site.
#
#   scripts/gpu_checks.sh [--tests-only | --bench-only] [--out DIR] [TEST_FILE ...] [-- BENCH_ARGS]
#
#   --out DIR      the bench's JSON and the tests' log go there (default: $OUT, else the
#                  bench's benchmarks/results/ and no log file)
#   TEST_FILE ...  pytest's files or node ids (default: every test; only `gpu` ones run)
#   -- BENCH_ARGS  passed to `python -m benchmarks` (e.g. -- --only decode,loop --budget-s 300)
# Exit status: 0 when both parts pass, else 1 (the bench runs even when a test failed).
set -uo pipefail
cd "$(dirname "$0")/.."
tests=1 bench=1 out="${OUT:-}" files=() bench_args=()
while (($#)); do
  case "$1" in
    --tests-only) bench=0 ;;
    --bench-only) tests=0 ;;
    --out) out="$2"; shift ;;
    -h|--help) sed -n '2,12p' "$0" | cut -c3-; exit 0 ;;
    --) shift; bench_args=("$@"); break ;;
    *) files+=("$1") ;;
  esac
  shift
done
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  benchmarks/wheels/jax_triton-*.whl || exit 1
export PYTHONPATH=".:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
[ -n "$out" ] && mkdir -p "$out"
rc=0
if ((tests)); then
  log=${out:+$out/gpu-tests.log}
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$py" -m pytest -q -m gpu --long -p no:cacheprovider \
    "${files[@]}" 2>&1 | tee "${log:-/dev/null}"
  ((PIPESTATUS[0] == 0)) || rc=1
fi
if ((bench)); then
  "$py" -m benchmarks --no-progress ${out:+--out "$out"} "${bench_args[@]}" || rc=1
fi
exit $rc
