"""Builds DeepGEMM's extension `deep_gemm._C` in place on a GPU machine (nvcc, torch with
CUDA), as its `develop.sh` does without git or the network: the C++ API compiled against
CUDA's runtime and NVRTC, CUTLASS's `cute/` and `cutlass/` headers copied into
`deep_gemm/include` for the kernels it compiles at their first call (its JIT).

    python benchmarks/peers/build_deepgemm.py PEERS_SRC [--jobs N]

PEERS_SRC: the unpacked `peers-src` of `sources.sh` (its `deepgemm/`). Prints the build's
seconds; then `PYTHONPATH=PEERS_SRC/deepgemm` imports `deep_gemm` (set `DG_JIT_CACHE_DIR`
to keep its compiled kernels).
"""

from __future__ import annotations

import os
import shutil
import sys

from build_flashmla import build_in_place, nvidia_includes, parse


def main(argv=None) -> int:
    args = parse(argv, __doc__)
    root = os.path.abspath(os.path.join(args.peers_src, "deepgemm"))
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    for name in ("cute", "cutlass"):  # the JIT's headers, as develop.sh links them
        dst = os.path.join(root, "deep_gemm", "include", name)
        if not os.path.exists(dst):
            shutil.copytree(os.path.join(root, "third-party", "cutlass", "include", name), dst)
    abi = int(torch.compiled_with_cxx11_abi())
    ext = CUDAExtension(
        name="deep_gemm._C", sources=["csrc/python_api.cpp"],
        include_dirs=[f"{CUDA_HOME}/include", f"{CUDA_HOME}/include/cccl",
                      os.path.join(root, "deep_gemm/include"),
                      os.path.join(root, "third-party/cutlass/include"),
                      os.path.join(root, "third-party/fmt/include"), *nvidia_includes()],
        libraries=["cudart", "nvrtc"], library_dirs=[f"{CUDA_HOME}/lib64"],
        extra_compile_args=["-std=c++17", "-O3", "-fPIC", "-Wno-psabi",
                            "-Wno-deprecated-declarations", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"])
    build_in_place(root, "deepgemm", ext)
    return 0


if __name__ == "__main__":
    sys.exit(main())
