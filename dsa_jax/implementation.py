"""Which backend runs the hot paths: chosen explicitly, never by the environment.

`cfg.implementation` is "xla" (the plain-jnp ops), "pallas" (the kernels in `dsa_jax/pallas`,
compiled for the GPU), "pallas-interpret" (the same kernels in Pallas interpret mode, on any
backend: slow, for tests and debugging), or "auto": pallas on a GPU backend, xla elsewhere.
Asking for "pallas" where it cannot run raises; nothing falls back quietly.

Each hot-path op is one `Op`: its jnp definition and its Pallas kernel, called with the same
arguments; `op(cfg, *args, **kwargs)` runs the one `cfg.implementation` names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from dsa_jax.pallas import (
    index_write,
    latent_write,
    matmul,
    pool_scores,
    pool_topk,
    rms_norm,
    row_meta,
    scaled_q_abs,
    sparse_attend,
    topk_matmul,
)


class ImplementationError(RuntimeError):
    """The requested implementation cannot run here."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One hot-path op.

    name: what errors and listings call it. reference: the jnp definition, also what
    "xla" runs. kernel: the Pallas kernel, with the reference's arguments plus `interpret`
    and its own tuning keywords. kernel_covers: for an op whose kernel serves only some
    shapes, `(*args, **kwargs) -> bool` (a static decision on shapes); where it is False every
    implementation runs the reference, which returns the same result.
    """
    name: str
    reference: Callable[..., Any]
    kernel: Callable[..., Any]
    kernel_covers: Callable[..., bool] | None = None

    def __call__(self, cfg, *args, kernel_options: dict[str, Any] | None = None,
                 **kwargs) -> Any:
        """Run the op as `cfg.implementation` says. kernel_options: keywords only the kernel
        takes (hints and tuning); the reference ignores them."""
        impl = resolve(cfg.implementation)
        if impl == "xla" or (self.kernel_covers is not None
                             and not self.kernel_covers(*args, **kwargs)):
            return self.reference(*args, **kwargs)
        return self.kernel(*args, interpret=impl == "pallas-interpret",
                           **(kernel_options or {}), **kwargs)


latent_write_op = Op("latent_write", latent_write.latent_write_xla,
                     latent_write.latent_write_pallas)
index_write_op = Op("index_write", index_write.index_write_xla, index_write.index_write_pallas)
pool_scores_op = Op("pool_scores", pool_scores.pool_scores_xla, pool_scores.pool_scores_pallas)
# The top-k kernel serves rows of up to KERNEL_MAX_P pools; lax.top_k measured faster beyond.
pool_topk_op = Op("pool_topk", pool_topk.pool_topk_xla, pool_topk.pool_topk_pallas,
                  kernel_covers=lambda scores, k: scores.shape[-1] <= pool_topk.KERNEL_MAX_P)
sparse_attend_op = Op("sparse_attend", sparse_attend.sparse_attend_xla,
                      sparse_attend.sparse_attend_pallas)
rms_norm_op = Op("rms_norm", rms_norm.rms_norm_xla, rms_norm.rms_norm_pallas)
# The decode and verify rows' GEMMs where `row_gemms(cfg)` says so.
matmul_op = Op("matmul", matmul.matmul_xla, matmul.matmul_pallas)
per_head_op = Op("per_head", matmul.per_head_xla, matmul.per_head_pallas)
# A decode's top-k and q_b GEMM in one launch (`layer.shares_q_launch`).
topk_matmul_op = Op("topk_matmul", topk_matmul.topk_matmul_xla, topk_matmul.topk_matmul_pallas)
# A decode's row metadata and x projection GEMM in one launch (`layer.step`).
meta_matmul_op = Op("meta_matmul", row_meta.meta_matmul_xla, row_meta.meta_matmul_pallas)
# A prompt's absorbed query as the Mosaic attend takes it (`MgpuTuning.bound_scales`).
scaled_q_abs_op = Op("scaled_q_abs", scaled_q_abs.scaled_q_abs_xla,
                     scaled_q_abs.scaled_q_abs_pallas)

OPS: dict[str, Op] = {op.name: op for op in (latent_write_op, index_write_op, pool_scores_op,
                                             pool_topk_op, sparse_attend_op, rms_norm_op,
                                             matmul_op, per_head_op, scaled_q_abs_op,
                                             topk_matmul_op, meta_matmul_op)}


def row_gemms(cfg) -> bool:
    """Whether a decode's and a verify's GEMMs are the row-invariant kernels: `cfg.gemm` is
    "pallas" (or "auto" with bf16 weights) and the kernels run (`cfg.implementation`). A decode
    then runs its own row, not max_verify. "auto" picks them for bf16 weights because the
    decode is faster with them at 1 and 64 sequences on the H200 (a 64-sequence 4-row verify
    slower: h200-decode-variants-20261201-s8-call4.json, benchmarks/notes.md)."""
    wanted = cfg.gemm == "pallas" or (cfg.gemm == "auto" and cfg.param_dtype == "bfloat16")
    return wanted and resolve(cfg.implementation) != "xla"


def pallas_kernels_present() -> bool:
    """Whether every op has a Pallas kernel (it does: the kernels ship with the package)."""
    return all(callable(op.kernel) for op in OPS.values())


def resolve(implementation: str) -> str:
    """The configured name -> the one that runs: "xla", "pallas" or "pallas-interpret"."""
    on_gpu = jax.default_backend() == "gpu"
    if implementation == "auto":
        return "pallas" if on_gpu else "xla"
    if implementation == "pallas" and not on_gpu:
        raise ImplementationError(
            f"implementation='pallas' compiles the kernels for a GPU; this process has backend "
            f"{jax.default_backend()!r}. Use implementation='xla' (or 'pallas-interpret' to run "
            f"the kernels slowly in interpret mode).")
    return implementation
