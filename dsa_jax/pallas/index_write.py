"""The indexer write: k_norm (LayerNorm with bias), the k and gate rows into the ring, and the
pool key of every pool the rows complete.

Row (b, r) at position t stores `k = LN(k_raw)` and `g` (cache dtype) at ring slot `t % Rr` of
sequence b; when `(t + 1) % KP == 0` it completes pool `p = t // KP`, whose key is
`K_p[c] = sum_m softmax_m(g[m, c] + ape[m, c]) * k[m, c]` over the pool's KP stored (cache-
dtype) members, in fp32. Members at or past the step's first position come from the step's own
rows, earlier ones (fewer than KP) from the ring, read before the step writes it: a prompt chunk
longer than the ring completes pools whose slots its later rows reuse. Of the rows that share a
slot within one step only the last is stored. Rows that are not valid write nothing.

Several layers may share the arrays (the model's scan): ring `[B, L * Rr, Di]` and keys
`[B, L * P, Di]`, layer `layer` at rows `layer * Rr` and `layer * P` (`layers` = L, static).
The rows of one call are consecutive positions: `pos[b, r] = pos[b, 0] + r`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.numerics import tree_sum
from dsa_jax.pallas.colaunch import Part
from dsa_jax.pallas.common import (
    load_parts,
    next_pow2,
    round_to,
    stacked_weight,
)

LN_EPS = 1e-6  # the indexer's k_norm epsilon (HF nn.LayerNorm(eps=1e-6))


# Up to this many rows per sequence (a decode's or a verify's) the writes run 4 warps, as the
# decode front's other parts and the indexer query's GEMM: they share launches
# (`decode_front`: the same programs at the same warps); a prompt's rows keep 1.
SHARED_ROWS = 16


def warps_for(rows_per_seq: int) -> int:
    """The index write's warps per program (one Di-wide row each) for steps of
    `rows_per_seq` rows per sequence (see `SHARED_ROWS`)."""
    return 4 if rows_per_seq <= SHARED_ROWS else 1


def layer_norm(v: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    """The indexer key's LayerNorm over the last axis, fp32. (XLA's reduce, not a `tree_sum`:
    its rows were the same bits in every batch tested, tests/test_batch_invariance.py, and
    the kernel's sums, compared with these in tests/test_index_ring.py, run in XLA's order
    more closely.)"""
    mean = jnp.mean(v, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(v - mean), axis=-1, keepdims=True)
    return (v - mean) * lax.rsqrt(var + LN_EPS) * g + b


def pool_key(k_members: jax.Array, g_members: jax.Array, ape: jax.Array) -> jax.Array:
    """`[..., KP, Di]` members -> `K [..., Di]`: softmax over the members per channel, fp32."""
    logits = g_members.astype(jnp.float32) + ape
    terms = jax.nn.softmax(logits, axis=-2) * k_members.astype(jnp.float32)  # [..., KP, Di]
    return tree_sum(jnp.swapaxes(terms, -1, -2))  # [..., Di]


def stored_keys(keys: jax.Array, dtype) -> jax.Array:
    """fp32 pool keys -> `dtype` as the kernel stores them (round to nearest even). Rounded by
    `common.round_to` first, so the cast is exact: XLA may otherwise keep a step's own
    f32 -> bf16 -> f32 round trip at fp32 (excess precision), and a row of the step that
    writes a pool would score another key than a later step reading it back."""
    return round_to(keys, dtype).astype(dtype)


def ring_geometry(ape: jax.Array, ring: jax.Array, pool_keys: jax.Array, layers: int
                  ) -> tuple[int, int, int, int]:
    """(KP, Rr, P, Tmax) of the arrays (static), checked: the ring must hold a pool's KP - 1
    earlier members plus one row. ape: `[KP, Di]` (or a stack of them)."""
    kp = ape.shape[-2]
    if layers < 1 or ring.shape[1] % layers or pool_keys.shape[1] % layers:
        raise ValueError(f"ring rows {ring.shape[1]} and pool keys {pool_keys.shape[1]} must "
                         f"split evenly over layers={layers}")
    rows, pools = ring.shape[1] // layers, pool_keys.shape[1] // layers
    if rows < kp:
        raise ValueError(f"a ring of {rows} rows cannot hold a pool of index_kpool {kp} "
                         f"(it needs at least {kp})")
    return kp, rows, pools, pools * kp


def _stored_rows(pos: jax.Array, valid: jax.Array, rows: int) -> jax.Array:
    """`[B, R]` bool: valid rows no later row of the step overwrites (the last `rows`)."""
    last = jnp.max(jnp.where(valid, pos, -1), axis=1, keepdims=True)  # [B, 1]
    return valid & (pos > last - rows)


def row_columns(k_raw: jax.Array, g: jax.Array, di: int, cols: tuple[int, int] | None
                ) -> tuple[int, int]:
    """The first of k_raw's and of g's Di columns (`cols`, or (0, 0) for `[..., Di]` rows),
    checked against their widths."""
    starts = (0, 0) if cols is None else cols
    for name, a, start in (("k_raw", k_raw, starts[0]), ("g", g, starts[1])):
        if (start < 0 or start + di > a.shape[-1] or (cols is None and a.shape[-1] != di)
                or a.shape[:-1] != k_raw.shape[:-1]):
            raise ValueError(f"index_write: {name} has shape {a.shape}; it needs Di = {di} "
                             f"columns from {start} (cols={cols}) and k_raw's rows "
                             f"{k_raw.shape[:-1]}")
    return starts


def index_write_xla(k_raw: jax.Array, g: jax.Array, norm_w: jax.Array, norm_b: jax.Array,
                    ape: jax.Array, index_k: jax.Array, index_g: jax.Array,
                    pool_keys: jax.Array, pos: jax.Array, valid: jax.Array,
                    layer: jax.Array | int = 0, *, layers: int = 1,
                    cols: tuple[int, int] | None = None,
                    weight_layer: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The definition.

    k_raw, g: [B, R, Di] f32 (k before its norm); norm_w, norm_b: [Di] f32; ape: [KP, Di] f32;
    index_k, index_g: [B, L * Rr, Di] cache dtype (the rings); pool_keys: [B, L * P, Di] index dtype
    (as the rings: each key computed in fp32, stored rounded once);
    pos, valid: [B, R]; layer: [] int32. Returns the new (index_k, index_g, pool_keys).
    cols: static `(k_start, g_start)`: k_raw and g are wider `[B, R, N]` arrays (the x
    projection's output, the same one for both) whose Di columns from those starts are the
    rows, read in place by the kernels (no slice copies). weight_layer: norm_w, norm_b and ape
    are stacks `[G, ...]` of every layer's and this is the index `[]` of this layer's (the
    model's scan; `layer` is the cache's full-layer index, another number).
    """
    kp, rows, num_pools, tmax = ring_geometry(ape, index_k, pool_keys, layers)
    at = _weight_layer(norm_w, norm_b, ape, weight_layer)
    if at is not None:
        norm_w, norm_b, ape = norm_w[at], norm_b[at], ape[at]
    di = norm_w.shape[0]
    k0, g0 = row_columns(k_raw, g, di, cols)
    k_raw, g = k_raw[..., k0:k0 + di], g[..., g0:g0 + di]
    nb, r, _ = k_raw.shape
    b = jnp.arange(nb)[:, None]  # [B, 1]
    valid = valid & (pos >= 0) & (pos < tmax)  # past the cache: dropped, never redirected
    k = layer_norm(k_raw.astype(jnp.float32), norm_w, norm_b)  # [B, R, Di]
    # A window per sequence: the KP - 1 positions before the step (from the ring; only a
    # completed pool's members are used, so negative positions are never read back), then
    # the step's rows, stored as the ring stores them. Built like the full-row cache was
    # (scatter, then gather the members), which keeps XLA's keys bit for bit the same.
    base = pos[:, :1]  # [B, 1]
    held = layer * rows + (base - (kp - 1) + jnp.arange(kp - 1)) % rows  # [B, KP-1]
    wlen = kp - 1 + r
    at = jnp.where(valid, pos - base + (kp - 1), wlen)  # [B, R]; invalid rows dropped
    win_k = jnp.concatenate([index_k[b, held], jnp.zeros((nb, r, di), index_k.dtype)], axis=1)
    win_g = jnp.concatenate([index_g[b, held], jnp.zeros((nb, r, di), index_g.dtype)], axis=1)
    win_k = win_k.at[b, at].set(k.astype(index_k.dtype), mode="drop")  # [B, KP-1+R, Di]
    win_g = win_g.at[b, at].set(g.astype(index_g.dtype), mode="drop")
    pool = pos // kp  # [B, R]
    members = jnp.clip(pool[..., None] * kp + jnp.arange(kp) - base[..., None] + (kp - 1),
                       0, wlen - 1)  # [B, R, KP]
    keys = stored_keys(pool_key(win_k[b[..., None], members], win_g[b[..., None], members],
                                ape), pool_keys.dtype)  # [B, R, Di]
    completes = valid & ((pos + 1) % kp == 0)
    pool_keys = pool_keys.at[b, jnp.where(completes, layer * num_pools + pool,
                                          layers * num_pools)].set(keys, mode="drop")
    slot = jnp.where(_stored_rows(pos, valid, rows), layer * rows + pos % rows, layers * rows)
    index_k = index_k.at[b, slot].set(k.astype(index_k.dtype), mode="drop")
    index_g = index_g.at[b, slot].set(g.astype(index_g.dtype), mode="drop")
    return index_k, index_g, pool_keys


