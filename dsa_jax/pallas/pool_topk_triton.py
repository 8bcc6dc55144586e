"""Top-k pool indices by a raw Triton kernel called through jax-triton: `pool_topk_xla`'s
indices, bit for bit, with what the Pallas-Triton lowering lacks (`tl.histogram`, `tl.sort`).

The kernel (`triton_topk_kernel.py`) runs one program per row with the row in registers: a
radix select of the k-th largest key in 8 histogram passes of 4-bit digits, the k winners
compacted and sorted on a composite key (score, then index). The Pallas kernel (`pool_topk.py`)
needs 16 counting passes and a sort in registers for the same answer; the library runs this one
for a compiled prompt's rows (`pool_topk.runs_triton`).

jax-triton and triton are optional GPU dependencies (`pip install 'dsa_jax[gpu]'`): they are
imported when this kernel is called, and their absence raises `MissingDependencyError` naming
the package; nothing falls back to another kernel. The twin is `pool_topk.pool_topk_xla`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsa_jax.errors import MissingDependencyError
from dsa_jax.pallas.common import next_pow2

# The row is held in registers; the selection runs lax.top_k past this (as for the Pallas
# kernel, `pool_topk.KERNEL_MAX_P`).
KERNEL_MAX_P = 4096
JAX_TRITON_REQUIREMENT = "jax-triton==0.3.1"
# Bits per histogram pass: 4-bit digits (8 passes of 16 bins) were faster than 8-bit ones (4
# passes of 256) for a prompt's rows.
DIGIT_BITS = 4
NUM_WARPS = 8


def load_jax_triton():
    """(jax_triton, the kernel module), or `MissingDependencyError` naming what is missing."""
    what = ("the raw Triton top-k (PoolTopkTuning(backend='triton'), or 'auto' (the default) "
            "compiled for pool_topk.AUTO_TRITON_MIN_ROWS or more rows: a prompt's)")
    fix = "Install 'dsa_jax[gpu]', or pass PoolTopkTuning(backend='pallas')"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} needs the 'triton' package (>= 3.6, a GPU install), which cannot be "
            f"imported here: {e}. {fix}") from e
    try:
        import jax_triton
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} needs the 'jax-triton' package ({JAX_TRITON_REQUIREMENT}), which cannot be "
            f"imported here: {e}. {fix}") from e
    from dsa_jax.pallas import triton_topk_kernel
    return jax_triton, triton_topk_kernel


def check_args(p: int, k: int) -> None:
    """Raise ValueError, before anything runs, for a k or a row length the kernel refuses."""
    if not 1 <= k <= p:
        raise ValueError(f"pool_topk_triton: k={k} must be in [1, P={p}]")
    if p > KERNEL_MAX_P:
        raise ValueError(f"pool_topk_triton: rows of P={p} pools exceed the kernel's "
                         f"KERNEL_MAX_P={KERNEL_MAX_P} (the row is held in registers); use "
                         f"pool_topk_xla")


def pool_topk_triton(scores: jax.Array, k: int) -> jax.Array:
    """`pool_topk_xla` as a raw Triton kernel (GPU only): the same indices, bit for bit.

    scores [..., P] f32 (no NaN), P <= KERNEL_MAX_P -> [..., k] int32, best first."""
    *lead, p = scores.shape
    check_args(p, k)
    jt, kernels = load_jax_triton()
    n = 1
    for d in lead:
        n *= d
    if n == 0:
        return jnp.zeros((*lead, k), jnp.int32)
    x = scores.reshape(n, p).astype(jnp.float32)  # [N, P]
    scratch = scratch_shape(n, p, k)
    out, _, _ = jt.triton_call(
        x, kernel=kernels.pool_topk_kernel,
        out_shape=[jax.ShapeDtypeStruct((n, k), jnp.int32),
                   jax.ShapeDtypeStruct(scratch, jnp.int32),
                   jax.ShapeDtypeStruct(scratch, jnp.int32)],
        grid=(n,), num_warps=NUM_WARPS, num_stages=1, name="pool_topk_triton",
        **kernel_constants(p, k))
    return out.reshape(*lead, k)


def kernel_constants(p: int, k: int) -> dict[str, int]:
    """The kernel's constexpr arguments for rows of `p` pools and top `k` (blocks of at least
    2: Triton's block shapes)."""
    pp, kp = max(2, next_pow2(p)), max(2, next_pow2(k))
    consts = dict(P=p, PP=pp, K=k, KP=kp, DIGIT_BITS=DIGIT_BITS)
    consts["QUARTER"], consts["HALF"] = prefix_lanes(pp, kp)
    return consts


def prefix_lanes(pp: int, kp: int) -> tuple[int, int]:
    """(QUARTER, HALF): the prefix lengths the kernel may select a row over, each 0 where it
    is shorter than KP (a prefix must hold the k winners). A prompt's row of r tokens has its
    r / 4 candidate pools first, so most of a long prompt's rows hold a quarter or a half of
    the pools live: selecting over those lanes alone gives the same indices (the lanes left
    out are -inf, below the kth) in fewer passes' work."""
    return tuple(n if n >= kp else 0 for n in (pp // 4, pp // 2))  # kp >= 2


def scratch_shape(n: int, p: int, k: int) -> tuple[int, int]:
    """Each of the two int32 scratch outputs [N, KP] (the winners' keys and indices)."""
    return n, max(2, next_pow2(k))
