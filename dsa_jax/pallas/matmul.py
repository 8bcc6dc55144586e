"""Row-invariant GEMMs: `v @ w.T` and the per-head products as one Pallas Triton kernel whose
tiles, K order and K split are fixed by the weight's shape alone, never by the number of rows.

Why: XLA picks each GEMM's algorithm (a cuBLAS kernel, a split-K) per shape, so a row's bits
depend on how many rows share the GEMM; the decode therefore computes every sequence's
max_verify rows, so that its one real row gets the bits a verify gives it (layer.py). A tile of
this kernel computes each of its rows alone (an MMA row does not read the others) over the same
K chunks in the same order at any M: a row has the same bits in a 4-row GEMM and a 256-row one,
which lets a decode run its own rows only.

The definition is `projection.matmul` / `projection.per_head` (XLA's dot, fp32 accumulation);
this kernel computes the same products with another summation order, within the bf16 operands'
fp32-accumulation bound, and the same bits for a row at every M.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.fp8 import Fp8Block, StackedRows, dense
from dsa_jax.pallas.colaunch import Part
from dsa_jax.pallas.common import (
    check_triton_addressable,
    check_triton_blocks,
    layer_index,
    load_parts,
    next_pow2,
    with_overrides,
)

__all__ = ["MatmulTuning", "default_tuning", "matmul_pallas", "matmul_part", "matmul_xla",
           "per_head_pallas", "per_head_xla", "reads_fp8", "splits_for",
           "summed_columns_part", "summed_columns_xla"]


@dataclasses.dataclass(frozen=True)
class MatmulTuning:
    """Tiles of `matmul_pallas` / `per_head_pallas` (`default_tuning` picks them per shape).

    A row's bits depend on `splits` (and on N and K), not on the tile shapes: an MMA row reads
    no other row, and each tile sums its K chunks in order, 16 at a time, whatever block_k.
    So `default_tuning` fixes `splits` from the weight's shape and picks the tiles per M.

    block_m, block_n, block_k: the program's tile of rows, output columns and the K chunk of
    one loop step (powers of two, >= 16). splits: K is cut into this many contiguous parts, one
    program each, summed afterwards in split order (for GEMMs with few column tiles and a long
    K). num_warps, num_stages: Triton's launch and software-pipelining depth. swap_ab: the
    MMA computes the tile transposed, `out^T [bn, bm] = w_tile @ v_tile^T`: the weight's
    columns fill the MMA's 64-row side and the rows its narrow one (a few rows waste no
    64-row tile)."""
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False


# Up to this many rows the kernel rounds v to w's dtype itself (no conversion launch); past it
# v is converted before the call: every column program re-reads the row tile, and an fp32
# copy of it doubles that traffic. Either way the rows are rounded to nearest even: the same
# bits.
CONVERT_IN_KERNEL_ROWS = 16
SMEM_BUDGET = 200 * 1024  # of the H200's 227 KiB per block: Triton's pipeline stages
# The narrowest M side of an MMA over dequantized fp8 tiles (block_m, or block_n of a swap_ab
# tile): from 64 on the dot sums in the bf16 weight's order (the same bits); Triton lays out a
# 16- or 32-wide dot over converted fp8 tiles otherwise (docs/decisions.md).
FP8_MIN_BLOCK_M = 64
# Up to this many rows an fp8 weight's tiles are swap_ab ones (64 weight columns by 16 or 64
# rows): the 64-row tiles fp8 needs otherwise would be mostly padding rows at a decode's few
# rows. The per-head products (U_k, U_v: short K, many heads) swap only at a few rows.
FP8_SWAP_ROWS = 64
FP8_SWAP_ROWS_PER_HEAD = 16


def reads_fp8(w) -> bool:
    """Whether the kernel reads fp8 blocks of `w` (an `Fp8Block`, or `StackedRows` with one)."""
    parts = w.parts if isinstance(w, StackedRows) else (w,)
    return any(isinstance(p, Fp8Block) for p in parts)


def splits_for(n: int, k: int, heads: int = 1) -> int:
    """The K split of an `[n, k]` weight (`heads` of them): enough 64-column programs to cover
    the H200's 132 multiprocessors, with K parts of at least 512. The one tuning field a row's
    bits depend on, so a function of the weight's shape alone."""
    tiles, splits = heads * -(-n // 64), 1
    while tiles * splits < 128 and k % (splits * 2 * 64) == 0 and k // (splits * 2) >= 512:
        splits *= 2
    return splits


def default_tuning(n: int, k: int, heads: int = 1, m: int = 64, fp8_weight: bool = False,
                   w_kn: bool = False) -> MatmulTuning:
    """The tiles for `m` rows times an `[n, k]` weight (`heads` of them for the per-head
    products): `splits_for(n, k, heads)`, whatever m (the rows' bits), and tile shapes chosen
    per m (docs/performance.md): 16-row tiles for a few rows, 128-row ones past 64, 128-deep K
    chunks for the long-K GEMMs, deeper pipelines where a program's K part is long; 128-deep K
    chunks also for the per-head products over K >= 512 at up to 64 rows (a prompt's rows
    keep 64). fp8_weight (the kernel dequantizes fp8 tiles): up to FP8_SWAP_ROWS rows
    (FP8_SWAP_ROWS_PER_HEAD for the per-head products), `swap_ab` tiles of 64 weight
    columns (not for a weight `[H, K, N]`, w_kn: transposing its dequantized tile costs
    more than the padding rows save); else 64-row tiles at least, the rows converted
    before the call. Either way the MMA's M side is 64 or more, so the dot sums in the bf16
    weight's order (Triton arranges a 16-wide dot over converted fp8 tiles otherwise:
    docs/decisions.md)."""
    splits = splits_for(n, k, heads)
    deep = heads == 1 or (k >= 512 and m <= 64)
    block_k = 128 if deep and k % (splits * 128) == 0 else 64
    while block_k > 16 and k % (splits * block_k):  # K chunks that end at K where they can
        block_k //= 2
    block_m = 16 if m <= 16 else 64 if m <= 64 else 128
    block_n = 64 if n >= 64 else max(16, 1 << (max(n, 1) - 1).bit_length())
    swap_ab = (fp8_weight and block_n >= FP8_MIN_BLOCK_M and not w_kn
               and m <= (FP8_SWAP_ROWS if heads == 1 else FP8_SWAP_ROWS_PER_HEAD))
    if fp8_weight and not swap_ab:
        block_m = max(block_m, FP8_MIN_BLOCK_M)
    if (m > 64 or heads > 1) and n >= 128 and not swap_ab:
        block_n = 128
    # Operand tiles in shared memory per pipeline stage: the rows in w's dtype past
    # CONVERT_IN_KERNEL_ROWS (converted before the call), in fp32 below it.
    a_bytes = 2 if m > CONVERT_IN_KERNEL_ROWS or (fp8_weight and not swap_ab) else 4
    stage_bytes = block_k * (block_m * a_bytes + block_n * (1 if fp8_weight else 2))
    stages = min(5 if k // splits >= 4096 else 3, SMEM_BUDGET // stage_bytes)
    warps = 8 if block_m * block_n >= 128 * 128 else 4  # the accumulator over 256 threads
    return MatmulTuning(block_m=block_m, block_n=block_n, block_k=block_k, splits=splits,
                        num_warps=warps, num_stages=stages, swap_ab=swap_ab)


def matmul_xla(v: jax.Array, w: jax.Array, layer: jax.Array | None = None, *,
               out_dtype=jnp.float32) -> jax.Array:
    """The definition: `v [..., K] @ w.T` for an `[N, K]` weight -> `[..., N]` f32 (operands in
    the weight's dtype, fp32 accumulation), as `projection.matmul` computes it. layer: `w` is a
    stack `[G, N, K]` and this is the index `[]` int32 of the weight to use (clamped to G).
    out_dtype: the GEMM's result dtype (its fp32 sums rounded once; for a caller that rounds
    the result to that dtype anyway)."""
    w = dense(_layer_of(w, layer))
    return jnp.einsum("...i,oi->...o", v.astype(w.dtype), w, precision=lax.Precision.HIGHEST,
                      preferred_element_type=out_dtype)


def per_head_xla(v: jax.Array, w: jax.Array, w_contract: int,
                 layer: jax.Array | None = None, *, out_dtype=jnp.float32) -> jax.Array:
    """The definition: `v [..., H, K]` times each head's `w [H, ., .]` contracting `w`'s axis
    `w_contract` (1: `w [H, K, N]`, 2: `w [H, N, K]`) -> `[..., H, N]` f32. layer: `w` is a
    stack `[G, H, ., .]` and this is the index `[]` int32 of the weight to use. out_dtype:
    the f32 result rounded to it (for a caller that rounds it anyway: a prompt's U_v product,
    which o_proj reads in the weights' dtype)."""
    w = dense(_layer_of(w, layer))
    lead = v.shape[:-2]
    rows = v.reshape(-1, *v.shape[-2:]).astype(w.dtype)  # [M, H, K]
    out = lax.dot_general(rows, w, (((2,), (w_contract,)), ((1,), (0,))),
                          precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)  # [H, M, N]
    return jnp.swapaxes(out, 0, 1).reshape(*lead, *out.shape[::2]).astype(out_dtype)


def _tile(ids, *refs, m: int, n: int, k: int, bm: int, bn: int, bk: int, tiles: int,
          splits: int, heads: int, w_kn: bool, stacked: bool,
          fp8_block: tuple[int, int] | None = None, swap_ab: bool = False, col0: int = 0):
    """Program ids (i, j, hs): rows i*bm.., columns j*bn.. of head hs // splits, K part
    hs % splits (the kernel's program ids, or a co-launch's: `colaunch.Part`).

    [l_ref [1] int32: the layer, when `stacked`]; v_ref [M, H, K]; w_ref [H, N, K] (or
    [H, K, N] when w_kn; [G*H, ...] when stacked: layer l's heads at l*H..); o_ref
    [S, M, H, N] f32, the part's sum over its `tiles` K chunks, in order (columns past K read
    as zeros), or with one part its sum rounded to o_ref's dtype. A stacked weight gives the
    same tiles the same numbers: the same bits.

    fp8_block: w_ref holds fp8 values and s_ref (after it) their fp32 scales, one per block
    of w's last two axes: each loaded tile is dequantized to bf16 (`values * scale` in fp32,
    rounded once: `fp8.dequantize_blocks`), so the dot sees the bf16 weight's very tile and
    the result has its bits. col0: the tile's columns are written at col0 + .. of o_ref (a
    row part of `fp8.StackedRows`, in the whole weight's output)."""
    l_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
    v_ref, w_ref, s_ref, o_ref = refs if fp8_block else (refs[0], refs[1], None, refs[2])
    w_dtype = jnp.bfloat16 if fp8_block else w_ref.dtype
    i, j, hs = ids
    h, s = hs // splits, lax.rem(hs, splits)
    hw = h + l_ref[0] * heads if stacked else h  # the weight's head in w_ref
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)  # [bm]
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn]
    row_ok, col_ok = rows < m, cols < n

    def tile_scales(ks, t):
        """The scales of w's tile, broadcastable to it: one per column of the tile where its
        K chunk lies in one block of K (a [bn] load), else one per element."""
        k_block = fp8_block[0] if w_kn else fp8_block[1]
        if k_block % bk:  # a chunk across K blocks
            return plt.load(s_ref.at[hw, at_of(ks)[1] // fp8_block[0],
                                     at_of(ks)[2] // fp8_block[1]],
                            mask=ok_of(ks), other=0.0)
        kb = (s * tiles + t) * bk // k_block  # the chunk's block of K
        if w_kn:  # w [K, N]: scale [K / b0, N / b1]
            return plt.load(s_ref.at[hw, kb, cols // fp8_block[1]], mask=col_ok,
                            other=0.0)[None, :]
        return plt.load(s_ref.at[hw, cols // fp8_block[0], kb], mask=col_ok,
                        other=0.0)[:, None]

    def at_of(ks):
        return (hw, ks[:, None], cols[None, :]) if w_kn else (hw, cols[:, None], ks[None, :])

    def ok_of(ks):
        k_ok = ks < k
        return k_ok[:, None] & col_ok[None, :] if w_kn else col_ok[:, None] & k_ok[None, :]

    def chunk(t, acc):
        ks = (s * tiles + t) * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
        k_ok = ks < k
        a = plt.load(v_ref.at[rows[:, None], h, ks[None, :]],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = a.astype(w_dtype)  # [bm, bk]: the operand rounded as the definition rounds it
        at, ok = at_of(ks), ok_of(ks)
        b = plt.load(w_ref.at[at], mask=ok, other=0.0)  # [bk, bn] or [bn, bk]
        if fp8_block:  # the tile's scales, by block of w's two last axes
            b = (b.astype(jnp.float32) * tile_scales(ks, t)).astype(w_dtype)
        if swap_ab:  # acc^T [bn, bm] += w_tile @ a^T
            dims = (((0,), (1,)), ((), ())) if w_kn else (((1,), (1,)), ((), ()))
            return acc + lax.dot_general(b, a, dims, preferred_element_type=jnp.float32)
        dims = (((1,), (0,)), ((), ())) if w_kn else (((1,), (1,)), ((), ()))
        return acc + lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    shape = (bn, bm) if swap_ab else (bm, bn)
    acc = lax.fori_loop(0, tiles, chunk, jnp.zeros(shape, jnp.float32))  # [bm, bn] or [bn, bm]
    if swap_ab:
        plt.store(o_ref.at[s, rows[None, :], h, col0 + cols[:, None]], acc.astype(o_ref.dtype),
                  mask=row_ok[None, :] & col_ok[:, None])
    else:
        plt.store(o_ref.at[s, rows[:, None], h, col0 + cols[None, :]], acc.astype(o_ref.dtype),
                  mask=row_ok[:, None] & col_ok[None, :])


def _check(tuning: MatmulTuning, k: int) -> int:
    """Refuse tiles Triton cannot take; return the K chunks per split."""
    check_triton_blocks(tuning, ("block_m", "block_n", "block_k"))
    tiles = -(-k // (tuning.splits * tuning.block_k)) if tuning.splits >= 1 else 0
    if tuning.splits < 1 or (tuning.splits - 1) * tiles * tuning.block_k >= k:
        raise ValueError(f"MatmulTuning.splits={tuning.splits} must be >= 1 and leave every "
                         f"split some of K={k} in chunks of block_k={tuning.block_k}")
    return tiles


def _gemm_part(v: jax.Array, w, w_kn: bool, tuning: MatmulTuning,
               layer: jax.Array | None = None, out_dtype=jnp.float32, *, col0: int = 0,
               n_out: int | None = None):
    """The kernel for `_gemm`'s operands as a `colaunch.Part`, and `finish(outs) -> [M, H, N]`
    (the K parts summed in split order). v has M >= 1 rows. An `fp8.StackedRows` weight is
    one part whose column tiles run its row parts in turn, each at the whole weight's tiles
    and K split, into one output (`_rows_part`). col0, n_out: this weight's columns are
    columns col0.. of an output n_out wide."""
    if isinstance(w, StackedRows):
        return _rows_part(v, w, tuning, layer, out_dtype)
    m, heads, k = v.shape
    n = w.shape[-1] if w_kn else w.shape[-2]
    n_out = n_out or n
    stacked = layer is not None
    blocks = w.block if isinstance(w, Fp8Block) else None
    weights = (w.values, w.scale) if blocks else (w,)  # the kernel's weight operands
    if stacked:
        layer = _check_layer(w, layer, heads)  # clamped, as the twin's dynamic index
        weights = tuple(a.reshape(-1, *a.shape[2:]) for a in weights)  # [G*H, ., .]: bitcasts
    tiles = _check(tuning, k)
    side = ("block_n", tuning.block_n) if tuning.swap_ab else ("block_m", tuning.block_m)
    if blocks and side[1] < FP8_MIN_BLOCK_M:
        raise ValueError(f"MatmulTuning.{side[0]}={side[1]} (swap_ab={tuning.swap_ab}) over an "
                         f"fp8 weight: an MMA side of fewer than {FP8_MIN_BLOCK_M} sums in "
                         f"another order than the bf16 weight's (use default_tuning(..., "
                         f"fp8_weight=True))")
    if m > CONVERT_IN_KERNEL_ROWS or (blocks and not tuning.swap_ab):  # fp8 (unless the
        # rows are the MMA's shared-memory operand): `default_tuning(fp8_weight=True)` says why
        v = v.astype(w.dtype)
    for name, arr in (("v", v), ("w", weights[0])):
        check_triton_addressable(arr.shape, arr.dtype, f"matmul's {name}")
    t = tuning
    body = functools.partial(_tile, m=m, n=n, k=k, bm=t.block_m, bn=t.block_n, bk=t.block_k,
                             tiles=tiles, splits=t.splits, heads=heads, w_kn=w_kn,
                             stacked=stacked, fp8_block=blocks, swap_ab=t.swap_ab, col0=col0)
    part = Part(body, (pl.cdiv(m, t.block_m), pl.cdiv(n, t.block_n), heads * t.splits),
                tuple([jnp.reshape(layer, (1,))] if stacked else []) + (v, *weights),
                (jax.ShapeDtypeStruct((t.splits, m, heads, n_out),
                                      out_dtype if t.splits == 1 else jnp.float32),))
    return part, functools.partial(_sum_splits, splits=t.splits, out_dtype=out_dtype)


def _rows_part(v: jax.Array, w: StackedRows, tuning: MatmulTuning,
               layer: jax.Array | None, out_dtype):
    """`_gemm_part` of a `StackedRows` weight `[1, N, K]` (its parts `[1, N_i, K]`, or stacks):
    one part, column tiles `[0, t_0)` running the first row part's tile, the next `t_1` the
    second's, ..., each writing its columns in place in the one `[S, M, 1, N]` output (no
    concatenation). The same tiles and K split as each part alone: the same bits."""
    n = w.shape[-2]
    subs, col0 = [], 0
    for p in w.parts:
        subs.append(_gemm_part(v, p, False, tuning, layer, out_dtype, col0=col0, n_out=n)[0])
        col0 += p.shape[-2]
    grids = [sp.grid[1] for sp in subs]  # each row part's column tiles
    n_in = [len(sp.inputs) for sp in subs]

    def body(ids, *refs):
        i, j, hs = ids
        first, at = 0, 0
        for sp, tiles, a in zip(subs, grids, n_in, strict=True):
            @pl.when((j >= first) & (j < first + tiles))
            def _(sp=sp, first=first, at=at, a=a):
                sp.body((i, j - first, hs), *refs[at:at + a], refs[-1])

            first, at = first + tiles, at + a

    grid = (subs[0].grid[0], sum(grids), subs[0].grid[2])
    part = Part(body, grid, tuple(x for sp in subs for x in sp.inputs), subs[0].out_shape)
    return part, functools.partial(_sum_splits, splits=tuning.splits, out_dtype=out_dtype)


def _sum_splits(outs, *, splits: int, out_dtype):
    """A GEMM part's outputs `[S, M, H, N]` -> `[M, H, N]`: the K parts summed in split
    order (elementwise: the same for every row)."""
    parts = outs[0]
    out = parts[0]
    for s in range(1, splits):
        out = out + parts[s]
    return out.astype(out_dtype)


def _gemm(v: jax.Array, w: jax.Array, w_kn: bool, interpret: bool, tuning: MatmulTuning,
          layer: jax.Array | None = None, out_dtype=jnp.float32) -> jax.Array:
    """v [M, H, K] (any float dtype: rounded to w's in the kernel), w [H, N, K] or [H, K, N]
    -> [M, H, N] f32, or the f32 sums rounded to out_dtype (in the kernel where there is one
    K part). layer: w is a stack [G, H, ., .] read in place at this index [] int32 (no copy
    of the layer's weight: a kernel operand must be a whole buffer)."""
    if v.shape[0] == 0:  # the same refusals as with rows, then nothing to compute
        if layer is not None:
            _check_layer(w, layer, v.shape[1])
        _check(tuning, v.shape[2])
        return jnp.zeros((0, v.shape[1], w.shape[-1] if w_kn else w.shape[-2]), out_dtype)
    part, finish = _gemm_part(v, w, w_kn, tuning, layer, out_dtype)
    t = tuning
    outs = pl.pallas_call(
        lambda *refs: part.body((pl.program_id(0), pl.program_id(1), pl.program_id(2)), *refs),
        out_shape=part.out_shape,
        grid=part.grid,
        compiler_params=plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name="matmul",
    )(*part.inputs)
    return finish(outs)


def matmul_part(v: jax.Array, w: jax.Array, layer: jax.Array | None = None, *,
                tuning: MatmulTuning | None = None, summed: bool = True):
    """`matmul_pallas(v, w, layer)`'s kernel as a `colaunch.Part` and `finish(outs)`, which
    turns the part's outputs into `matmul_pallas`'s result (for a launch shared with other
    kernels: `pallas/colaunch.py`). v [..., K] with at least one row, w [N, K] (an array, an
    `fp8.Fp8Block` or `fp8.StackedRows`: one part either way; or a stack [G, N, K] read in
    place at `layer`); the same tiles (tuning None: `default_tuning(N, K)`
    for v's rows), so the same bits. summed False: `finish` returns the K parts unsummed,
    `[S, ..., N]` f32, for kernels that read them and add them in split order themselves
    (`common.load_parts`, `summed_columns_part`: the same values as the sum)."""
    n, k = w.shape[-2:]
    lead = v.shape[:-1]
    rows = v.reshape(-1, 1, k)  # [M, 1, K]
    if rows.shape[0] == 0:
        raise ValueError("matmul_part: v has no rows")
    heads_w = _one_head(w, layer is not None)  # [1, N, K] or [G, 1, N, K]
    tuning = tuning or default_tuning(n, k, 1, rows.shape[0], reads_fp8(w))
    part, finish = _gemm_part(rows, heads_w, False, tuning, layer)
    if summed:
        return part, lambda outs: finish(outs).reshape(*lead, n)
    return part, lambda outs: outs[0].reshape(tuning.splits, *lead, n)


def _columns_program(ids, p_ref, o_ref, *, parts: int, start: int, width: int):
    """Row ids[0]: p_ref [S, M, >= start + width] f32, its columns summed over the parts in
    split order -> o_ref [M, width]."""
    (i,) = ids
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)
    ok = cols < width
    plt.store(o_ref.at[i, cols], load_parts(p_ref, parts, i, start + cols, mask=ok), mask=ok)


def summed_columns_xla(parts: jax.Array, start: int, width: int) -> jax.Array:
    """The definition: `parts [S, ..., N]` (`matmul_part(summed=False)`'s) summed in split
    order, columns `start .. start + width - 1` -> `[..., width]` f32 (as `finish` sums)."""
    out = parts[0]
    for s in range(1, parts.shape[0]):
        out = out + parts[s]
    return out[..., start:start + width]


def summed_columns_part(parts: jax.Array, start: int, width: int):
    """`summed_columns_xla` as a `colaunch.Part` (a program per row) and `finish(outs)`: the
    same f32 adds in the same order, so the same values."""
    s, *lead, n = parts.shape
    if not (0 <= start and 1 <= width and start + width <= n):
        raise ValueError(f"summed_columns: columns {start}..{start + width} outside {n}")
    flat = parts.reshape(s, -1, n)  # [S, M, N]
    m = flat.shape[1]
    body = functools.partial(_columns_program, parts=s, start=start, width=width)
    part = Part(body, (m,), (flat,), (jax.ShapeDtypeStruct((m, width), jnp.float32),))
    return part, lambda outs: outs[0].reshape(*lead, width)


def matmul_pallas(v: jax.Array, w: jax.Array, layer: jax.Array | None = None, *,
                  interpret: bool = False, tuning: MatmulTuning | None = None, **overrides
                  ) -> jax.Array:
    """`matmul_xla` as the row-invariant kernel: `v [..., K]`, `w [N, K]` -> `[..., N]` f32
    (`w` an array, an `fp8.Fp8Block` or `fp8.StackedRows`: the same bits as its bf16 weight).
    layer: `w` is a stack `[G, N, K]`, read in place at this index. tuning: the tiles
    (`default_tuning(N, K)` when None); overrides: single fields of it."""
    n, k = w.shape[-2:]
    lead = v.shape[:-1]
    rows = v.reshape(-1, 1, k)  # [M, 1, K]
    tuning = with_overrides(tuning or default_tuning(n, k, 1, rows.shape[0], reads_fp8(w)),
                            overrides)
    heads_w = _one_head(w, layer is not None)  # [1, N, K] or [G, 1, N, K]
    return _gemm(rows, heads_w, False, interpret, tuning, layer).reshape(*lead, n)


def per_head_pallas(v: jax.Array, w: jax.Array, w_contract: int,
                    layer: jax.Array | None = None, *, out_dtype=jnp.float32,
                    interpret: bool = False, tuning: MatmulTuning | None = None, **overrides
                    ) -> jax.Array:
    """`per_head_xla` as the row-invariant kernel: `v [..., H, K]`, `w [H, K, N]` (w_contract
    1) or `[H, N, K]` (2) -> `[..., H, N]` f32 (or its rounding to out_dtype: the same bits as
    the f32 result rounded). layer: `w` is a stack `[G, H, ., .]`, read in place at this
    index."""
    if w_contract not in (1, 2):
        raise ValueError(f"w_contract={w_contract} must be 1 or 2")
    one = w.shape[-3:]  # [H, ., .]: one layer's
    heads, k = one[0], one[w_contract]
    n = one[3 - w_contract]
    lead = v.shape[:-2]
    rows = v.reshape(-1, heads, k)  # [M, H, K]
    tuning = with_overrides(tuning or default_tuning(n, k, heads, rows.shape[0],
                                                     reads_fp8(w), w_contract == 1), overrides)
    out = _gemm(rows, w, w_contract == 1, interpret, tuning, layer, out_dtype)  # [M, H, N]
    return out.reshape(*lead, heads, n)


def _one_head(w, stacked: bool = False):
    """`w [N, K]` (an array or an `Fp8Block`) as one head `[1, N, K]`; a stack `[G, N, K]`
    as `[G, 1, N, K]`."""
    at = (slice(None), None) if stacked else (None,)
    if isinstance(w, StackedRows):
        return StackedRows(tuple(_one_head(p, stacked) for p in w.parts))
    if isinstance(w, Fp8Block):
        return Fp8Block(w.values[at], w.scale[at], w.block)
    return w[at]


def _layer_of(w, layer: jax.Array | None):
    """Layer `layer` of a stacked weight `[G, ...]` (an array or an `Fp8Block`: its values
    and scales), as XLA's dynamic index takes it (clamped); `w` itself where layer is None."""
    if layer is None:
        return w
    if isinstance(w, Fp8Block):
        return Fp8Block(lax.dynamic_index_in_dim(w.values, layer, keepdims=False),
                        lax.dynamic_index_in_dim(w.scale, layer, keepdims=False), w.block)
    return lax.dynamic_index_in_dim(w, layer, keepdims=False)


def _check_layer(w: jax.Array, layer: jax.Array, heads: int) -> jax.Array:
    """A stacked weight `[G, H, ., .]` and a scalar integer index (its value is data): the
    index clamped to [0, G) as XLA's dynamic index clamps it."""
    if w.ndim != 4 or w.shape[1] != heads:
        raise ValueError(f"matmul: a stacked weight must be [G, {heads}, ., .]; got "
                         f"{list(w.shape)}")
    return layer_index(layer, w.shape[0], "matmul: ")
