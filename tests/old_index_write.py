"""The indexer write before the ring (every raw row kept, `[B, Tmax, Di]` caches), verbatim
from commit 2a6c80a: `index_write_xla` and `index_write_pallas` with their kernels. The ring
tests (tests/test_index_ring.py) compare the ring write with it bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.pallas.common import next_pow2
from dsa_jax.pallas.index_write import LN_EPS, layer_norm, pool_key


def index_write_xla(k_raw: jax.Array, g: jax.Array, norm_w: jax.Array, norm_b: jax.Array,
                    ape: jax.Array, index_k: jax.Array, index_g: jax.Array,
                    pool_keys: jax.Array, pos: jax.Array, valid: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The definition.

    k_raw, g: [B, R, Di] f32 (k before its norm); norm_w, norm_b: [Di] f32; ape: [KP, Di] f32;
    index_k, index_g: [B, T, Di] cache dtype; pool_keys: [B, P, Di] f32; pos, valid: [B, R].
    Returns the new (index_k, index_g, pool_keys).
    """
    kp, tmax, num_pools = ape.shape[0], index_k.shape[1], pool_keys.shape[1]
    b = jnp.arange(k_raw.shape[0])[:, None]  # [B, 1]
    valid = valid & (pos >= 0) & (pos < tmax)  # past the cache: dropped, never redirected
    row = jnp.where(valid, pos, tmax)  # [B, R]; out of range rows are dropped
    k = layer_norm(k_raw.astype(jnp.float32), norm_w, norm_b)
    index_k = index_k.at[b, row].set(k.astype(index_k.dtype), mode="drop")
    index_g = index_g.at[b, row].set(g.astype(index_g.dtype), mode="drop")
    pool = pos // kp  # [B, R]
    members = jnp.clip(pool[..., None] * kp + jnp.arange(kp), 0, tmax - 1)  # [B, R, KP]
    keys = pool_key(index_k[b[..., None], members], index_g[b[..., None], members], ape)
    completes = valid & ((pos + 1) % kp == 0)
    pool_keys = pool_keys.at[b, jnp.where(completes, pool, num_pools)].set(keys, mode="drop")
    return index_k, index_g, pool_keys


def _rows_kernel(w_ref, b_ref, k_ref, g_ref, rows_ref, _k_in, _g_in, k_out, g_out, *,
                 width: int):
    """One row: LayerNorm of k, then k and g stored at flat cache row rows_ref[i] (-1: none)."""
    i = pl.program_id(0)
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)  # [Dp]
    in_width = cols < width
    k = plt.load(k_ref.at[i, cols], mask=in_width, other=0.0)
    g = plt.load(g_ref.at[i, cols], mask=in_width, other=0.0)
    w = plt.load(w_ref.at[cols], mask=in_width, other=0.0)
    bias = plt.load(b_ref.at[cols], mask=in_width, other=0.0)
    mean = jnp.sum(k) / width
    centered = jnp.where(in_width, k - mean, 0.0)
    k = centered * lax.rsqrt(jnp.sum(centered * centered) / width + LN_EPS) * w + bias
    row = rows_ref[i]
    mask = in_width & (row >= 0)
    plt.store(k_out.at[jnp.maximum(row, 0), cols], k.astype(k_out.dtype), mask=mask)
    plt.store(g_out.at[jnp.maximum(row, 0), cols], g.astype(g_out.dtype), mask=mask)


