"""The paged latent cache: the latent write, and the gather-attend over it."""

from __future__ import annotations

import jax

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import resolve
from dsa_jax.pallas import latent_write as latent_write_op
from dsa_jax.pallas import sparse_attend as sparse_attend_op
from dsa_jax.state import DsaState


def write_latents(cfg: DsaConfig, state: DsaState, kv_raw: jax.Array, norm_w: jax.Array,
                  pos: jax.Array, valid: jax.Array) -> DsaState:
    """RMSNorm `kv_raw [B, R, C]`, quantize, and store row (b, r) at its paged slot for
    `pos [B, R]` (`table[t // bs] * bs + t % bs`) where `valid`; other rows write nothing."""
    impl = resolve(cfg.implementation)
    args = (kv_raw, norm_w, state.latent, state.kv_scale, state.block_tables, pos, valid)
    if impl == "xla":
        latent = latent_write_op.latent_write_xla(*args, eps=cfg.rms_norm_eps)
    else:
        latent = latent_write_op.latent_write_pallas(*args, eps=cfg.rms_norm_eps,
                                                     interpret=impl == "pallas-interpret")
    return state._replace(latent=latent)


def attend(cfg: DsaConfig, state: DsaState, q_abs: jax.Array, sel: jax.Array,
           live_rows: int | None = None) -> jax.Array:
    """`q_abs [B, R, Hl, C]`, `sel [B, R, W]` -> attended latents `[B, R, Hl, C]` f32.

    live_rows: the rows expected to hold a selection (a static hint for the kernel's work
    split; None: all B*R). It changes no result's meaning, only how the work is spread."""
    impl = resolve(cfg.implementation)
    scale = cfg.qk_nope_head_dim ** -0.5
    args = (q_abs, state.latent, state.kv_scale, state.block_tables, sel)
    if impl == "xla":
        return sparse_attend_op.sparse_attend_xla(*args, softmax_scale=scale)
    return sparse_attend_op.sparse_attend_pallas(*args, softmax_scale=scale,
                                                 interpret=impl == "pallas-interpret",
                                                 live_rows=live_rows)
