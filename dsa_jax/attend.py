"""The paged latent cache: the latent write, and the gather-attend over it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import resolve
from dsa_jax.pallas import sparse_attend as sparse_attend_op
from dsa_jax.state import DsaState, quantize_latent


def write_latents(cfg: DsaConfig, state: DsaState, latent: jax.Array, pos: jax.Array,
                  valid: jax.Array) -> DsaState:
    """Quantize `latent [B, R, C]` and store row (b, r) at its paged slot for `pos [B, R]`.

    Slot of position t: `table[t // bs] * bs + t % bs`. Invalid rows get an out-of-range
    slot and are dropped, never clamped onto a live slot.
    """
    nb, bs, c = state.latent.shape
    logical = jnp.clip(pos // bs, 0, state.block_tables.shape[1] - 1)
    slot = jnp.take_along_axis(state.block_tables, logical, axis=1) * bs + pos % bs
    slot = jnp.where(valid, slot, nb * bs)
    stored = quantize_latent(cfg, latent, state.kv_scale)
    flat = state.latent.reshape(nb * bs, c).at[slot.reshape(-1)].set(
        stored.reshape(-1, c), mode="drop")
    return state._replace(latent=flat.reshape(nb, bs, c))


def attend(cfg: DsaConfig, state: DsaState, q_abs: jax.Array, sel: jax.Array) -> jax.Array:
    """`q_abs [B, R, Hl, C]`, `sel [B, R, W]` -> attended latents `[B, R, Hl, C]` f32."""
    impl = resolve(cfg.implementation)
    scale = cfg.qk_nope_head_dim ** -0.5
    args = (q_abs, state.latent, state.kv_scale, state.block_tables, sel)
    if impl == "xla":
        return sparse_attend_op.sparse_attend_xla(*args, softmax_scale=scale)
    return sparse_attend_op.sparse_attend_pallas(*args, softmax_scale=scale,
                                                 interpret=impl == "pallas-interpret")
