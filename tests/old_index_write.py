"""The indexer write's definition before the ring (every raw row kept, `[B, Tmax, Di]`
caches), verbatim from commit 2a6c80a: `index_write_xla`. The ring tests
(tests/test_index_ring.py) compare the ring's jnp twin with it bit for bit.

Its Pallas kernel is gone (tag lab-2026-12 has it): it computed the same pool keys with another
reduction layout than the ring kernel (one warp; the ring kernel runs a decode's rows at four),
so the two kernels' keys could differ in the last bit, and it guaranteed nothing the ring
kernel's own tests do not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsa_jax.pallas.index_write import layer_norm, pool_key


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