# Rows of the per-row metadata `[7, N]` int32 the kernels share (one XLA pass makes all of
# them): the ring row of a row stored in the first launch, the key row a completing row
# writes, the split between a pool's ring and step members, the pool's first member in the
# step buffer and in the ring, the pool's first position, the ring row of a late row.
_FIRST, _DEST, _SPLIT, _STEP, _RING, _POOL, _LATE = range(7)


def meta_rows(pos: jax.Array, valid: jax.Array, base: jax.Array, seq: jax.Array,
              layer: jax.Array | int, *, kp: int, rows: int, num_pools: int, keys_len: int,
              ring_len: int, r: int) -> tuple[jax.Array, ...]:
    """The seven metadata rows of `pos`, `valid` `[B, R]` (elementwise but for the last
    stored row per sequence), each `[B, R]` int32: rows `_FIRST` .. `_LATE`. base `[B, 1]`:
    each sequence's first position (`pos[:, :1]`); seq `[B, 1]`: its index. Plain jnp on
    arrays of any `[B, R]` tile, so that a kernel computing them in its own program
    (`pallas/row_meta.py`) runs this same code on its padded tiles."""
    tmax = num_pools * kp
    valid = valid & (pos >= 0) & (pos < tmax)  # past the cache: dropped, never redirected
    ring_row = seq * ring_len + layer * rows + pos % rows  # [B, R]
    stored = _stored_rows(pos, valid, rows)
    early = rows - (kp - 1)  # rows whose slot no earlier member of this step's pools uses
    completes = valid & ((pos + 1) % kp == 0)
    pool_first = pos // kp * kp  # [B, R]
    none = jnp.full_like(pos, -1)
    zero = jnp.zeros_like(pos)
    return (jnp.where(stored & (pos - base < early), ring_row, none),
            jnp.where(completes, seq * keys_len + layer * num_pools + pos // kp, none),
            jnp.where(completes, jnp.clip(base - pool_first, 0, kp), zero),
            jnp.where(completes, seq * r + pool_first - base, zero),
            jnp.where(completes, seq * ring_len + layer * rows, zero),
            jnp.where(completes, pool_first, zero),
            jnp.where(stored & (pos - base >= early), ring_row, none))


def row_meta(pos: jax.Array, valid: jax.Array, layer: jax.Array | int = 0, *, kp: int,
             rows: int, num_pools: int, keys_len: int, ring_len: int) -> jax.Array:
    """The kernels' per-row metadata `[7, N]` int32 (N = B * R) of rows at `pos`, `valid`
    `[B, R]`: `meta_rows` flattened and stacked (one array, so that XLA computes every row's
    metadata in one pass, not one launch each)."""
    nb, r = pos.shape
    seq = jnp.arange(nb, dtype=jnp.int32)[:, None]  # [B, 1]
    parts = meta_rows(pos.astype(jnp.int32), valid, pos[:, :1].astype(jnp.int32), seq, layer,
                      kp=kp, rows=rows, num_pools=num_pools, keys_len=keys_len,
                      ring_len=ring_len, r=r)
    return jnp.stack([a.reshape(nb * r).astype(jnp.int32) for a in parts])  # [7, N]


def _weight_layer(norm_w, norm_b, ape, weight_layer):
    """The weights of one layer (`[Di]`, `[Di]`, `[KP, Di]`), or stacks of them and an index:
    checked; the index clamped (None without one)."""
    di, one_ape = norm_w.shape[-1], ape.shape[-2:]
    at = stacked_weight(norm_w, weight_layer, (di,), "index_write's norm_w")
    stacked_weight(norm_b, weight_layer, (di,), "index_write's norm_b")
    stacked_weight(ape, weight_layer, one_ape, "index_write's ape")
    return at


def _rows_program(ids, *refs, width: int, k0: int, g0: int, stacked: bool, parts: int):
    """Row ids[0]: LayerNorm of k (k_ref's columns k0..) and g (g_ref's g0..); the stored k to the
    step buffer row i, and k and g to flat ring row meta_ref[_FIRST, i] (-1: not here).
    refs: [l_ref [1] int32 when `stacked`: w_ref, b_ref are [G, Di], read at row l], w_ref,
    b_ref [Di], k_ref, g_ref [S, N, >= Di] (their parts summed: `load_parts`), meta_ref, the
    two rings (aliased), k_out, g_out, kc_out."""
    l_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
    w_ref, b_ref, k_ref, g_ref, meta_ref, _k_in, _g_in, k_out, g_out, kc_out = refs
    (i,) = ids
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)  # [Dp]
    in_width = cols < width
    k = load_parts(k_ref, parts, i, k0 + cols, mask=in_width)
    g = load_parts(g_ref, parts, i, g0 + cols, mask=in_width)
    w_at = (l_ref[0], cols) if stacked else (cols,)  # one indexer (Triton takes no chain)
    w = plt.load(w_ref.at[w_at], mask=in_width, other=0.0)
    bias = plt.load(b_ref.at[w_at], mask=in_width, other=0.0)
    mean = jnp.sum(k) / width
    centered = jnp.where(in_width, k - mean, 0.0)
    k = centered * lax.rsqrt(jnp.sum(centered * centered) / width + LN_EPS) * w + bias
    kc = k.astype(k_out.dtype)
    plt.store(kc_out.at[i, cols], kc, mask=in_width)
    row = meta_ref[_FIRST, i]
    mask = in_width & (row >= 0)
    plt.store(k_out.at[jnp.maximum(row, 0), cols], kc, mask=mask)
    plt.store(g_out.at[jnp.maximum(row, 0), cols], g.astype(g_out.dtype), mask=mask)


