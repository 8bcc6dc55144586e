#!/usr/bin/env bash
# Packs the peers' pinned sources for an offline GPU machine: FlashMLA's sm90 kernels (no
# sm100 ones), the CUTLASS headers it builds against, and DeepGEMM with its CUTLASS and fmt.
#
#   benchmarks/peers/sources.sh OUT_DIR
#
# Writes OUT_DIR/peers-src.tar.gz (a few tens of MB: under the device tool's 64 MiB a call).
# Repositories: $FLASHMLA_GIT, $CUTLASS_GIT, $DEEPGEMM_GIT, $FMT_GIT (git directories, e.g.
# the library's mirrors), else cloned from GitHub (needs the network). OUT_DIR is outside the
# package; keep it git-ignored (the brief: built peers never enter the repository).
set -euo pipefail
out=${1:?usage: sources.sh OUT_DIR}
FLASHMLA=9241ae3ef9bac614dd25e45e507e089f888280e0  # deepseek-ai/FlashMLA, 2026-04-29
CUTLASS_FLASHMLA=147f5673d0c1c3dcf66f78d677fd647e4a020219  # its csrc/cutlass submodule
DEEPGEMM=54e22612409371d6364144b69086735beb54e98b  # deepseek-ai/DeepGEMM, 2026-06-23
CUTLASS_DEEPGEMM=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8  # its third-party/cutlass
FMT=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28  # its third-party/fmt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

repo() {  # repo VAR URL -> a git dir holding the pinned commits
  local dir=${!1:-}
  if [ -z "$dir" ]; then
    dir="$tmp/$(basename "$2").git"
    git clone -q --bare "$2" "$dir"
  fi
  echo "$dir"
}
flashmla=$(repo FLASHMLA_GIT https://github.com/deepseek-ai/FlashMLA)
cutlass=$(repo CUTLASS_GIT https://github.com/NVIDIA/cutlass)
deepgemm=$(repo DEEPGEMM_GIT https://github.com/deepseek-ai/DeepGEMM)
fmt=$(repo FMT_GIT https://github.com/fmtlib/fmt)

src="$tmp/peers-src"
mkdir -p "$src/flashmla" "$src/cutlass-flashmla" "$src/deepgemm"
# FlashMLA: the package, the API, the sm90 and shared kernels (no sm100 sources: they are
# replaced by stubs at build time, benchmarks/peers/flashmla_sm100_stubs.cpp)
git --git-dir="$flashmla" archive "$FLASHMLA" flash_mla csrc/api csrc/defines.h csrc/params.h csrc/utils.h \
  csrc/kerutils csrc/sm90 csrc/smxx csrc/sm100/decode/head64/kernel.h \
  csrc/sm100/prefill/sparse/fwd/head64/phase1.h csrc/sm100/prefill/sparse/fwd/head128/phase1.h \
  csrc/sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h \
  csrc/sm100/prefill/dense/interface.h tests LICENSE | tar -x -C "$src/flashmla"
git --git-dir="$cutlass" archive "$CUTLASS_FLASHMLA" include tools/util/include LICENSE.txt \
  | tar -x -C "$src/cutlass-flashmla"
git --git-dir="$deepgemm" archive "$DEEPGEMM" | tar -x -C "$src/deepgemm"
mkdir -p "$src/deepgemm/third-party/cutlass" "$src/deepgemm/third-party/fmt"
git --git-dir="$cutlass" archive "$CUTLASS_DEEPGEMM" include tools/util/include LICENSE.txt \
  | tar -x -C "$src/deepgemm/third-party/cutlass"
git --git-dir="$fmt" archive "$FMT" | tar -x -C "$src/deepgemm/third-party/fmt"
printf 'flashmla %s\ncutlass(flashmla) %s\ndeepgemm %s\ncutlass(deepgemm) %s\nfmt %s\n' \
  "$FLASHMLA" "$CUTLASS_FLASHMLA" "$DEEPGEMM" "$CUTLASS_DEEPGEMM" "$FMT" > "$src/PINS"
mkdir -p "$out"
tar -C "$tmp" -czf "$out/peers-src.tar.gz" peers-src
du -h "$out/peers-src.tar.gz"
