"""The indexer cache: row writes, pool keys when a pool completes, pool scores.

Pool keys are kept in the state (`pool_keys [B, P, Di]`), computed once from the stored `k`
and gate when the pool's last token is written, so a step reads `P` keys instead of
recomputing `P * KP` softmaxes. The raw rows live in a small ring per sequence (`dsa_jax.state`,
"The indexer ring"): after its key is written a pool's rows are never read again.
"""

from __future__ import annotations

import jax

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import index_write_op, pool_scores_op
from dsa_jax.stacked import operand
from dsa_jax.state import DsaState, ring_rows
from dsa_jax.weights import DsaWeights


def write_index_rows(cfg: DsaConfig, weights: DsaWeights, state: DsaState, k_raw: jax.Array,
                     g: jax.Array, pos: jax.Array, valid: jax.Array,
                     layer: jax.Array | int = 0, *, cols: tuple[int, int] | None = None,
                     meta: jax.Array | None = None) -> DsaState:
    """Store `k_norm(k_raw)`, `g [B, R, Di]` at positions `pos [B, R]` (consecutive: `pos[b, 0]
    + r`) where `valid`, and the key of every pool those rows complete (from the stored,
    cache-dtype members). `layer`: which of the layers stacked along the state's ring and key
    rows (`[B, L * Rr, Di]`, `[B, L * P, Di]`: the model's scan) these rows belong to.
    cols: `(k_start, g_start)`: k_raw and g are the x projection's wider output, read in place
    at those columns by the kernels. meta: the kernels' per-row metadata `[7, B*R]`
    (`index_write.row_meta`), computed already (`layer.step`'s row metadata); the definition
    ignores it."""
    layers = state.index_k.shape[1] // ring_rows(cfg)
    # LayerOfs (the model's scan) share one index: the kernels read their stacks in place.
    (norm_w, at), (norm_b, _), (ape, _) = (operand(cfg, w) for w in (
        weights.k_norm_w, weights.k_norm_b, weights.ape))
    index_k, index_g, keys = index_write_op(cfg, k_raw, g, norm_w, norm_b, ape, state.index_k,
                                            state.index_g, state.pool_keys, pos, valid, layer,
                                            layers=layers, cols=cols, weight_layer=at,
                                            kernel_options=None if meta is None
                                            else dict(meta=meta))
    return state._replace(index_k=index_k, index_g=index_g, pool_keys=keys)


def pool_scores(cfg: DsaConfig, qi: jax.Array, w: jax.Array, pool_keys: jax.Array,
                n_cand: jax.Array, seqs: tuple[jax.Array | int, int] | None = None,
                pools: tuple[jax.Array | int, int] | None = None) -> jax.Array:
    """`qi [B, R, Hi, Di]`, `w [B, R, Hi]`, keys `[B, P, Di]`, `n_cand [B, R]` -> `[B, R, P]`;
    with `seqs=(first, count)` (first may be traced, count static) only those sequences' rows,
    `[count, R, P]`, bitwise the same rows of the whole result; with `pools=(base, P)` (base
    may be traced) the keys are `pool_keys[:, base:base + P]` of a stacked `[B, L * P, Di]`,
    read in place by the kernels (pallas/pool_scores.py)."""
    kwargs = {k: v for k, v in (("seqs", seqs), ("pools", pools)) if v is not None}
    return pool_scores_op(cfg, qi, w, pool_keys, n_cand, **kwargs)


def pool_scores_at(cfg: DsaConfig, qi: jax.Array, w: jax.Array, pool_keys: jax.Array,
                   pos: jax.Array, valid: jax.Array) -> jax.Array:
    """`pool_scores` of rows at `pos [B, R]` (`valid`; its candidates the pools complete there,
    none where not valid: `layer.candidate_pools`) -> `[B, R, P]`, the same bits. Where the
    Mosaic kernel runs it computes each row's count itself, so a lone selection call runs no
    pass before it."""
    return pool_scores_op(cfg, qi, w, pool_keys, None,
                          positions=(pos, valid, cfg.index_kpool))
