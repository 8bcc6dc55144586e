"""The door to the kernels: which backend runs the hot paths, chosen explicitly, never by the
environment. The model's modules reach the Pallas kernels (`dsa_jax/pallas/`) only through
this module: its ops, and the few kernel facts and launch plans named at its end.

`cfg.implementation` is "xla" (the plain-jnp ops), "pallas" (the kernels in `dsa_jax/pallas`,
compiled for the GPU), "pallas-interpret" (the same kernels in Pallas interpret mode, on any
backend: slow, for tests and debugging), or "auto": pallas on a GPU backend, xla elsewhere.
Asking for "pallas" where it cannot run raises; nothing falls back quietly.

Each hot-path op is one `Op`: its jnp definition and its Pallas kernel, called with the same
arguments; `op(cfg, *args, **kwargs)` runs the one `cfg.implementation` names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from dsa_jax.errors import ImplementationError
from dsa_jax.pallas import (
    decode_front,
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
# The top-k kernel serves rows of up to KERNEL_MAX_P pools; lax.top_k is faster beyond.
pool_topk_op = Op("pool_topk", pool_topk.pool_topk_xla, pool_topk.pool_topk_pallas,
                  kernel_covers=lambda scores, k: scores.shape[-1] <= pool_topk.KERNEL_MAX_P)
sparse_attend_op = Op("sparse_attend", sparse_attend.sparse_attend_xla,
                      sparse_attend.sparse_attend_pallas)
rms_norm_op = Op("rms_norm", rms_norm.rms_norm_xla, rms_norm.rms_norm_pallas)
# The decode and verify rows' GEMMs where `row_gemms(cfg)` says so.
matmul_op = Op("matmul", matmul.matmul_xla, matmul.matmul_pallas)
per_head_op = Op("per_head", matmul.per_head_xla, matmul.per_head_pallas)
# A decode's top-k and q_b GEMM in one launch (`step.shares_q_launch`).
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


# ---------------------------------------------------------------------------------------------
# Kernel facts and launch plans the model needs (the only kernel names used outside pallas/)
# ---------------------------------------------------------------------------------------------

KERNEL_MAX_P = pool_topk.KERNEL_MAX_P  # the widest row of pools the top-k kernel takes
Expansion = pool_topk.Expansion  # how the top-k's pools become token slots
RowGeometry = row_meta.RowGeometry  # the static shape of a step's rows and caches
RowMeta = row_meta.RowMeta  # the rows' integer metadata, as the kernels read it
Front = decode_front.Front  # what a decode's shared front launches write and compute
front_warps = decode_front.front_warps  # whether (and at what warps) they share launches
run_decode_front = decode_front.decode_front  # the front in two shared launches
takes_scaled_q = sparse_attend.takes_scaled_q  # whether the attend reads a prompt's scaled q
q_abs_bound = scaled_q_abs.q_abs_bound  # a bound on |q_abs| known before the U_k GEMM
expand_xla = pool_topk.expand_xla  # pools -> token slots: the definition
# the Triton attend's dot operand dtype for a cache dtype (the tests derive bounds from it)
default_compute_dtype = sparse_attend.default_compute_dtype


def select_slots(cfg, scores: jax.Array, k: int, pos: jax.Array, valid: jax.Array,
                 expand: pool_topk.Expansion, tuning=None) -> jax.Array:
    """The best `k` pools of `scores [..., P]` expanded to token slots `[..., W]` for rows at
    `pos`, `valid` `[...]`, as `cfg.implementation` runs it: the top-k kernel writing the
    slots itself where it runs (rows of at most `KERNEL_MAX_P` pools, not the raw Triton
    kernel, which returns pools: the expansion then runs apart), else the top-k op and
    `expand_xla`. The same slots bit for bit on every path. tuning: the top-k kernel's."""
    impl = resolve(cfg.implementation)
    tuning = tuning or pool_topk.PoolTopkTuning()
    if impl == "xla" or scores.shape[-1] > pool_topk.KERNEL_MAX_P:
        pools = pool_topk_op(cfg, scores, k)
        return expand_xla(pools, pos, valid, expand)
    interpret = impl == "pallas-interpret"
    if pool_topk.runs_triton(tuning, math.prod(scores.shape[:-1]), interpret):
        pools = pool_topk.pool_topk_pallas(scores, k, interpret=interpret, tuning=tuning)
        return expand_xla(pools, pos, valid, expand)
    return pool_topk.pool_topk_expand_pallas(scores, k, pos, valid, expand,
                                             interpret=interpret, tuning=tuning)


def row_gemms(cfg) -> bool:
    """Whether a decode's and a verify's GEMMs are the row-invariant kernels: `cfg.gemm` is
    "pallas" (or "auto" with bf16 or fp8 weights) and the kernels run (`cfg.implementation`).
    A decode then runs its own row, not max_verify. "auto" picks them for bf16 weights (the
    decode is faster with them at 1 and 64 sequences on the H200, docs/performance.md) and
    for fp8 ones (the kernels that read the blocks)."""
    wanted = cfg.gemm == "pallas" or (cfg.gemm == "auto"
                                       and cfg.param_dtype in ("bfloat16", "float8_e4m3fn"))
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
