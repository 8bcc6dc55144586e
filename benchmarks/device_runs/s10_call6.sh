#!/usr/bin/env bash
# Tenth session, call 6 (H200, tree after 62be610): the XLA write now rounds pool keys with
# lax.reduce_precision before the cast (index_write.stored_keys, after the GPU runs above):
# the XLA path's GPU tests that read keys a step wrote, decode_k == serial at GLM per-rank
# shapes under "xla", and the layer's pallas == xla selections compiled.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p $OUT
timeout 200 python3 -m pytest -q -m gpu tests/test_serving_paths.py tests/test_kernels.py \
  -k "(per_rank_shapes and xla) or test_layer_kernels_match_xla" 2>&1 | tee $OUT/pytest6.log | tail -3
