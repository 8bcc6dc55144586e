"""The gather-attend's split merge as a small Pallas Triton kernel.

`sparse_attend.merge_splits` (jnp, the twin) combines each row's per-split normalized partials.
XLA fuses that jnp with whatever surrounds it, so its reduction order and FMA contraction can
depend on the program it sits in. This kernel fixes the order: splits are combined one after
another, in index order, in every program. The Mosaic attend path merges with it (a decode
and a max_verify-row verify differed on the H200 with the jnp merge fused into different
neighbours: benchmarks/notes.md, 2026-12-01 fifth); the Triton path still merges in jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

HEADS_PER_PROGRAM = 16
COLUMNS_PER_PROGRAM = 128  # the accumulator [16, 128] f32: 16 registers a thread at 4 warps


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, splits: int, hb: int, cb: int):
    """One (row, head block, column block) program. o_ref [N, S, Hp, Cp], m_ref / l_ref
    [N, S, Hp] (whole arrays); out_ref [hb, cb]."""
    n, heads = pl.program_id(0), pl.ds(pl.program_id(1) * hb, hb)
    cols = pl.ds(pl.program_id(2) * cb, cb)
    m_all = m_ref[n, 0, heads]  # [hb]
    for s in range(1, splits):
        m_all = jnp.maximum(m_all, m_ref[n, s, heads])
    total = jnp.zeros_like(m_all)  # [hb]
    acc = jnp.zeros(out_ref.shape, jnp.float32)  # [hb, cb]
    for s in range(splits):
        wgt = jnp.exp(m_ref[n, s, heads] - m_all) * l_ref[n, s, heads]  # [hb]
        total = total + wgt
        acc = acc + wgt[:, None] * o_ref[n, s, heads, cols]
    out_ref[...] = acc / jnp.where(total > 0, total, 1.0)[:, None]


def merge_splits_pallas(o: jax.Array, m: jax.Array, l: jax.Array, *,
                        interpret: bool = False) -> jax.Array:
    """`sparse_attend.merge_splits` as a kernel: o [N, S, Hp, Cp], m, l [N, S, Hp] f32 ->
    [N, Hp, Cp] f32 (0 where no split saw a valid slot). Hp a multiple of 16; Cp a multiple of
    128 or a power of two below it (the attend kernels' padded shapes)."""
    n, splits, hp, cp = o.shape
    if splits == 1:
        return o[:, 0]
    hb = HEADS_PER_PROGRAM
    cb = COLUMNS_PER_PROGRAM if cp % COLUMNS_PER_PROGRAM == 0 else cp
    if hp % hb or cb & (cb - 1):
        raise ValueError(f"merge_splits_pallas: heads {hp} must be a multiple of {hb} and "
                         f"columns {cp} a multiple of {COLUMNS_PER_PROGRAM} or a power of two")
    kernel = functools.partial(_merge_kernel, splits=splits, hb=hb, cb=cb)
    return pl.pallas_call(
        kernel,
        grid=(n, hp // hb, cp // cb),
        in_specs=[pl.BlockSpec(), pl.BlockSpec(), pl.BlockSpec()],
        out_specs=pl.BlockSpec((None, hb, cb), lambda i, h, c: (i, h, c)),
        out_shape=jax.ShapeDtypeStruct((n, hp, cp), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="merge_splits",
    )(o, m, l)
