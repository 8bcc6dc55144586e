"""Pooled indexer scores: `score[b, r, p] = sum_h w[b, r, h] * relu(qi[b, r, h] . K[b, p])`.

The scales `Hi^-0.5 * Di^-0.5` are already folded into `w` (weights.py). Pools `p >= n_cand`
(not yet complete at the row's position) score `-inf`. -0.0 is returned as 0.0 so the total
order of the selection sees one zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Query rows per lax.map step of the XLA twin: bounds the [rows, Hi, P] fp32 block.
XLA_ROW_CHUNK = 256


def _score_row(qi, w, keys, n_cand):
    """One query row: qi [Hi, Di], w [Hi], keys [P, Di], n_cand [] -> [P]."""
    dots = jnp.einsum("hd,pd->hp", qi, keys)
    scores = jnp.einsum("h,hp->p", w, jax.nn.relu(dots))
    scores = jnp.where(scores == 0, 0.0, scores)
    return jnp.where(jnp.arange(keys.shape[0]) < n_cand, scores, -jnp.inf)


def pool_scores_xla(qi: jax.Array, w: jax.Array, pool_keys: jax.Array, n_cand: jax.Array
                    ) -> jax.Array:
    """The definition.

    qi: [B, R, Hi, Di] f32; w: [B, R, Hi] f32 (scales folded); pool_keys: [B, P, Di] f32;
    n_cand: [B, R] int32 complete pools visible to each row. Returns [B, R, P] f32.
    """
    rows_of_seq = jax.vmap(_score_row, in_axes=(0, 0, None, 0))  # rows share the keys
    if qi.shape[1] <= XLA_ROW_CHUNK:
        return jax.vmap(rows_of_seq)(qi, w, pool_keys, n_cand)

    def one_seq(args):
        q_s, w_s, k_s, n_s = args
        return lax.map(lambda a: _score_row(a[0], a[1], k_s, a[2]), (q_s, w_s, n_s),
                       batch_size=XLA_ROW_CHUNK)

    return lax.map(one_seq, (qi, w, pool_keys, n_cand))