def _copy_program(ids, kc_ref, g_ref, meta_ref, _k_in, _g_in, k_out, g_out, *, width: int,
                  g0: int, parts: int):
    """Row ids[0]: the stored k (step buffer) and g (g_ref's columns g0..; its parts summed)
    to flat ring row meta_ref[_LATE, i] (-1: none)."""
    (i,) = ids
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)  # [Dp]
    row = meta_ref[_LATE, i]
    mask = (cols < width) & (row >= 0)
    kc = plt.load(kc_ref.at[i, cols], mask=mask, other=jnp.zeros((), kc_ref.dtype))
    g = load_parts(g_ref, parts, i, g0 + cols, mask=mask)
    plt.store(k_out.at[jnp.maximum(row, 0), cols], kc, mask=mask)
    plt.store(g_out.at[jnp.maximum(row, 0), cols], g.astype(g_out.dtype), mask=mask)


def _pool_program(ids, *refs, width: int, kpool: int, rows: int, g0: int, stacked: bool,
                  parts: int):
    """Row ids[0], one that may complete a pool (flat key row meta[_DEST, i]; -1: none). Members
    m < meta[_SPLIT, i] come from the ring (flat row meta[_RING, i] + (meta[_POOL, i] + m) %
    rows, the pool's first position meta[_POOL, i]), the others from the step: flat row
    meta[_STEP, i] + m of the stored k buffer and of the raw g (g_ref's columns g0..; cast to
    the cache dtype as the ring stores it). refs: [l_ref [1] int32 when `stacked`: ape_ref is
    [G, KP, Di], read at l], ape_ref, rk_ref, rg_ref, kc_ref, g_ref, meta_ref, the keys
    (aliased), keys_out."""
    l_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
    ape_ref, rk_ref, rg_ref, kc_ref, g_ref, meta_ref, _keys_in, keys_out = refs
    (i,) = ids
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)  # [Dp]
    members = jnp.arange(next_pow2(kpool), dtype=jnp.int32)  # [KPp]
    dest = meta_ref[_DEST, i]
    mask = jnp.broadcast_to((members < kpool)[:, None] & (cols < width)[None, :] & (dest >= 0),
                            (members.shape[0], cols.shape[0]))  # [KPp, Dp]
    old = (members < meta_ref[_SPLIT, i])[:, None]  # [KPp, 1]
    held = meta_ref[_RING, i] + (meta_ref[_POOL, i] + members) % rows  # [KPp]
    new = jnp.clip(meta_ref[_STEP, i] + members, 0, kc_ref.shape[0] - 1)  # [KPp]
    dt = rk_ref.dtype
    k = jnp.where(old,
                  plt.load(rk_ref.at[held[:, None], cols[None, :]], mask=mask & old,
                           other=jnp.zeros((), dt)).astype(jnp.float32),
                  plt.load(kc_ref.at[new[:, None], cols[None, :]], mask=mask & ~old,
                           other=jnp.zeros((), dt)).astype(jnp.float32))
    g = jnp.where(old,
                  plt.load(rg_ref.at[held[:, None], cols[None, :]], mask=mask & old,
                           other=jnp.zeros((), rg_ref.dtype)).astype(jnp.float32),
                  load_parts(g_ref, parts, new[:, None], g0 + cols[None, :],
                             mask=mask & ~old).astype(rg_ref.dtype).astype(jnp.float32))
    ape_at = (members[:, None], cols[None, :])
    ape = plt.load(ape_ref.at[(l_ref[0], *ape_at) if stacked else ape_at], mask=mask, other=0.0)
    logits = jnp.where(mask, g + ape, -jnp.inf)
    m = jnp.max(logits, axis=0, keepdims=True)
    e = jnp.exp(logits - jnp.where(m > -jnp.inf, m, 0.0))  # 0 at padded members
    key = jnp.sum(e * k, axis=0) / jnp.sum(e, axis=0)  # [Dp]
    plt.store(keys_out.at[jnp.maximum(dest, 0), cols], key.astype(keys_out.dtype),
              mask=(cols < width) & (dest >= 0))


