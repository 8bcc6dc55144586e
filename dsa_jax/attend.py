"""The paged latent cache: the latent write, and the gather-attend over it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import latent_write_op, sparse_attend_op
from dsa_jax.stacked import operand
from dsa_jax.state import DsaState


def write_latents(cfg: DsaConfig, state: DsaState, kv_raw: jax.Array, norm_w,
                  pos: jax.Array, valid: jax.Array, *, col: int | None = None,
                  slots: jax.Array | None = None) -> DsaState:
    """RMSNorm `kv_raw [B, R, C]`, quantize, and store row (b, r) at its paged slot for
    `pos [B, R]` (`table[t // bs] * bs + t % bs`) where `valid`; other rows write nothing.
    col: kv_raw is the wider x projection output, its C columns from `col` the raw latent
    (read in place by the kernel). norm_w: `[C]`, or a `stacked.LayerOf` (the model's scan).
    slots: the rows' flat cache rows `[B*R]` as the kernel computes them from pos and valid
    (`latent_write.flat_slots`), computed already (`layer.step`'s row metadata); the
    definition ignores it."""
    norm_w, at = operand(cfg, norm_w)  # a LayerOf: read in place in its stack
    latent = latent_write_op(cfg, kv_raw, norm_w, state.latent, state.kv_scale,
                             state.block_tables, pos, valid, eps=cfg.rms_norm_eps, col=col,
                             layer=at,
                             kernel_options=None if slots is None else dict(slots=slots))
    return state._replace(latent=latent)


def attend(cfg: DsaConfig, state: DsaState, q_abs: jax.Array, sel: jax.Array,
           live_rows: int | None = None, *, dtype=jnp.float32, rows: int | None = None,
           fill: jax.Array | None = None,
           q_scaled: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`q_abs [B, R, Hl, C]`, `sel [B, R, W]` -> attended latents `[B, R, Hl, C]` f32.

    live_rows: the rows expected to hold a selection (a static hint for the kernel's work
    split; None: all B*R). It changes no result's meaning, only how the work is spread.
    dtype: the result's (rounded from f32). rows, fill: attend only each sequence's first
    `rows` rows; row r >= rows of sequence b is fill[b, r] (fill [B, R] f32;
    `sparse_attend_xla`). q_scaled: `projection.scaled_q_abs` of the same rows (a prompt's):
    q_abs as the Mosaic kernel takes it (`AttendTuning.mosaic`'s `bound_scales`); no
    other path reads it."""
    return sparse_attend_op(cfg, q_abs, state.latent, state.kv_scale, state.block_tables, sel,
                            softmax_scale=cfg.qk_nope_head_dim ** -0.5, out_dtype=dtype,
                            rows=rows, fill=fill,
                            kernel_options=dict(live_rows=live_rows, q_scaled=q_scaled))
