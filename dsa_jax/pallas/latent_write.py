"""The latent write: RMSNorm, quantize to the cache dtype, scatter into the row's paged slot.

`c = w * v / sqrt(mean(v^2) + eps)` of the raw `kv_a` output `v`, stored at
`table[t // bs] * bs + t % bs` as `clip(c / s, -448, 448)` in float8_e4m3fn (per-tensor scale
`s`), or cast for a bf16 / fp32 cache. Rows that are not valid write nothing.

Where the Pallas Triton kernel cannot address the cache (`common.triton_offsets_wrap`: an fp8
cache of 2..4 GiB, whose element offsets it would compute in 32 bits and wrap), the same
kernel computes the rows into a small `[N, C]` buffer and XLA stores them with a scatter
(64-bit addressing; on the GPU in place, the cache donated). The stored bytes are the same
either way: the kernel's values are computed by the same code, only the store differs
(`pick_store`; tests/test_write_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.numerics import tree_sum
from dsa_jax.pallas.colaunch import Part
from dsa_jax.pallas.common import (
    check_triton_addressable,
    load_parts,
    next_pow2,
    quantize,
    stacked_weight,
    triton_offsets_wrap,
)
from dsa_jax.pallas.index_write import SHARED_ROWS


def warps_for(rows_per_seq: int) -> int:
    """The write's warps per program (one program per row of C values) for steps of
    `rows_per_seq` rows per sequence: 4 up to `index_write.SHARED_ROWS` (a decode's or a
    verify's: the decode front's launch runs the same program at the same warps,
    `decode_front`), 2 beyond (a prompt's)."""
    return 4 if rows_per_seq <= SHARED_ROWS else 2


def _rms_norm_rows(v: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """fp32 RMSNorm over the last axis of rows `v [..., C]`, the sum in a fixed tree (a row's
    bits whatever the batch: `tree_sum`)."""
    return w * v * lax.rsqrt(tree_sum(v * v)[..., None] / v.shape[-1] + eps)


def _rms_norm(v: jax.Array, w: jax.Array, eps: float, width: int) -> jax.Array:
    """fp32 RMSNorm over the last axis; `width` real entries (padding is zero)."""
    return w * v * lax.rsqrt(jnp.sum(v * v, axis=-1, keepdims=True) / width + eps)


def flat_slots(pos: jax.Array, valid: jax.Array, block_tables: jax.Array, block_size: int
               ) -> jax.Array:
    """Positions `[B, R]` -> flat cache rows `[B, R]`; -1 where not valid, and where the
    position lies past the block table (such a write is dropped, never redirected)."""
    nblocks = block_tables.shape[1]
    entry = jnp.take_along_axis(block_tables, table_column(pos, nblocks, block_size), axis=1)
    return slot_at(entry, pos, valid, nblocks, block_size)


def table_column(pos: jax.Array, nblocks: int, block_size: int) -> jax.Array:
    """The block-table column of each position, clamped into the table."""
    return jnp.clip(pos // block_size, 0, nblocks - 1)


def slot_at(entry: jax.Array, pos: jax.Array, valid: jax.Array, nblocks: int,
            block_size: int) -> jax.Array:
    """`flat_slots` from each position's table entry (its physical block): plain jnp, so that
    a kernel reading the entries itself (`pallas/row_meta.py`) computes the same."""
    in_table = (pos >= 0) & (pos < nblocks * block_size)
    return jnp.where(valid & in_table, entry * block_size + pos % block_size, -1)


def raw_columns(kv_raw: jax.Array, c: int, col: int | None) -> int:
    """The first of kv_raw's C raw-latent columns (`col`, or 0 for a `[..., C]` kv_raw),
    checked against its width."""
    start = 0 if col is None else col
    if start < 0 or start + c > kv_raw.shape[-1] or (col is None and kv_raw.shape[-1] != c):
        raise ValueError(f"latent_write: kv_raw's last axis is {kv_raw.shape[-1]}; it needs "
                         f"the cache's C = {c} columns from col={col}")
    return start


def latent_write_xla(kv_raw: jax.Array, norm_w: jax.Array, latent: jax.Array,
                     kv_scale: jax.Array, block_tables: jax.Array, pos: jax.Array,
                     valid: jax.Array, *, eps: float, col: int | None = None,
                     layer: jax.Array | None = None) -> jax.Array:
    """The definition.

    kv_raw: [B, R, C] f32 (before the norm); norm_w: [C] f32; latent: [NB, bs, C] cache dtype;
    kv_scale: [] f32; block_tables: [B, MB] int32; pos, valid: [B, R]. Returns the new cache.
    col: static; kv_raw is a wider `[B, R, N]` (the x projection's output) whose columns
    `col .. col + C - 1` are the raw latent, read in place by the kernel (no slice copy).
    layer: norm_w is a stack `[G, C]` and this the index `[]` of the layer's row (the model's
    scan: the kernel reads it in place).
    """
    nb, bs, c = latent.shape
    at = stacked_weight(norm_w, layer, (c,), "latent_write's norm_w")
    norm_w = norm_w if at is None else norm_w[at]
    start = raw_columns(kv_raw, c, col)
    kv_raw = kv_raw[..., start:start + c]
    stored = quantize(_rms_norm_rows(kv_raw.astype(jnp.float32), norm_w, eps), kv_scale,
                      latent.dtype)
    slots = flat_slots(pos, valid, block_tables, bs)
    slots = jnp.where(slots >= 0, slots, nb * bs)  # out of range: dropped, never clamped
    flat = latent.reshape(nb * bs, c).at[slots.reshape(-1)].set(stored.reshape(-1, c),
                                                                mode="drop")
    return flat.reshape(nb, bs, c)


def _write_program(ids, *refs, width: int, eps: float, to_rows: bool, col: int,
                   stacked: bool, parts: int):
    """Row ids[0]: [l_ref [1] int32 when `stacked`], scale_ref [1] f32, w_ref [C] f32 (or [G, C]
    read at row l), raw_ref [S, N, >= col + C] f32 (its columns col.. are the row's, its S
    parts summed: `load_parts`), slots_ref
    [N] int32 (whole arrays). out_ref (the last of `refs`): the cache itself [NS, C]
    (aliased, after the cache input), written at the row's slot; or, when `to_rows`, the rows
    [N, C], written at the program's row."""
    l_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
    scale_ref, w_ref, raw_ref, slots_ref = refs[:4]
    out_ref = refs[-1]
    (i,) = ids
    cp = next_pow2(width)
    cols = jnp.arange(cp, dtype=jnp.int32)  # [Cp]
    in_width = cols < width
    raw = load_parts(raw_ref, parts, i, col + cols, mask=in_width)  # [Cp]
    w_at = (l_ref[0], cols) if stacked else (cols,)  # one indexer (Triton takes no chain)
    w = plt.load(w_ref.at[w_at], mask=in_width, other=0.0)  # [Cp]
    stored = quantize(_rms_norm(raw, w, eps, width), scale_ref[0], out_ref.dtype)  # [Cp]
    if to_rows:
        plt.store(out_ref.at[i, cols], stored, mask=in_width)
        return
    slot = slots_ref[i]
    plt.store(out_ref.at[jnp.maximum(slot, 0), cols], stored, mask=in_width & (slot >= 0))


def pick_store(cache_shape, cache_dtype) -> str:
    """Who stores the rows into a cache `[NB, bs, C]`: "kernel" (in place, through the cache
    aliased to the kernel's output) unless `triton_offsets_wrap` says the kernel cannot
    address it, then "xla" (the kernel returns the rows `[N, C]`, an XLA scatter stores them).
    Both give the same bytes."""
    nb, bs, c = cache_shape
    return "xla" if triton_offsets_wrap((nb * bs, c), cache_dtype) else "kernel"


def scatter_rows(latent: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """Store `rows [N, C]` at the flat cache rows `slots [N]` of `latent [NB, bs, C]`; a slot
    < 0 writes nothing (pointed past the cache and dropped, never clamped)."""
    nb, bs, c = latent.shape
    idx = jnp.where(slots >= 0, slots, nb * bs)  # [N]
    flat = latent.reshape(nb * bs, c).at[idx].set(rows, mode="drop")
    return flat.reshape(nb, bs, c)


def _operands(kv_raw, norm_w, latent, kv_scale, block_tables, pos, valid, col, layer, slots,
              parts=None):
    """The kernel's operands (the cache not among them) and its static parameters."""
    nb, bs, c = latent.shape
    at = stacked_weight(norm_w, layer, (c,), "latent_write's norm_w")
    lead = [] if at is None else [jnp.reshape(at, (1,))]
    s = 1 if parts is None else parts
    if parts is not None and (kv_raw.ndim != 4 or kv_raw.shape[0] != parts):
        raise ValueError(f"latent_write: kv_raw has shape {kv_raw.shape}; parts={parts} needs "
                         f"[{parts}, B, R, N]")
    b, r, width = kv_raw.shape[-3:]
    n = b * r
    start = raw_columns(kv_raw, c, col)
    if slots is None:
        slots = flat_slots(pos, valid, block_tables, bs).reshape(n).astype(jnp.int32)
    elif slots.shape != (n,):
        raise ValueError(f"latent_write: slots has shape {slots.shape}; {n} rows need ({n},)")
    scale = jnp.reshape(jnp.asarray(kv_scale, jnp.float32), (1,))
    operands = [*lead, scale, norm_w.astype(jnp.float32),
                kv_raw.reshape(s, n, width).astype(jnp.float32), slots]
    return operands, dict(width=c, col=start, stacked=at is not None, parts=s), n


def latent_write_part(kv_raw: jax.Array, norm_w: jax.Array, latent: jax.Array,
                      kv_scale: jax.Array, block_tables: jax.Array, pos: jax.Array,
                      valid: jax.Array, *, eps: float, col: int | None = None,
                      layer: jax.Array | None = None, slots: jax.Array | None = None,
                      parts: int | None = None):
    """`latent_write_pallas`'s kernel storing in place (store "kernel") as a `colaunch.Part`
    (a program per row, the cache aliased to its output) and `finish(outs)` -> the new cache
    `[NB, bs, C]` (for a launch shared with other kernels: the same program, so the same
    bytes at the same warps, `warps_for`). Refused (`KernelLimitError`) where the kernel
    cannot address the cache (`pick_store` gives "xla" there). parts: kv_raw is
    `[S, B, R, N]`, a split GEMM's K parts (`matmul_part(summed=False)`), stored as their sum
    (`load_parts`: the same values)."""
    check_triton_addressable(latent.shape, latent.dtype, "latent cache")  # KernelLimitError
    operands, static, n = _operands(kv_raw, norm_w, latent, kv_scale, block_tables, pos,
                                    valid, col, layer, slots, parts)
    nb, bs, c = latent.shape
    body = functools.partial(_write_program, eps=eps, to_rows=False, **static)
    part = Part(body, (n,), (*operands, latent.reshape(nb * bs, c)),
                (jax.ShapeDtypeStruct((nb * bs, c), latent.dtype),),
                aliases={len(operands): 0})
    return part, lambda outs: outs[0].reshape(nb, bs, c)


def latent_write_pallas(kv_raw: jax.Array, norm_w: jax.Array, latent: jax.Array,
                        kv_scale: jax.Array, block_tables: jax.Array, pos: jax.Array,
                        valid: jax.Array, *, eps: float, col: int | None = None,
                        layer: jax.Array | None = None, slots: jax.Array | None = None,
                        interpret: bool = False) -> jax.Array:
    """`latent_write_xla` as one Pallas launch, a program per row, writing the cache in place
    (the cache is aliased to the output; donate it to avoid a copy); where the kernel cannot
    address the cache, the kernel's rows stored by an XLA scatter (`pick_store`). With
    `layer`, row `layer` of the stacked `norm_w [G, C]` read in place (a kernel operand is a
    whole buffer: a slice would be a copy). slots: `flat_slots(pos, valid, block_tables, bs)`
    flattened `[N]`, computed by the caller (the step's metadata launch, `pallas/row_meta.py`;
    None: computed here)."""
    store = (store_in_place if pick_store(latent.shape, latent.dtype) == "kernel"
             else store_by_xla)
    return store(kv_raw, norm_w, latent, kv_scale, block_tables, pos, valid, eps=eps, col=col,
                 layer=layer, slots=slots, interpret=interpret)


def store_in_place(kv_raw: jax.Array, norm_w: jax.Array, latent: jax.Array,
                   kv_scale: jax.Array, block_tables: jax.Array, pos: jax.Array,
                   valid: jax.Array, *, eps: float, col: int | None = None,
                   layer: jax.Array | None = None, slots: jax.Array | None = None,
                   interpret: bool = False) -> jax.Array:
    """`latent_write_pallas` where `pick_store` says "kernel": the kernel stores the rows in
    the cache aliased to its output. Refused (`KernelLimitError`) for a cache it cannot
    address."""
    part, finish = latent_write_part(kv_raw, norm_w, latent, kv_scale, block_tables, pos,
                                     valid, eps=eps, col=col, layer=layer, slots=slots)
    out = pl.pallas_call(
        lambda *refs: part.body((pl.program_id(0),), *refs),
        grid=part.grid,
        in_specs=[pl.BlockSpec()] * len(part.inputs),  # [layer], scale [1], w, raw
        # [1, N, >= C], slots [N], the cache
        out_specs=pl.BlockSpec(),
        out_shape=part.out_shape[0],
        input_output_aliases=part.aliases,
        compiler_params=plt.CompilerParams(num_warps=warps_for(kv_raw.shape[1]),
                                           num_stages=1),
        interpret=interpret,
        name="latent_write",
    )(*part.inputs)
    return finish((out,))


def store_by_xla(kv_raw: jax.Array, norm_w: jax.Array, latent: jax.Array,
                 kv_scale: jax.Array, block_tables: jax.Array, pos: jax.Array,
                 valid: jax.Array, *, eps: float, col: int | None = None,
                 layer: jax.Array | None = None, slots: jax.Array | None = None,
                 interpret: bool = False) -> jax.Array:
    """`latent_write_pallas` where `pick_store` says "xla": the kernel computes the rows
    `[N, C]` (the same program), an XLA scatter stores them (64-bit addressing)."""
    operands, static, n = _operands(kv_raw, norm_w, latent, kv_scale, block_tables, pos,
                                    valid, col, layer, slots)
    body = functools.partial(_write_program, eps=eps, to_rows=True, **static)
    rows = pl.pallas_call(
        lambda *refs: body((pl.program_id(0),), *refs), grid=(n,),
        in_specs=[pl.BlockSpec()] * len(operands),  # [layer], scale, w, raw, slots
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((n, latent.shape[2]), latent.dtype),
        compiler_params=plt.CompilerParams(num_warps=warps_for(kv_raw.shape[1]),
                                           num_stages=1),
        interpret=interpret, name="latent_rows",
    )(*operands)  # [N, C]
    return scatter_rows(latent, rows, operands[-1])