class IndexWriteParts(NamedTuple):
    """`index_write_pallas`'s launches as `colaunch.Part`s, in order: `rows` (the LayerNorm,
    the step buffer and the early ring rows), then `pool(rows_outs)` (the pool keys, reading
    the first's outputs), then, where `late` (a prompt chunk longer than the ring's free
    rows), `late_rows(rows_outs)`; `finish(rows_outs, pool_outs, late_outs=None)` -> the new
    (index_k, index_g, pool_keys). Each part's program is the kernel's own."""
    rows: Part
    pool: Callable[[tuple], Part]
    late: bool
    late_rows: Callable[[tuple], Part]
    finish: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def index_write_parts(k_raw: jax.Array, g: jax.Array, norm_w: jax.Array, norm_b: jax.Array,
                      ape: jax.Array, index_k: jax.Array, index_g: jax.Array,
                      pool_keys: jax.Array, pos: jax.Array, valid: jax.Array,
                      layer: jax.Array | int = 0, *, layers: int = 1,
                      cols: tuple[int, int] | None = None,
                      weight_layer: jax.Array | None = None, meta: jax.Array | None = None,
                      parts: int | None = None) -> IndexWriteParts:
    """`index_write_pallas`'s kernels for these arguments (its own) as `IndexWriteParts`, for
    launches shared with other kernels (`decode_front`): the same programs. parts:
    k_raw and g are `[S, B, R, N]`, a split GEMM's K parts (`matmul_part(summed=False)`),
    read as their sum (`load_parts`: the same values)."""
    s_parts = 1 if parts is None else parts
    if parts is not None:
        if k_raw.ndim != 4 or k_raw.shape[0] != parts or g.shape[:1] != (parts,):
            raise ValueError(f"index_write: k_raw {k_raw.shape} and g {g.shape}: parts={parts} "
                             f"needs [{parts}, B, R, N]")
    else:
        k_raw, g = k_raw[None], g[None]  # [1, B, R, N]
    kp, rows, num_pools, _ = ring_geometry(ape, index_k, pool_keys, layers)
    at = _weight_layer(norm_w, norm_b, ape, weight_layer)
    lead = () if at is None else (jnp.reshape(at, (1,)),)
    di = norm_w.shape[-1]
    k0, g0 = row_columns(k_raw, g, di, cols)
    nb, r = k_raw.shape[1:3]
    n, ring_len = nb * r, index_k.shape[1]
    early = rows - (kp - 1)  # rows whose slot no earlier member of this step's pools uses
    if meta is None:
        meta = row_meta(pos, valid, layer, kp=kp, rows=rows, num_pools=num_pools,
                        keys_len=pool_keys.shape[1], ring_len=ring_len)  # [7, N]
    elif meta.shape != (7, n):
        raise ValueError(f"index_write: meta has shape {meta.shape}; {n} rows need (7, {n})")
    k_rows = k_raw.reshape(s_parts, n, k_raw.shape[-1]).astype(jnp.float32)  # [S, N, >= Di]
    g_rows = g.reshape(s_parts, n, g.shape[-1]).astype(jnp.float32)  # [S, N, >= Di]
    s = len(lead)  # the operands shift past the layer index
    stacked = bool(s)
    ring_shapes = (jax.ShapeDtypeStruct((nb * ring_len, di), index_k.dtype),
                   jax.ShapeDtypeStruct((nb * ring_len, di), index_g.dtype))
    rows_part = Part(
        functools.partial(_rows_program, width=di, k0=k0, g0=g0, stacked=stacked,
                          parts=s_parts), (n,),
        (*lead, norm_w.astype(jnp.float32), norm_b.astype(jnp.float32), k_rows, g_rows, meta,
         index_k.reshape(nb * ring_len, di), index_g.reshape(nb * ring_len, di)),
        (*ring_shapes, jax.ShapeDtypeStruct((n, di), index_k.dtype)),
        aliases={s + 5: 0, s + 6: 1})  # [layer]; w, b; k, g [S, N, Di]; meta; the two rings

    def pool(rows_outs):
        k_flat, g_flat, kc = rows_outs
        return Part(
            functools.partial(_pool_program, width=di, kpool=kp, rows=rows, g0=g0,
                              stacked=stacked, parts=s_parts), (n,),
            (*lead, ape.astype(jnp.float32), k_flat, g_flat, kc, g_rows, meta,
             pool_keys.reshape(nb * pool_keys.shape[1], di)),
            (jax.ShapeDtypeStruct((nb * pool_keys.shape[1], di), pool_keys.dtype),),
            aliases={s + 6: 0})  # [layer]; ape; rings; k buffer, g; meta; keys

    def late_rows(rows_outs):
        k_flat, g_flat, kc = rows_outs
        return Part(functools.partial(_copy_program, width=di, g0=g0, parts=s_parts), (n,),
                    (kc, g_rows, meta, k_flat, g_flat), ring_shapes,
                    aliases={3: 0, 4: 1})  # k buffer, g [S, N, Di]; meta [7, N]; two rings

    def finish(rows_outs, pool_outs, late_outs=None):
        k_flat, g_flat = rows_outs[:2] if late_outs is None else late_outs
        return (k_flat.reshape(nb, ring_len, di), g_flat.reshape(nb, ring_len, di),
                pool_outs[0].reshape(nb, *pool_keys.shape[1:]))

    return IndexWriteParts(rows_part, pool, r > early, late_rows, finish)


