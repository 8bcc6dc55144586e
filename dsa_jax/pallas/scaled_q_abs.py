"""The absorbed query of a prompt's rows as the Mosaic attend takes it: `a_h = U_k[h]^T q_h`
scaled per (row, head) by a power of two and rounded to f16, in one Pallas Triton launch.

Why a kernel: the attend's wgmma takes f16 operands with |q| below f16's range, so each
(row, head) is scaled by 2^k before the rounding. From the f32 q_abs that needs q_abs written
(a prompt of 9000 rows: 1.18 GB), read back for its amax and written again as f16 (the prep).
This kernel reads q once and writes only the f16 result and the scale: where a program holds
a head's C columns whole (a prompt's bf16 rows, GLM's C = 512) k comes from the f32 result's
own amax in registers (scale "amax"); else from a bound known before the GEMM (`q_abs_bound`:
Cauchy-Schwarz over the GEMM's operands, each row's squares summed from the tile it loads
anyway; scale "bound").

The definition is `scaled_q_abs_xla` (XLA's dot, its f32 result scaled by the power of two,
which is exact, and rounded to f16); the kernel computes the same products in another
summation order, so within the fp32-accumulation bound of the K-term sums, then rounds the
same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.pallas.common import layer_index, round_to, triton_offsets_wrap

__all__ = ["BOUND_MARGIN", "SCALES", "SCALE_TOP", "column_norm", "default_scale",
           "q_abs_bound", "scale_exponent", "scaled_q_abs_pallas", "scaled_q_abs_xla", "tiles"]

# The bound's margin for the f32 rounding of the two norms and of the GEMM's K-term sums
# (each below K 2^-24 relative).
BOUND_MARGIN = 1 + 2.0 ** -10
# k brings the bound into [2^(SCALE_TOP - 1), 2^SCALE_TOP): no |q_abs| 2^k reaches 2^14, so
# the attend's f16 logit products stay finite.
SCALE_TOP = 14
SCALES = ("bound", "amax")


# The kernel's tiles: block_m rows times block_n of the C columns of one head per program, K
# in chunks of BLOCK_K. By the rows' dtype (`tiles`): 64 x 512 for rows that are not f32 (one
# GLM head's C whole, q read once: the faster tiles for a prompt's bf16 rows), 128 x 256 for
# f32 rows. The bound needs a row's whole K, which every program loads anyway; the C columns
# may be split (each program recomputes its rows' bound: the same bits).
F32_TILES, OTHER_TILES = (128, 256), (64, 512)
BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 8, 3


def tiles(q_dtype) -> tuple[int, int]:
    """(block_m, block_n) of the kernel for rows of `q_dtype`."""
    return F32_TILES if jnp.dtype(q_dtype) == jnp.float32 else OTHER_TILES


def default_scale(q_dtype, c: int) -> str:
    """Where each (row, head)'s power of two comes from, for rows of `q_dtype` and C = `c`:
    "amax" (the GEMM's f32 result itself, its largest |a_hc| over the head's C columns: no
    squares, the faster form) where a program holds a head's C columns whole (`tiles`), else
    "bound" (`q_abs_bound`, from the squares summed beside the GEMM). An amax just below 2^14
    may round up to 2^14 in f16 (as the decode prep's may); the attend accumulates in f32."""
    return "amax" if tiles(q_dtype)[1] >= c else "bound"


def _weight(u_k: jax.Array, layer: jax.Array | None) -> jax.Array:
    return u_k if layer is None else lax.dynamic_index_in_dim(u_k, layer, keepdims=False)


def column_norm(w: jax.Array) -> jax.Array:
    """`w [H, Dn, C]` -> `[H]` f32: each head's largest column norm ||U_k[h, :, c]||."""
    w32 = w.astype(jnp.float32)
    return jnp.sqrt(jnp.max(jnp.sum(w32 * w32, axis=1), axis=-1))


def q_abs_bound(q: jax.Array, u_k: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """`q [..., Hl, Dn]` (the U_k GEMM's input), `u_k [Hl, Dn, C]` (a stack `[G, ...]` at
    `layer`) -> `[..., Hl]` f32, at least every |a_h| the GEMM computes: by Cauchy-Schwarz
    |a_hc| <= ||q_h|| ||U_k[h, :, c]||, taken at the GEMM's operands (q rounded to the weight
    dtype) and the largest column, times BOUND_MARGIN."""
    w = _weight(u_k, layer)  # [Hl, Dn, C]
    # reduce_precision, not a convert pair: XLA drops a convert pair under its default
    # xla_allow_excess_precision, and the norm would be q's, not the GEMM operand's.
    qo = round_to(q.astype(jnp.float32), w.dtype)  # [..., Hl, Dn] f32
    return jnp.sqrt(jnp.sum(qo * qo, axis=-1)) * column_norm(w) * BOUND_MARGIN  # [..., Hl]


def scale_exponent(bound: jax.Array) -> jax.Array:
    """`bound [...]` f32 -> k `[...]` int32 bringing it into [2^13, 2^14) (a zero bound: that of
    1: k = 13), clipped to [-126, 126] so that 2^k and 2^-k are normal f32."""
    _, e = jnp.frexp(jnp.where(bound > 0, bound, 1.0))
    return jnp.clip(SCALE_TOP - e, -126, 126).astype(jnp.int32)


def scaled_q_abs_xla(q: jax.Array, u_k: jax.Array, layer: jax.Array | None = None, *,
                     scale: str | None = None) -> tuple[jax.Array, jax.Array]:
    """The definition: `q [..., Hl, Dn]` (f32 or bf16), `u_k [Hl, Dn, C]` (or a stack at `layer`) ->
    (q_abs 2^k as f16 `[..., Hl, C]`, 2^-k `[..., Hl]` f32), k = `scale_exponent` per (row,
    head) of `q_abs_bound` (scale "bound") or of the largest |q_abs| over C ("amax"; None:
    `default_scale`, the kernel's default): the f32 q_abs (the U_k GEMM, fp32
    accumulation) times the power of two (exact), rounded to f16 once."""
    if scale is None:
        scale = default_scale(q.dtype, u_k.shape[-1])
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} must be one of {SCALES}")
    w = _weight(u_k, layer)
    lead = q.shape[:-2]
    rows = q.reshape(-1, *q.shape[-2:]).astype(w.dtype)  # [M, Hl, Dn]
    out = lax.dot_general(rows, w, (((2,), (1,)), ((1,), (0,))),
                          precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)  # [Hl, M, C]
    out = jnp.swapaxes(out, 0, 1).reshape(*lead, *out.shape[::2])  # [..., Hl, C] f32
    top = q_abs_bound(q, w) if scale == "bound" else jnp.max(jnp.abs(out), axis=-1)
    k = scale_exponent(top)  # [..., Hl]
    one = jnp.ones(k.shape, jnp.float32)
    up, down = jnp.ldexp(one, k), jnp.ldexp(one, -k)
    return (out * up[..., None]).astype(jnp.float16), down


def _pow2(k: jax.Array) -> jax.Array:
    """2^k as f32 for int32 k in [-126, 127] (its exponent bits): exact."""
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _kernel(*refs, m: int, k: int, bm: int, bn: int, bk: int, heads: int, stacked: bool,
            amax: bool):
    """Program (j, i, h): rows i*bm.. of head h, C columns j*bn.. (j fastest: the programs
    sharing a row tile run together and read it from L2). One loop over K's chunks (Triton
    pipelines its loads) sums the GEMM and each row's squares (f32 rows); the bound's power
    of two then scales the f32 result, which is rounded to f16 once. amax (scale "amax",
    bn >= C): no squares; the power of two from the result's largest |value| in each row
    (col_ref unread).

    [l_ref [1] int32 when `stacked`]; col_ref [H] f32 (`column_norm`); v_ref [M, H, K]; w_ref
    [H, K, C] ([G*H, K, C] when stacked); o_ref [M, H, C] f16; d_ref [M, H] f32 (2^-k)."""
    l_ref, (col_ref, v_ref, w_ref, o_ref, d_ref) = (refs[0], refs[1:]) if stacked else (None,
                                                                                          refs)
    j, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hw = h + l_ref[0] * heads if stacked else h
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)  # [bm]
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn]
    row_ok, col_ok = rows < m, cols < o_ref.shape[-1]
    precision = lax.Precision.HIGHEST if w_ref.dtype == jnp.float32 else None

    def chunk(t, carry):
        acc, ss = carry  # [bm, bn] f32, [bm] f32
        ks = t * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
        k_ok = ks < k
        a = plt.load(v_ref.at[rows[:, None], h, ks[None, :]],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).astype(w_ref.dtype)
        b = plt.load(w_ref.at[hw, ks[:, None], cols[None, :]],
                     mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [bk, bn]
        a32 = a.astype(jnp.float32)  # [bm, bk]: the operand as the definition rounds it
        return (acc + lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                                      preferred_element_type=jnp.float32),
                ss + jnp.sum(a32 * a32, axis=1))

    def product(t, acc):  # amax: the dot's operands used by the dot alone
        ks = t * bk + jnp.arange(bk, dtype=jnp.int32)
        a = plt.load(v_ref.at[rows[:, None], h, ks[None, :]],
                     mask=row_ok[:, None] & (ks < k)[None, :], other=0.0).astype(w_ref.dtype)
        b = plt.load(w_ref.at[hw, ks[:, None], cols[None, :]],
                     mask=(ks < k)[:, None] & col_ok[None, :], other=0.0)  # [bk, bn]
        return acc + lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    chunks = -(-k // bk)
    if amax:  # columns past C and rows past M hold 0: the loads' fill
        acc = lax.fori_loop(0, chunks, product, jnp.zeros((bm, bn), jnp.float32))
        bound = jnp.max(jnp.abs(acc), axis=1)  # [bm]: the exact amax, the bound's place
    else:
        acc, ss = lax.fori_loop(0, chunks, chunk, (jnp.zeros((bm, bn), jnp.float32),
                                                   jnp.zeros((bm,), jnp.float32)))
        bound = jnp.sqrt(ss) * col_ref[h] * BOUND_MARGIN  # [bm]
    bits = lax.bitcast_convert_type(jnp.where(bound > 0, bound, 1.0), jnp.int32)
    e = jnp.where(bits >> 23 == 0, -126, (bits >> 23) - 126)  # frexp's exponent (a subnormal:
    exp = jnp.clip(SCALE_TOP - e, -126, 126)  # [bm] int32     # clipped to 126 either way)
    plt.store(o_ref.at[rows[:, None], h, cols[None, :]],
              (acc * _pow2(exp)[:, None]).astype(jnp.float16),
              mask=row_ok[:, None] & col_ok[None, :])

    @pl.when(j == 0)
    def _():
        plt.store(d_ref.at[rows, h], _pow2(-exp), mask=row_ok)


def _call(q: jax.Array, w: jax.Array, col: jax.Array, layer: jax.Array | None,
          interpret: bool, bm: int, bn: int, amax: bool) -> tuple[jax.Array, jax.Array]:
    """q [M, H, K], w [H, K, C] (or [G*H, K, C] with a layer index [] int32), col [H]."""
    m, heads, k = q.shape
    c = w.shape[-1]
    stacked = layer is not None
    grid = (pl.cdiv(c, bn), pl.cdiv(m, bm), heads)
    return pl.pallas_call(
        functools.partial(_kernel, m=m, k=k, bm=bm, bn=bn, bk=BLOCK_K, heads=heads,
                          stacked=stacked, amax=amax),
        out_shape=(jax.ShapeDtypeStruct((m, heads, c), jnp.float16),
                   jax.ShapeDtypeStruct((m, heads), jnp.float32)),
        grid=grid,
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="scaled_q_abs",
    )(*([jnp.reshape(layer, (1,))] if stacked else []), col, q, w)


def scaled_q_abs_pallas(q: jax.Array, u_k: jax.Array, layer: jax.Array | None = None, *,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`scaled_q_abs_xla` as one kernel: `q [..., Hl, Dn]` (rounded to u_k's dtype in the
    kernel), `u_k [Hl, Dn, C]` or a stack `[G, Hl, Dn, C]` read in place at `layer` -> (f16
    `[..., Hl, C]`, 2^-k `[..., Hl]` f32), the tiles and the scale by q's dtype and C
    (`tiles`, `default_scale`).

    With scale "bound" the kernel reads f32 rows: q of another dtype is converted first
    (exact): bf16 rows feeding both the dot and the squares in one loop computed wrong results
    on the H200 (Triton 3.6)."""
    bm, bn = tiles(q.dtype)
    scale = default_scale(q.dtype, u_k.shape[-1])
    if scale == "bound":
        q = q.astype(jnp.float32)
    one = u_k.shape[-3:]  # [Hl, Dn, C]
    if q.shape[-2:] != one[:2]:
        raise ValueError(f"scaled_q_abs: q's last axes {list(q.shape[-2:])} must be u_k's "
                         f"[Hl, Dn] = {list(one[:2])}")
    lead, (heads, k, c) = q.shape[:-2], one
    rows = q.reshape(-1, heads, k)  # [M, Hl, Dn]
    m = rows.shape[0]
    if layer is not None:
        if u_k.ndim != 4:
            raise ValueError(f"scaled_q_abs: a stacked u_k must be [G, Hl, Dn, C]; got "
                             f"{list(u_k.shape)}")
        layer = layer_index(layer, u_k.shape[0], "scaled_q_abs: ")
    # The bound's column norms (a pass over the layer's U_k); "amax" never reads them.
    col = (column_norm(_weight(u_k, layer)) if scale == "bound"
           else jnp.ones((heads,), jnp.float32))  # [Hl]
    w = u_k if layer is None else u_k.reshape(-1, k, c)  # [(G*)Hl, Dn, C]: a bitcast
    if m == 0:
        return (jnp.zeros((*lead, heads, c), jnp.float16), jnp.zeros((*lead, heads),
                                                                     jnp.float32))
    # An f16 result of exactly 2^31 elements would be addressed with 32-bit offsets that wrap
    # (common.triton_offsets_wrap): its rows then run in two launches (a row's bits are its
    # own, whatever rows share the launch).
    parts = [rows] if not triton_offsets_wrap((m, heads, c), jnp.float16) else [
        rows[:m // 2], rows[m // 2:]]
    outs = [_call(p, w, col, layer, interpret, bm, bn, scale == "amax") for p in parts]
    q16 = outs[0][0] if len(outs) == 1 else jnp.concatenate([o[0] for o in outs])
    down = outs[0][1] if len(outs) == 1 else jnp.concatenate([o[1] for o in outs])
    return q16.reshape(*lead, heads, c), down.reshape(*lead, heads)
