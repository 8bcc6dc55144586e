"""Pooled indexer scores: `score[b, r, p] = sum_h w[b, r, h] * relu(qi[b, r, h] . K[b, p])`.

The scales `Hi^-0.5 * Di^-0.5` are already folded into `w` (weights.py). Pools `p >= n_cand`
(not yet complete at the row's position) score `-inf`; the kernel reads no key for a tile of
such pools, so its cost follows the live length, not `P`. -0.0 is returned as 0.0 so the total
order of the selection sees one zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# Query rows per lax.map step of the XLA twin: bounds the [rows, Hi, P] fp32 block.
XLA_ROW_CHUNK = 256


def _score_row(qi, w, keys, n_cand):
    """One query row: qi [Hi, Di], w [Hi], keys [P, Di], n_cand [] -> [P]."""
    # HIGHEST: IEEE fp32 on every backend (a GPU would run fp32 dots as tf32, ~1e-3 off, and
    # the scores feed an exact top-k).
    dots = jnp.einsum("hd,pd->hp", qi, keys, precision=lax.Precision.HIGHEST)
    scores = jnp.einsum("h,hp->p", w, jax.nn.relu(dots), precision=lax.Precision.HIGHEST)
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


# ---------------------------------------------------------------------------------------------
# Pallas (Triton) kernel.
#
# Grid (row, pool chunk), rows fastest: the rows of one sequence read the same keys, so they
# run side by side and share them through L2. A program loads its row's qi [Hi, Di] and head
# weights, then walks its chunk of pools (by default a single tile) in tiles [BP, Di], masked:
# the last tile may be partial, Di may not be a power of two, and the key array is never
# copied. fp32-accurate throughout, since the scores feed an exact top-k: the dot runs as
# 3-pass tf32 on the GPU (Triton's IEEE fp32 dot ran near 1 TFLOP/s on the H200, 25x slower
# than XLA) and as IEEE fp32 in interpret mode.
# ---------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _scores_kernel(ncand_ref, qi_ref, w_ref, keys_ref, out_ref, *, rows_per_seq: int,
                   num_pools: int, width: int, block_p: int, tiles: int, precision):
    """One (row, pool chunk) program: `tiles` tiles of BP pools.

    ncand_ref: [N] int32 (whole); qi_ref: [Hp, Dp] f32; w_ref: [Hp] f32 (padded heads 0);
    keys_ref: [B, P, Di] f32 (whole); out_ref: [N, P] f32 (whole, masked store).
    """
    row, chunk = pl.program_id(0), pl.program_id(1)
    qi = qi_ref[...]  # [Hp, Dp]
    w = w_ref[...]  # [Hp]
    n_cand = ncand_ref[row]
    seq = row // rows_per_seq
    dp = qi.shape[1]
    dims = jnp.arange(dp, dtype=jnp.int32)  # [Dp]

    def score_tile(pools, in_range):
        mask = in_range[:, None] if width == dp else in_range[:, None] & (dims < width)[None, :]
        mask = jnp.broadcast_to(mask, (block_p, dp))  # Triton wants the pointer's shape
        keys = plt.load(keys_ref.at[seq, pools[:, None], dims[None, :]], mask=mask,
                        other=0.0)  # [BP, Dp]
        dots = lax.dot_general(qi, keys, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)  # [Hp, BP]
        scores = jnp.sum(w[:, None] * jnp.maximum(dots, 0.0), axis=0)  # [BP]
        scores = jnp.where(scores == 0, 0.0, scores)  # -0.0 -> 0.0
        return jnp.where(pools < n_cand, scores, -jnp.inf)

    def tile(t, carry):
        first = (chunk * tiles + t) * block_p
        pools = first + jnp.arange(block_p, dtype=jnp.int32)  # [BP]
        in_range = pools < num_pools  # [BP]
        # A tile with no candidate (past the row's live length, or a padded row) reads no key.
        scores = lax.cond(first < n_cand, lambda: score_tile(pools, in_range),
                          lambda: jnp.full((block_p,), -jnp.inf, jnp.float32))
        plt.store(out_ref.at[row, pools], scores, mask=in_range)
        return carry

    lax.fori_loop(0, tiles, tile, 0)


def pool_scores_pallas(qi: jax.Array, w: jax.Array, pool_keys: jax.Array, n_cand: jax.Array, *,
                       interpret: bool = False, block_p: int = 64,
                       num_chunks: int | None = None, num_warps: int = 4,
                       num_stages: int = 3) -> jax.Array:
    """`pool_scores_xla` as a Pallas kernel; same arguments, same result within fp32 rounding
    (tests/test_kernels.py). qi [B, R, Hi, Di] -> [B, R, P] f32.

    Hi and Di are padded to powers of two >= 16 (the smallest dot tile) with zeros, which add
    nothing: padded heads carry weight 0, padded dims multiply zero keys. block_p: pools per
    tile; num_chunks: programs per row, each looping over its share of the tiles (None: one
    tile per program, which measured fastest on the H200: 122 us against 174 us for ~4
    programs per multiprocessor at 64 rows x 4096 pools, results/h200-kernel-parity.json).
    """
    b, r, hi, di = qi.shape
    p = pool_keys.shape[1]
    n = b * r
    hp, dp = max(16, _next_pow2(hi)), max(16, _next_pow2(di))
    block_p = min(block_p, max(16, _next_pow2(p)))
    tiles_all = -(-p // block_p)
    chunks = min(num_chunks or tiles_all, tiles_all)
    tiles = -(-tiles_all // chunks)  # tiles per program
    qi_p = qi.reshape(n, hi, di)  # [N, Hp, Dp] after padding
    w_p = w.reshape(n, hi)  # [N, Hp] after padding
    if (hp, dp) != (hi, di):
        qi_p = jnp.pad(qi_p, ((0, 0), (0, hp - hi), (0, dp - di)))
        w_p = jnp.pad(w_p, ((0, 0), (0, hp - hi)))
    precision = (lax.Precision.HIGHEST if interpret
                 else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    kernel = functools.partial(_scores_kernel, rows_per_seq=r, num_pools=p, width=di,
                               block_p=block_p, tiles=tiles, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=(n, chunks),
        in_specs=[
            pl.BlockSpec(),  # n_cand [N]
            pl.BlockSpec((None, hp, dp), lambda i, t: (i, 0, 0)),  # qi [N, Hp, Dp]
            pl.BlockSpec((None, hp), lambda i, t: (i, 0)),  # w [N, Hp]
            pl.BlockSpec(),  # keys [B, P, Di]
        ],
        out_specs=pl.BlockSpec(),  # [N, P], stored with a mask
        out_shape=jax.ShapeDtypeStruct((n, p), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="pool_scores",
    )(n_cand.reshape(n).astype(jnp.int32), qi_p.astype(jnp.float32),
      w_p.astype(jnp.float32), pool_keys.astype(jnp.float32))
    return out.reshape(b, r, p)