def _pool_kernel(ape_ref, k_ref, g_ref, first_ref, dest_ref, _keys_in, keys_out, *,
                 width: int, kpool: int):
    """One row that may complete a pool: members at flat rows first_ref[i] + m, the key stored
    at flat pool row dest_ref[i] (-1: the row completes no pool)."""
    i = pl.program_id(0)
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)  # [Dp]
    members = jnp.arange(next_pow2(kpool), dtype=jnp.int32)  # [KPp]
    dest = dest_ref[i]
    mask = jnp.broadcast_to((members < kpool)[:, None] & (cols < width)[None, :],
                            (members.shape[0], cols.shape[0]))  # [KPp, Dp]
    first = first_ref[i]
    k = plt.load(k_ref.at[first + members[:, None], cols[None, :]], mask=mask,
                 other=jnp.zeros((), k_ref.dtype)).astype(jnp.float32)
    g = plt.load(g_ref.at[first + members[:, None], cols[None, :]], mask=mask,
                 other=jnp.zeros((), g_ref.dtype)).astype(jnp.float32)
    ape = plt.load(ape_ref.at[members[:, None], cols[None, :]], mask=mask, other=0.0)
    logits = jnp.where(mask, g + ape, -jnp.inf)
    e = jnp.exp(logits - jnp.max(logits, axis=0, keepdims=True))  # 0 at padded members
    key = jnp.sum(e * k, axis=0) / jnp.sum(e, axis=0)  # [Dp]
    plt.store(keys_out.at[jnp.maximum(dest, 0), cols], key, mask=(cols < width) & (dest >= 0))


def index_write_pallas(k_raw: jax.Array, g: jax.Array, norm_w: jax.Array, norm_b: jax.Array,
                       ape: jax.Array, index_k: jax.Array, index_g: jax.Array,
                       pool_keys: jax.Array, pos: jax.Array, valid: jax.Array, *,
                       interpret: bool = False, num_warps: int = 1
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`index_write_xla` as two Pallas launches, a program per row, writing the caches in
    place (aliased): the rows first, then the pool keys, which read rows of the same step.
    `overrides`: fields of `tuning` by name (`num_warps=2`)."""
    b, r, di = k_raw.shape
    kp, tmax, num_pools = ape.shape[0], index_k.shape[1], pool_keys.shape[1]
    n = b * r
    valid = valid & (pos >= 0) & (pos < tmax)  # past the cache: dropped, never redirected
    seq = jnp.arange(b, dtype=jnp.int32)[:, None]  # [B, 1]
    rows = jnp.where(valid, seq * tmax + pos, -1).reshape(n).astype(jnp.int32)
    completes = valid & ((pos + 1) % kp == 0)
    dest = jnp.where(completes, seq * num_pools + pos // kp, -1).reshape(n).astype(jnp.int32)
    first = jnp.where(completes, seq * tmax + pos // kp * kp, 0).reshape(n).astype(jnp.int32)
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    k_flat, g_flat = pl.pallas_call(
        functools.partial(_rows_kernel, width=di),
        grid=(n,),
        in_specs=[pl.BlockSpec()] * 7,  # w, b [Di]; k, g [N, Di]; rows [N]; the two caches
        out_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_shape=[jax.ShapeDtypeStruct((b * tmax, di), index_k.dtype),
                   jax.ShapeDtypeStruct((b * tmax, di), index_g.dtype)],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=params, interpret=interpret, name="index_write_rows",
    )(norm_w.astype(jnp.float32), norm_b.astype(jnp.float32),
      k_raw.reshape(n, di).astype(jnp.float32), g.reshape(n, di).astype(jnp.float32), rows,
      index_k.reshape(b * tmax, di), index_g.reshape(b * tmax, di))
    keys_flat = pl.pallas_call(
        functools.partial(_pool_kernel, width=di, kpool=kp),
        grid=(n,),
        in_specs=[pl.BlockSpec()] * 6,  # ape [KP, Di]; k, g caches; first, dest [N]; keys
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((b * num_pools, di), jnp.float32),
        input_output_aliases={5: 0},
        compiler_params=params, interpret=interpret, name="index_write_pool_keys",
    )(ape.astype(jnp.float32), k_flat, g_flat, first, dest,
      pool_keys.reshape(b * num_pools, di))
    return (k_flat.reshape(b, tmax, di), g_flat.reshape(b, tmax, di),
            keys_flat.reshape(b, num_pools, di))
