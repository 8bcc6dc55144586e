"""A decode's or verify's front (everything between the x projection's GEMM and the selection)
in two shared launches, where its kernels agree on their warps.

The x projection's GEMM leaves its K parts unsummed (`matmul_part(summed=False)`); its
readers add them in split order themselves (`common.load_parts`: the same values as the sum):
(1) `x_readers`: the index rows' write, the latent write, the q_a RMSNorm and the indexer
head weights' columns; (2) `pool_keys_matmul`: the pool keys (from the index rows just written)
beside the indexer query's GEMM (from the norm). Each part is its kernel's own program at its
kernel's warps (`colaunch`), so the results are those of one launch per kernel, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax import lax

from dsa_jax.pallas import index_write, latent_write, rms_norm
from dsa_jax.pallas.colaunch import colaunch
from dsa_jax.pallas.index_write import index_write_parts
from dsa_jax.pallas.latent_write import latent_write_part, pick_store
from dsa_jax.pallas.matmul import default_tuning, matmul_part, reads_fp8, summed_columns_part
from dsa_jax.pallas.rms_norm import rms_norm_part


class Front(NamedTuple):
    """What the front writes and computes."""
    latent: jax.Array  # [NB, bs, C] the latent cache with the rows stored
    index_k: jax.Array  # [B, L * Rr, Di] the indexer ring with the rows stored
    index_g: jax.Array  # [B, L * Rr, Di]
    pool_keys: jax.Array  # [B, L * P, Di] with the keys of the pools the rows complete
    q_resid: jax.Array  # [B, R, R_q] the q GEMMs' normalized operand
    qi: jax.Array  # [B, R, Hi * Di] f32 the indexer query's GEMM
    w: jax.Array  # [B, R, Hi] f32 the indexer head weights


def qi_tuning(qi_weight, tokens: int):
    """The indexer query GEMM's tiles for `tokens` rows: its kernel's defaults for the weight
    (`qi_weight` an array `[N, K]`, a stack `[G, N, K]` or fp8 blocks: fp8 takes its own
    tiles, `default_tuning(fp8_weight=True)`)."""
    return default_tuning(*qi_weight.shape[-2:], 1, tokens, reads_fp8(qi_weight))


def front_warps(rows_per_seq: int, tokens: int, qi_weight, latent_shape, latent_dtype
                ) -> int | None:
    """The warps every part of the shared launches runs at, or None where the front's
    kernels would run at different warps (a part at other warps would not be its kernel's
    program) or XLA stores the latent cache (`pick_store`): then each kernel runs as its own
    launch, with the same results. rows_per_seq: the step's rows per sequence; tokens: its
    rows in all (B * R); qi_weight: the indexer query GEMM's weight (`qi_tuning`)."""
    warps = {rms_norm.NUM_WARPS, latent_write.warps_for(rows_per_seq),
             index_write.warps_for(rows_per_seq), qi_tuning(qi_weight, tokens).num_warps}
    if len(warps) > 1 or pick_store(latent_shape, latent_dtype) != "kernel":
        return None
    return warps.pop()


def decode_front(xp: jax.Array, *, warps: int, interpret: bool, eps: float,
                 q_norm: jax.Array, q_norm_at: jax.Array | None, q_cols: tuple[int, int],
                 q_dtype, kv_norm: jax.Array, kv_norm_at: jax.Array | None, kv_col: int,
                 latent: jax.Array, kv_scale: jax.Array, block_tables: jax.Array,
                 slots: jax.Array, k_norm_w: jax.Array, k_norm_b: jax.Array, ape: jax.Array,
                 index_weight_at: jax.Array | None, index_k: jax.Array, index_g: jax.Array,
                 pool_keys: jax.Array, ring_layers: int, index_cols: tuple[int, int],
                 index_meta: jax.Array, w_cols: tuple[int, int], qi_weight: jax.Array,
                 qi_weight_at: jax.Array | None, pos: jax.Array, valid: jax.Array) -> Front:
    """The front of a step from the x projection's K parts `xp [S, B, R, Nx]`, in two
    launches at `warps` (`front_warps`). The operands are the kernels' own (each `*_at` the
    layer index of a stacked weight, or None): the q_a norm's weight and columns `q_cols` of
    xp (written in `q_dtype`), the latent norm's weight and column `kv_col`, the cache and its
    rows' `slots [B*R]`, the indexer's k-norm, ape, ring and key arrays of `ring_layers` layers
    with columns `index_cols` (k, gate) and the rows' metadata `index_meta`, the head weights'
    columns `w_cols`, the indexer query's weight; `pos`, `valid` `[B, R]` the rows."""
    s = xp.shape[0]
    norm_part, norm_done = rms_norm_part(xp, q_norm, eps, cols=q_cols, dtype=q_dtype,
                                         layer=q_norm_at, parts=s)
    lat_part, lat_done = latent_write_part(xp, kv_norm, latent, kv_scale, block_tables, pos,
                                           valid, eps=eps, col=kv_col, layer=kv_norm_at,
                                           slots=slots, parts=s)
    ix = index_write_parts(xp, xp, k_norm_w, k_norm_b, ape, index_k, index_g, pool_keys, pos,
                           valid, layers=ring_layers, cols=index_cols,
                           weight_layer=index_weight_at, meta=index_meta, parts=s)
    w_part, w_done = summed_columns_part(xp, *w_cols)  # the head weights [B, R, Hi]
    rows_outs, lat_outs, norm_outs, w_outs = colaunch(
        [ix.rows, lat_part, norm_part, w_part], num_warps=warps, num_stages=1,
        interpret=interpret, name="x_readers")
    q_resid = norm_done(norm_outs)  # [B, R, R_q]
    qt = qi_tuning(qi_weight, xp.shape[1] * xp.shape[2])
    # The barrier as in `projection.project`: XLA:GPU's dot merger must not merge the two q
    # GEMMs.
    qi_part, qi_done = matmul_part(lax.optimization_barrier(q_resid), qi_weight, qi_weight_at,
                                   tuning=qt)
    pool_outs, qi_outs = colaunch([ix.pool(rows_outs), qi_part], num_warps=warps,
                                  num_stages=qt.num_stages, interpret=interpret,
                                  name="pool_keys_matmul")
    index_k, index_g, keys = ix.finish(rows_outs, pool_outs)
    return Front(lat_done(lat_outs), index_k, index_g, keys, q_resid, qi_done(qi_outs),
                 w_done(w_outs))
