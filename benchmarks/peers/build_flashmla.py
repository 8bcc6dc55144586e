"""Builds FlashMLA's sm90 kernels as the torch extension `flash_mla.cuda`, in place, on a GPU
machine (nvcc, torch with CUDA): the sparse fp8 decode (v32 / model1 caches, 64 and 128 heads),
the sparse prefill (d_qk 512 and 576) and the dense decode FlashMLA's API also binds; the
sm100 entry points are stubs that raise (`flashmla_sm100_stubs.cu`), so no sm_100 target is
compiled. The flags are FlashMLA's `setup.py`'s, without its line info and PTX source.

    python benchmarks/peers/build_flashmla.py PEERS_SRC [--jobs N]

PEERS_SRC: the unpacked `peers-src` of `sources.sh` (its `flashmla/` and `cutlass-flashmla/`).
Prints the build's seconds; then `PYTHONPATH=PEERS_SRC/flashmla` imports `flash_mla`.

Checked on a CPU machine (nvcc 13.0, 2 cores): every source compiles with these flags (about
3 minutes), and api.cpp's FlashMLA symbols are all defined by them and the stubs; the link
and the import need the GPU image's CUDA torch.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [
    "csrc/api/api.cpp",
    "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "csrc/smxx/decode/combine/combine.cu",
    "csrc/sm90/decode/dense/instantiations/fp16.cu",
    "csrc/sm90/decode/dense/instantiations/bf16.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
    "csrc/sm90/prefill/sparse/fwd.cu",
    "csrc/sm90/prefill/sparse/instantiations/phase1_k512.cu",
    "csrc/sm90/prefill/sparse/instantiations/phase1_k512_topklen.cu",
    "csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu",
    "csrc/sm90/prefill/sparse/instantiations/phase1_k576_topklen.cu",
    "csrc/flashmla_sm100_stubs.cu",
]
NVCC = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
        "--ptxas-options=--register-usage-level=10",
        "-gencode", "arch=compute_90a,code=sm_90a"]
CXX = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"]


def nvidia_includes() -> list[str]:
    """The CUDA library headers torch's wheels bring (cusparse.h, cublas_v2.h, ...), which
    torch's CUDA headers include and a bare CUDA toolkit may lack."""
    site = sysconfig.get_paths()["purelib"]
    return sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))


def build_in_place(root: str, name: str, ext) -> None:
    """setuptools' `build_ext --inplace` of the torch extension `ext` in `root`, printing
    `<name>: built in <s> s: [the .so files]`."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension

    start = time.perf_counter()
    os.chdir(root)
    setup(name=name, ext_modules=[ext], cmdclass={"build_ext": BuildExtension},
          script_args=["build_ext", "--inplace"])
    package = ext.name.split(".")[0]
    print(f"{name}: built in {time.perf_counter() - start:.0f} s: "
          f"{glob.glob(os.path.join(root, package, '*.so'))}")


def parse(argv, doc: str) -> argparse.Namespace:
    """A build script's arguments (PEERS_SRC, --jobs); sets MAX_JOBS for torch's build."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("peers_src")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    args = ap.parse_args(argv)
    os.environ["MAX_JOBS"] = str(args.jobs)
    return args


def main(argv=None) -> int:
    args = parse(argv, __doc__)
    root = os.path.abspath(os.path.join(args.peers_src, "flashmla"))
    cutlass = os.path.abspath(os.path.join(args.peers_src, "cutlass-flashmla"))
    shutil.copy(os.path.join(HERE, "flashmla_sm100_stubs.cu"), os.path.join(root, "csrc"))
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    ext = CUDAExtension(
        name="flash_mla.cuda", sources=SOURCES,
        extra_compile_args={"cxx": CXX, "nvcc": NVCC + ["--threads", "2"]},
        include_dirs=[os.path.join(root, "csrc"), os.path.join(root, "csrc/kerutils/include"),
                      os.path.join(root, "csrc/sm90"), os.path.join(cutlass, "include"),
                      os.path.join(cutlass, "tools/util/include"),
                      # CUDA 13 keeps libcu++ (cuda/std/...) there: nvcc finds it, the host
                      # compiler of api.cpp (which includes CUTLASS) does not
                      os.path.join(CUDA_HOME, "include", "cccl"), *nvidia_includes()])
    build_in_place(root, "flashmla", ext)
    return 0


if __name__ == "__main__":
    sys.exit(main())
