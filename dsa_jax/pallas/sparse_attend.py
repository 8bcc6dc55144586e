"""Sparse MLA gather-attend over the paged latent cache.

For every sequence `b`, query row `r` and head `h`: gather the latents of the selected tokens
`sel[b, r]` (`-1` slots skipped) through the sequence's block table, dequantize, and return the
softmax-weighted latent sum `sum_j p_j c_j` with `p = softmax_j((q . c_j) * softmax_scale)`.
A row with an empty selection returns 0. fp32 throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Rows per lax.map step of the XLA twin: bounds the gathered [rows, W, C] fp32 block.
XLA_ROW_CHUNK = 64


def token_slots(tokens: jax.Array, block_table: jax.Array, block_size: int) -> jax.Array:
    """Token positions `[...]` of one sequence -> flat cache slots; -1 stays -1."""
    logical = jnp.clip(tokens // block_size, 0, block_table.shape[0] - 1)
    slots = block_table[logical] * block_size + tokens % block_size
    return jnp.where(tokens >= 0, slots, -1)


def _attend_row(q, latent_flat, kv_scale, slots, softmax_scale):
    """One query row: q [H, C] f32, slots [W] -> [H, C] f32 (slots < 0 are empty)."""
    valid = slots >= 0  # [W]
    c = latent_flat[jnp.maximum(slots, 0)].astype(jnp.float32)  # [W, C]
    if latent_flat.dtype == jnp.float8_e4m3fn:
        c = c * kv_scale
    logits = jnp.einsum("hc,wc->hw", q, c) * softmax_scale
    logits = jnp.where(valid[None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)  # exactly 0 where invalid
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("hw,wc->hc", p, c)
    return out / jnp.where(denom > 0, denom, 1.0)


def sparse_attend_xla(q: jax.Array, latent: jax.Array, kv_scale: jax.Array,
                      block_tables: jax.Array, sel: jax.Array, *, softmax_scale: float
                      ) -> jax.Array:
    """The definition.

    q: [B, R, H, C] f32 absorbed queries; latent: [NB, bs, C] cache dtype; kv_scale: [] f32
    (applied to float8_e4m3fn caches only); block_tables: [B, MB] int32; sel: [B, R, W] int32
    token indices, -1 padded. Returns [B, R, H, C] f32.
    """
    b, r, h, c = q.shape
    nb, bs, _ = latent.shape
    latent_flat = latent.reshape(nb * bs, c)
    slots = jax.vmap(token_slots, in_axes=(0, 0, None))(sel, block_tables, bs)  # [B, R, W]
    q_rows = q.reshape(b * r, h, c)
    slot_rows = slots.reshape(b * r, -1)
    def row(args):
        return _attend_row(args[0], latent_flat, kv_scale, args[1], softmax_scale)

    if b * r <= XLA_ROW_CHUNK:
        out = jax.vmap(row)((q_rows, slot_rows))
    else:
        out = lax.map(row, (q_rows, slot_rows), batch_size=XLA_ROW_CHUNK)
    return out.reshape(b, r, h, c)
