"""The indexer cache: row writes, pool keys when a pool completes, pool scores.

Pool keys are kept in the state (`pool_keys [B, P, Di]`), computed once from the stored `k`
and gate when the pool's last token is written, so a step reads `P` keys instead of
recomputing `P * KP` softmaxes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import resolve
from dsa_jax.pallas import pool_scores as pool_scores_op
from dsa_jax.state import DsaState


def pool_key(k_members: jax.Array, g_members: jax.Array, ape: jax.Array) -> jax.Array:
    """`[..., KP, Di]` members -> `K [..., Di]`: softmax over the members per channel, fp32."""
    logits = g_members.astype(jnp.float32) + ape
    return jnp.sum(jax.nn.softmax(logits, axis=-2) * k_members.astype(jnp.float32), axis=-2)


def write_index_rows(cfg: DsaConfig, ape: jax.Array, state: DsaState, k: jax.Array,
                     g: jax.Array, pos: jax.Array, valid: jax.Array) -> DsaState:
    """Store `k, g [B, R, Di]` at positions `pos [B, R]` where `valid`; refresh finished pools.

    A row whose position ends a pool (`(t+1) % KP == 0`) recomputes that pool's key from the
    stored (cache-dtype) members. Invalid rows write nothing (their index is out of range and
    dropped).
    """
    kp, tmax = cfg.index_kpool, cfg.max_context
    b = jnp.arange(k.shape[0])[:, None]  # [B, 1]
    row = jnp.where(valid, pos, tmax)  # [B, R]
    index_k = state.index_k.at[b, row].set(k.astype(state.index_k.dtype), mode="drop")
    index_g = state.index_g.at[b, row].set(g.astype(state.index_g.dtype), mode="drop")

    pool = pos // kp  # [B, R]
    members = jnp.clip(pool[..., None] * kp + jnp.arange(kp), 0, tmax - 1)  # [B, R, KP]
    keys = pool_key(index_k[b[..., None], members], index_g[b[..., None], members], ape)
    completes = valid & ((pos + 1) % kp == 0)
    pool_keys = state.pool_keys.at[b, jnp.where(completes, pool, cfg.num_pools)].set(
        keys, mode="drop")
    return state._replace(index_k=index_k, index_g=index_g, pool_keys=pool_keys)


def pool_scores(cfg: DsaConfig, qi: jax.Array, w: jax.Array, pool_keys: jax.Array,
                n_cand: jax.Array) -> jax.Array:
    """`qi [B, R, Hi, Di]`, `w [B, R, Hi]`, keys `[B, P, Di]`, `n_cand [B, R]` -> `[B, R, P]`."""
    impl = resolve(cfg.implementation)
    if impl == "xla":
        return pool_scores_op.pool_scores_xla(qi, w, pool_keys, n_cand)
    return pool_scores_op.pool_scores_pallas(qi, w, pool_keys, n_cand,
                                             interpret=impl == "pallas-interpret")