def _launch(part: Part, warps: int, interpret: bool, name: str) -> tuple:
    """One part as its own launch (whole-array operands, its aliases)."""
    outs = pl.pallas_call(
        lambda *refs: part.body((pl.program_id(0),), *refs),
        grid=part.grid,
        in_specs=[pl.BlockSpec()] * len(part.inputs),
        out_specs=[pl.BlockSpec()] * len(part.out_shape),
        out_shape=list(part.out_shape),
        input_output_aliases=part.aliases,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name=name,
    )(*part.inputs)
    return tuple(outs)


def index_write_pallas(k_raw: jax.Array, g: jax.Array, norm_w: jax.Array, norm_b: jax.Array,
                       ape: jax.Array, index_k: jax.Array, index_g: jax.Array,
                       pool_keys: jax.Array, pos: jax.Array, valid: jax.Array,
                       layer: jax.Array | int = 0, *, layers: int = 1,
                       cols: tuple[int, int] | None = None,
                       weight_layer: jax.Array | None = None, meta: jax.Array | None = None,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`index_write_xla` as Pallas launches, a program per row, writing the ring and the keys
    in place (aliased): (1) the rows: LayerNorm, the stored k into a step buffer, and every
    row whose slot is not one of the earlier members' (the first Rr - KP + 1 rows of the step:
    all of a decode or verify) into the ring; (2) the pool keys; (3) only for a step of more
    rows than that (a prompt chunk), the remaining rows into the ring. With `weight_layer`
    the stacked weights are read in place at that index (a kernel operand is a whole buffer:
    a slice would be a copy). meta: `row_meta(pos, valid, layer, ...)` of these arrays, computed
    by the caller (the step's metadata launch, `pallas/row_meta.py`; None: computed here).
    Each launch at `warps_for(R)` warps."""
    parts = index_write_parts(k_raw, g, norm_w, norm_b, ape, index_k, index_g, pool_keys,
                              pos, valid, layer, layers=layers, cols=cols,
                              weight_layer=weight_layer, meta=meta)
    warps = warps_for(k_raw.shape[1])
    rows_outs = _launch(parts.rows, warps, interpret, "index_write_rows")
    pool_outs = _launch(parts.pool(rows_outs), warps, interpret, "index_write_pool_keys")
    late_outs = (_launch(parts.late_rows(rows_outs), warps, interpret,
                         "index_write_late_rows") if parts.late else None)
    return parts.finish(rows_outs, pool_outs, late_outs)
