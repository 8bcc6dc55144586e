"""The gather-attend's split merge as a small Pallas Triton kernel.

`sparse_attend.merge_splits` (jnp, the twin) combines each row's per-split normalized partials.
XLA fuses that jnp with whatever surrounds it, so its reduction order and FMA contraction can
depend on the program it sits in. This kernel fixes the order: the same code combines the
splits in the same order in every program. Both attend paths merge with it (with the jnp
merge fused into different neighbours, a decode and a max_verify-row verify differed in
their last bits on the H200, on the Mosaic path and on the Triton path at TP 8).

It also writes what the attend's caller needs in the same pass: the merged rows rounded to the
output projection's operand dtype, put in place in a block padded to more rows per sequence
(a decode attends 1 of its `max_verify` rows; `padded_rows_jnp` is the twin of that part).
Partials may be f16 in the cache's units (the Mosaic kernel's with more than one split): the
merge sums in f32 and applies the cache's scale to the merged rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.pallas.common import next_pow2

HEADS_PER_PROGRAM = 16
# The accumulator block [S, 16, 32] f32 of up to 16 splits: 64 registers a thread at 4 warps.
COLUMNS_PER_PROGRAM = 32


def _merge_kernel(o_ref, m_ref, l_ref, *refs, splits: int, hb: int, cb: int, rows_in: int,
                  rows_out: int, scaled: bool):
    """One (input row, head block, column block) program. o_ref [N, S, Hp, Cp] (f32 or f16),
    m_ref / l_ref [N, S, Hp] (whole arrays); with `scaled` scale_ref [1] f32; with padding
    (rows_out > rows_in) fill_ref [B * rows_out] f32; out_ref [B * rows_out, Hp, Cp] (whole).
    Input row n is row n % rows_in of sequence n // rows_in, stored at output row
    (n // rows_in) * rows_out + n % rows_in; a sequence's first row's programs also store its
    rows from rows_in on, fill[row] each."""
    scale_ref, refs = (refs[0], refs[1:]) if scaled else (None, refs)
    fill_ref, out_ref = refs if rows_out > rows_in else (None, refs[0])
    n = pl.program_id(0)
    h0, c0 = pl.program_id(1) * hb, pl.program_id(2) * cb
    heads, cols = pl.ds(h0, hb), pl.ds(c0, cb)
    seq = n // rows_in
    if splits == 1:
        merged = o_ref[n, 0, heads, cols].astype(jnp.float32)  # [hb, cb]: the partial
    else:
        # Every split's block loaded at once (independent loads: one memory latency), then
        # combined in one fixed order for every program.
        sp = next_pow2(splits)
        s_idx = jnp.arange(sp, dtype=jnp.int32)  # [Sp]
        h_idx = h0 + jnp.arange(hb, dtype=jnp.int32)  # [hb]
        c_idx = c0 + jnp.arange(cb, dtype=jnp.int32)  # [cb]
        real = s_idx < splits
        mask2 = jnp.broadcast_to(real[:, None], (sp, hb))
        m = plt.load(m_ref.at[n, s_idx[:, None], h_idx[None, :]], mask=mask2,
                     other=-jnp.inf)  # [Sp, hb]
        l = plt.load(l_ref.at[n, s_idx[:, None], h_idx[None, :]], mask=mask2,
                     other=0.0)  # [Sp, hb]
        o = plt.load(o_ref.at[n, s_idx[:, None, None], h_idx[None, :, None],
                              c_idx[None, None, :]],
                     mask=jnp.broadcast_to(real[:, None, None], (sp, hb, cb)),
                     other=0.0).astype(jnp.float32)  # [Sp, hb, cb]
        wgt = jnp.exp(m - jnp.max(m, axis=0)[None, :]) * l  # [Sp, hb]; 0 for padded splits
        total = jnp.sum(wgt, axis=0)  # [hb]
        acc = jnp.sum(wgt[:, :, None] * o, axis=0)  # [hb, cb]
        merged = acc / jnp.where(total > 0, total, 1.0)[:, None]
    if scaled:
        merged = merged * scale_ref[0]
    out_ref[seq * rows_out + n % rows_in, heads, cols] = merged.astype(out_ref.dtype)
    if fill_ref is None:
        return

    @pl.when(n % rows_in == 0)
    def _():
        for j in range(rows_in, rows_out):  # static: the sequence's padded rows
            row = seq * rows_out + j
            out_ref[row, heads, cols] = jnp.full((hb, cb), fill_ref[row],
                                                 jnp.float32).astype(out_ref.dtype)


def merge_splits_pallas(o: jax.Array, m: jax.Array, l: jax.Array, *, interpret: bool = False,
                        dtype=jnp.float32, pad: tuple[int, jax.Array] | None = None,
                        scale: jax.Array | None = None) -> jax.Array:
    """`sparse_attend.merge_splits` as a kernel: o [N, S, Hp, Cp] f32 or f16, m, l [N, S, Hp]
    f32 -> [N, Hp, Cp] `dtype` (0 where no split saw a valid slot; the fp32 merge rounded
    once). Hp a multiple of 16; Cp a multiple of 32 or a power of two below it (the attend
    kernels' padded shapes). scale: [] or [1] f32, multiplied into the merged rows (partials in
    the cache's units, as the Mosaic kernel writes them with more than one split).

    pad: `(rows_in, fill)`, fill [B, Rt] f32 with `N = B * rows_in` and `Rt >= rows_in`: the N
    rows are each sequence's first `rows_in` rows, and the result is `[B * Rt, Hp, Cp]` with
    row r of sequence b at `b * Rt + r`: merged for `r < rows_in`, `fill[b, r]` after
    (`padded_rows_jnp(merge_splits(o, m, l), ...)` in one pass)."""
    n, splits, hp, cp = o.shape
    dtype = jnp.dtype(dtype)
    if splits == 1 and pad is None and dtype == o.dtype == jnp.float32 and scale is None:
        return o[:, 0]
    hb = HEADS_PER_PROGRAM
    cb = COLUMNS_PER_PROGRAM if cp % COLUMNS_PER_PROGRAM == 0 else cp
    if o.dtype.itemsize == 2 and next_pow2(splits) <= 8 and cp % (2 * cb) == 0:
        cb = 2 * cb  # 128-byte rows of f16 partials
    if hp % hb or cb & (cb - 1):
        raise ValueError(f"merge_splits_pallas: heads {hp} must be a multiple of {hb} and "
                         f"columns {cp} a multiple of {COLUMNS_PER_PROGRAM} or a power of two")
    rows_in = n
    extra = [] if scale is None else [jnp.asarray(scale, jnp.float32).reshape(1)]
    rows_out = rows_in
    if pad is not None:
        rows_in, fill = pad
        b, rows_out = fill.shape
        if rows_in < 1 or b * rows_in != n or rows_out < rows_in:
            raise ValueError(f"merge_splits_pallas: pad rows_in={rows_in} with fill "
                             f"{fill.shape} does not fit {n} input rows (need B * rows_in == "
                             f"{n} and rows_in <= {rows_out})")
        if rows_out > rows_in:
            extra.append(fill.reshape(-1).astype(jnp.float32))
    kernel = functools.partial(_merge_kernel, splits=splits, hb=hb, cb=cb, rows_in=rows_in,
                               rows_out=rows_out, scaled=scale is not None)
    return pl.pallas_call(
        kernel,
        grid=(n, hp // hb, cp // cb),
        in_specs=[pl.BlockSpec()] * (3 + len(extra)),
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((n // rows_in * rows_out, hp, cp), dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="merge_splits",
    )(o, m, l, *extra)


def padded_rows_jnp(rows: jax.Array, fill: jax.Array, dtype) -> jax.Array:
    """The twin of `merge_splits_pallas`'s padding: rows [B, R, ...] f32, fill [B, Rt] f32 ->
    [B, Rt, ...] `dtype`, rows r < R as given (rounded to dtype), the others fill[b, r]. A fill
    of the whole block and the rows put in place, not a concatenate: XLA then writes the block
    once instead of copying it."""
    b, r = rows.shape[:2]
    rt = fill.shape[1]
    block = jnp.broadcast_to(fill.reshape(b, rt, *(1,) * (rows.ndim - 2)).astype(dtype),
                             (b, rt, *rows.shape[2:]))
    return lax.dynamic_update_slice(block, rows.astype(dtype), (0,) * rows.ndim)
