#!/usr/bin/env bash
# On a GPU machine: unpacks the peers' sources (`sources.sh`'s tarball) and builds FlashMLA's
# sm90 extension and DeepGEMM's, then packs what was built so that a later run can reuse it.
#
#   benchmarks/peers/build.sh PEERS_SRC_TARBALL DEST [BUILT_TARBALL]
#
# DEST gets peers-src/ with the built extensions in place; with BUILT_TARBALL (a previous
# run's peers-built.tar.gz) nothing is compiled. Writes DEST/peers-built.tar.gz and prints
# each build's seconds. Afterwards: PYTHONPATH=DEST/peers-src/flashmla:DEST/peers-src/deepgemm
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${1:?usage: build.sh PEERS_SRC_TARBALL DEST [BUILT_TARBALL]}
dest=${2:?usage: build.sh PEERS_SRC_TARBALL DEST [BUILT_TARBALL]}
built=${3:-}
mkdir -p "$dest"
tar -xzf "$src" -C "$dest"
if [ -n "$built" ]; then
  tar -xzf "$built" -C "$dest"
  # DeepGEMM's JIT compiles its kernels at their first call against these headers
  inc="$dest/peers-src/deepgemm/deep_gemm/include"
  cp -r "$dest/peers-src/deepgemm/third-party/cutlass/include/cute" \
    "$dest/peers-src/deepgemm/third-party/cutlass/include/cutlass" "$inc/"
  echo "peers: reused $built"
  exit 0
fi
py=${PYTHON:-python3}
(cd "$here" && "$py" build_flashmla.py "$dest/peers-src") > "$dest/build-flashmla.log" 2>&1 \
  || { tail -30 "$dest/build-flashmla.log"; exit 1; }
grep "^flashmla: built" "$dest/build-flashmla.log"
(cd "$here" && "$py" build_deepgemm.py "$dest/peers-src") > "$dest/build-deepgemm.log" 2>&1 \
  || { tail -30 "$dest/build-deepgemm.log"; exit 1; }
grep "^deepgemm: built" "$dest/build-deepgemm.log"
(cd "$dest" && tar -czf peers-built.tar.gz peers-src/flashmla/flash_mla/*.so \
  peers-src/deepgemm/deep_gemm/*.so)
du -h "$dest/peers-built.tar.gz"
