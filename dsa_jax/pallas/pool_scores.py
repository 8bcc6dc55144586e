"""Pooled indexer scores: `score[b, r, p] = sum_h w[b, r, h] * relu(qi[b, r, h] . K[b, p])`.

The scales `Hi^-0.5 * Di^-0.5` are already folded into `w` (weights.py). Pools `p >= n_cand`
(not yet complete at the row's position) score `-inf`; the kernel reads no key for a tile of
such pools, so its cost follows the live length, not `P`. -0.0 is returned as 0.0 so the total
order of the selection sees one zero.

`seqs=(first, count)`: score only sequences `first .. first + count - 1` of the batch (a
tensor-parallel rank's share of the rows, `sharding.split_select`); `first` may be traced
(`axis_index * share` inside `shard_map`), `count` is static. The result `[count, R, P]` is
bitwise those rows of the whole batch's result: the kernel launches programs for those
sequences only, each computing its tiles as the whole-batch kernel does; the twin computes the
whole batch and slices (its dots' last bits may depend on the batch shape).

`pools=(base, count)`: the keys are pools `base .. base + count - 1` of `pool_keys`' pool axis
(a full layer's keys in the model's stacked cache `[B, Lf * P, Di]`, `base = f * P`); `base`
may be traced, `count` is static. The kernels read them in place (a copy of the layer's keys
was 134 MB per layer and token at 64 sequences x 16K); the twin slices them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.numerics import tree_sum
from dsa_jax.pallas import pool_scores_mgpu as mgpu_scores
from dsa_jax.pallas import tuned
from dsa_jax.pallas.common import next_pow2, sm_count, with_overrides
from dsa_jax.pallas.row_meta import candidate_pools

# Query rows per lax.map step of the XLA twin: bounds the [rows, Hi, P] fp32 block.
XLA_ROW_CHUNK = 256


def _score_row(qi, w, keys, n_cand):
    """One query row: qi [Hi, Di], w [Hi], keys [P, Di], n_cand [] -> [P]."""
    # HIGHEST: IEEE fp32 on every backend (a GPU would run fp32 dots as tf32, ~1e-3 off, and
    # the scores feed an exact top-k).
    dots = jnp.einsum("hd,pd->hp", qi, keys.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)
    # the head sum in a fixed tree: a row's bits whatever the batch (`tree_sum`)
    scores = tree_sum((w[:, None] * jax.nn.relu(dots)).T)  # [P]
    scores = jnp.where(scores == 0, 0.0, scores)
    return jnp.where(jnp.arange(keys.shape[0]) < n_cand, scores, -jnp.inf)


def seq_range(num_seqs: int, seqs) -> tuple[jax.Array, int]:
    """`seqs` (None: all; or `(first, count)`, first an int or a traced int32 scalar, count a
    static int) -> (first as int32 [], count). A static first is checked; a traced one is
    clamped to `[0, num_seqs - count]` as `lax.dynamic_slice` clamps."""
    return _static_range(num_seqs, seqs, "seqs", "first", "B=", "B - count = ", "")


def pool_range(total: int, pools) -> tuple[jax.Array, int]:
    """`pools` (None: all `total`; or `(base, count)`, base an int or a traced int32 scalar,
    count a static int) -> (base as int32 [], count), as `seq_range` checks and clamps."""
    return _static_range(total, pools, "pools", "base", "", "",
                         " (the keys' pool axis{})")


def _static_range(total: int, spec, name: str, start_name: str, total_label: str,
                  span_label: str, axis_note: str) -> tuple[jax.Array, int]:
    """`seq_range` / `pool_range`: the range checked (errors name `name`, and `axis_note`
    with "" or " holds {total}" filled in), its start clamped."""
    if spec is None:
        return jnp.int32(0), total
    start, count = spec
    if not isinstance(count, int) or not 1 <= count <= total:
        raise ValueError(f"pool_scores: {name} count={count!r} must be a static int in "
                         f"[1, {total_label}{total}]{axis_note.format('')}")
    if isinstance(start, (int, np.integer)) and not 0 <= start <= total - count:
        raise ValueError(f"pool_scores: {name} {start_name}={start} with count={count} must "
                         f"lie in [0, {span_label}{total - count}]"
                         f"{axis_note.format(f' holds {total}')}")
    return jnp.clip(jnp.asarray(start).astype(jnp.int32), 0, total - count), count


def row_counts(n_cand: jax.Array | None, positions) -> jax.Array:
    """n_cand [B, R] int32, given or as `positions=(pos, valid, KP)` say
    (`row_meta.candidate_pools`): exactly one of the two."""
    if (n_cand is None) == (positions is None):
        raise ValueError("pool_scores: give exactly one of n_cand and positions=(pos, valid, "
                         "kpool) (not both, not neither)")
    if positions is None:
        return n_cand
    pos, valid, kpool = positions
    if kpool < 1 or pos.shape != valid.shape:
        raise ValueError(f"pool_scores: positions need pos and valid of one shape and a pool "
                         f"size >= 1; got {pos.shape}, {valid.shape}, kpool={kpool}")
    return candidate_pools(pos, valid, kpool)


def pool_scores_xla(qi: jax.Array, w: jax.Array, pool_keys: jax.Array,
                    n_cand: jax.Array | None, *, seqs=None, pools=None,
                    positions=None) -> jax.Array:
    """The definition.

    qi: [B, R, Hi, Di] f32; w: [B, R, Hi] f32 (scales folded); pool_keys: [B, P, Di] f32 or
    bf16 (the index cache's dtype; its values are widened exactly);
    n_cand: [B, R] int32 complete pools visible to each row, or None with `positions=(pos,
    valid, KP)`: the counts `row_meta.candidate_pools(pos, valid, KP)` (`row_counts`).
    Returns [B, R, P] f32, or with
    `seqs=(first, count)` its rows `first .. first + count - 1`: [count, R, P] (computed at the
    whole batch's shape, then sliced, so the bits are the whole batch's). With
    `pools=(base, P)` the keys are `pool_keys[:, base:base + P]` (the module docstring).
    """
    n_cand = row_counts(n_cand, positions)
    if pools is not None:
        base, count = pool_range(pool_keys.shape[1], pools)
        pool_keys = lax.dynamic_slice_in_dim(pool_keys, base, count, 1)  # [B, P, Di]
    if seqs is not None:
        first, count = seq_range(qi.shape[0], seqs)
        # The barrier keeps XLA from narrowing the dots to the slice (other bits).
        whole = lax.optimization_barrier(pool_scores_xla(qi, w, pool_keys, n_cand))
        return lax.dynamic_slice_in_dim(whole, first, count, 0)
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
# Grid (row group, pool chunk), row groups fastest. A program holds RB rows of one sequence
# (`default_rows_per_program`; a prompt's rows share their sequence's keys), loads their
# qi as one [RB*Hi, Di] block and their head weights, then walks its chunk of pools in tiles
# [BLOCK_P, Di], masked: the last tile may be partial, Di may not be a power of two, and the
# key array is never copied. One dot serves the RB rows, so each key tile is read once per
# group. A tile past every row's candidates reads no key: decode and verify rows test each
# tile with a branch; a prompt's rows (`prompt_shaped`) loop over the chunk's live tiles only,
# then store -inf for the rest, so the loop body is a plain load -> dot that Triton can
# pipeline. The dot is keys [BP, Dp] x qi^T: the pool tile as the MMA's M (64 rows, the shape
# Hopper's wgmma takes), the heads as N. fp32-accurate throughout, since the scores feed an
# exact top-k: the dot runs as 3-pass tf32 on the GPU (Triton's IEEE fp32 dot is far slower
# than XLA's) and as IEEE fp32 in interpret mode.
# ---------------------------------------------------------------------------------------------

BACKENDS = ("triton", "mosaic", "auto")
BLOCK_P = 64  # pools per tile
NUM_WARPS = 4
NUM_STAGES = 3
_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32_X3  # compiled; interpret mode: HIGHEST


@dataclasses.dataclass(frozen=True)
class PoolScoresTuning:
    """Which kernel runs `pool_scores_pallas`.

    backend: "triton" (this file's kernel), "mosaic" (`pool_scores_mgpu`: Pallas Mosaic GPU,
    bulk key copies and wgmmas, compiled for a Hopper GPU only, no interpret mode; raises
    where it cannot run) or "auto" (the default): mosaic where it runs these Hi, Di and key
    dtype (`pool_scores_mgpu.supports`) on a Hopper GPU (`common.gpu_is_not_hopper`), not in
    interpret mode; triton otherwise (`pick_backend`, `tuned.DEFAULTS`). The Mosaic kernel is
    the faster at decode and prompt rows alike. The rule depends on Hi, Di, the keys' dtype and
    the GPU's generation only, never on the rows or the batch, so a decode and a prompt of one
    model run the same kernel and a row scores the same bits in both."""
    backend: str = "auto"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"pool_scores: backend={self.backend!r} must be one of {BACKENDS}")


def pick_backend(tuning: PoolScoresTuning, hi: int, di: int, interpret: bool,
                 key_dtype=jnp.float32) -> str:
    """"triton" or "mosaic" by `PoolScoresTuning.backend`'s rule (for pool keys of
    `key_dtype`); raises where "mosaic" was asked for and cannot run."""
    why = mgpu_scores.supports(hi, di, key_dtype)
    if tuning.backend == "mosaic":
        if interpret:
            raise ValueError("pool_scores: backend='mosaic' compiles for a Hopper GPU and has "
                             "no interpret mode; use backend='triton' with interpret=True")
        if why is not None:
            raise ValueError(f"pool_scores: backend='mosaic' does not run {why}")
        return "mosaic"
    if (tuning.backend == "triton" or why is not None
            or tuned.backends(interpret).scores != "mosaic"):
        return "triton"
    return "mosaic"


def _scores_kernel(first_ref, ncand_ref, qi_ref, w_ref, keys_ref, out_ref, *, group_rows: int,
                   groups_per_seq: int, num_pools: int, width: int, block_p: int, tiles: int,
                   precision, bounded_loop: bool):
    """One (row group, pool chunk) program: `tiles` tiles of BP pools for RB rows.

    first_ref: [2] int32, the first scored sequence (its keys are read at `first + seq`) and
    the first pool (pool p's key at `base + p`); ncand_ref: [Np] int32 (whole); qi_ref:
    [RB*Hp, Dp] f32; w_ref: [RB*Hp] f32 (padded heads and rows 0); keys_ref: [B, Pk, Di] f32
    or bf16 (whole, Pk >= base + P; widened to f32 as loaded); out_ref: [Np, P] f32 (whole,
    masked store).
    """
    group, chunk = pl.program_id(0), pl.program_id(1)
    qi = qi_ref[...]  # [RB*Hp, Dp]
    w = w_ref[...]  # [RB*Hp]
    rows = group * group_rows + jnp.arange(group_rows, dtype=jnp.int32)  # [RB]
    n_cand = ncand_ref[pl.ds(group * group_rows, group_rows)]  # [RB]
    most = jnp.max(n_cand)
    seq = first_ref[0] + group // groups_per_seq
    base = first_ref[1]
    dp = qi.shape[1]
    hp = qi.shape[0] // group_rows
    dims = jnp.arange(dp, dtype=jnp.int32)  # [Dp]
    dims_ok = (dims < width)[None, :]  # [1, Dp]

    def load_keys(pools, in_range):
        mask = in_range[:, None] if width == dp else in_range[:, None] & dims_ok
        mask = jnp.broadcast_to(mask, (block_p, dp))  # Triton wants the pointer's shape
        return plt.load(keys_ref.at[seq, base + pools[:, None], dims[None, :]], mask=mask,
                        other=jnp.zeros((), keys_ref.dtype)).astype(jnp.float32)  # [BP, Dp]

    def score_tile(pools, in_range):  # -> [BP, RB]: the pool tile as M, heads as N
        keys = load_keys(pools, in_range)
        dots = lax.dot_general(keys, qi, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)  # [BP, RB*Hp]
        heads = w[None, :] * jnp.maximum(dots, 0.0)
        if group_rows == 1:
            scores = jnp.sum(heads, axis=1)[:, None]  # [BP, 1]
        else:
            scores = jnp.sum(heads.reshape(block_p, group_rows, hp), axis=2)  # [BP, RB]
        scores = jnp.where(scores == 0, 0.0, scores)  # -0.0 -> 0.0
        return jnp.where(pools[:, None] < n_cand[None, :], scores, -jnp.inf)

    def store(pools, in_range, scores):
        mask = jnp.broadcast_to(in_range[:, None], (block_p, group_rows))
        plt.store(out_ref.at[rows[None, :], pools[:, None]], scores, mask=mask)

    def pools_of(t):
        first = (chunk * tiles + t) * block_p
        pools = first + jnp.arange(block_p, dtype=jnp.int32)  # [BP]
        return pools, pools < num_pools

    dead_shape = (block_p, group_rows)

    def dead(t, carry):
        pools, in_range = pools_of(t)
        store(pools, in_range, jnp.full(dead_shape, -jnp.inf, jnp.float32))
        return carry

    if bounded_loop:
        # Tiles of this chunk that hold a candidate of some row: a prefix of the chunk.
        live = jnp.clip((most + block_p - 1) // block_p - chunk * tiles, 0, tiles)

        def live_tile(t, carry):
            pools, in_range = pools_of(t)
            store(pools, in_range, score_tile(pools, in_range))
            return carry

        lax.fori_loop(0, live, live_tile, 0)
        lax.fori_loop(live, tiles, dead, 0)
        return

    def tile(t, carry):
        first = (chunk * tiles + t) * block_p
        pools, in_range = pools_of(t)
        # A tile with no candidate for any row (past the live length, or padded rows) reads
        # no key.
        scores = lax.cond(first < most, lambda: score_tile(pools, in_range),
                          lambda: jnp.full(dead_shape, -jnp.inf, jnp.float32))
        store(pools, in_range, scores)
        return carry

    lax.fori_loop(0, tiles, tile, 0)


# A prompt's rows (more than a verify's per sequence) loop over their live tiles
# (`prompt_shaped`), in about PROMPT_PROGRAMS_PER_SM programs per multiprocessor.
PROMPT_ROWS = 8
PROMPT_PROGRAMS_PER_SM = 4
# Decode and verify rows: two tiles per program (qi loaded and split once for both) where at
# least this many programs per multiprocessor remain, else one.
MIN_PROGRAMS_PER_SM = 4


def chunk_split(groups: int, tiles_all: int, bounded_loop: bool,
                sms: int | None = None) -> tuple[int, int]:
    """(programs per row group, tiles per program) for `groups` row groups of `tiles_all`
    tiles each: with `bounded_loop` (a prompt's rows) enough chunks for about
    `PROMPT_PROGRAMS_PER_SM` programs per multiprocessor in all, else
    `default_tiles_per_program` tiles each; no program without a tile. sms: multiprocessors
    (None: `common.sm_count()`)."""
    sms = sms or sm_count()
    if bounded_loop:
        chunks = -(-PROMPT_PROGRAMS_PER_SM * sms // groups)
    else:
        chunks = -(-tiles_all // default_tiles_per_program(groups, tiles_all, sms))
    chunks = max(1, min(chunks, tiles_all))
    tiles = -(-tiles_all // chunks)
    return -(-tiles_all // tiles), tiles


def default_tiles_per_program(groups: int, tiles_all: int, sms: int) -> int:
    """2 where `groups * tiles_all / 2` programs still give `MIN_PROGRAMS_PER_SM` per
    multiprocessor, else 1: two tiles per program load and split qi once for both, which was
    faster for decode rows wherever the programs still fill the GPU."""
    return 2 if groups * tiles_all // 2 >= MIN_PROGRAMS_PER_SM * sms else 1


def prompt_shaped(rows_per_seq: int) -> bool:
    """Whether rows of this many per sequence are a prompt chunk: causal rows whose live pool
    counts differ, where a program looping over just its live tiles (qi loaded once) beat one
    program per tile, while one tile per program stayed faster for decode and verify rows."""
    return rows_per_seq > PROMPT_ROWS


def default_rows_per_program(rows_per_seq: int) -> int:
    """Rows of one sequence per program: one for a decode or verify step (up to 4 rows, most of
    them padding in a decode: with keys as the MMA's M, a program of padding rows skips its
    tiles), two for a prompt chunk (its rows share the keys). A row's scores are the same bits
    either way (tests/test_selection_kernels.py, and on the GPU)."""
    return 1 if rows_per_seq <= 4 else 2


def pool_scores_pallas(qi: jax.Array, w: jax.Array, pool_keys: jax.Array,
                       n_cand: jax.Array | None, *, seqs=None, pools=None, positions=None,
                       interpret: bool = False, tuning: PoolScoresTuning = PoolScoresTuning(),
                       **overrides) -> jax.Array:
    """`pool_scores_xla` as a Pallas kernel; same arguments, same result within fp32 rounding
    (tests/test_kernels.py). qi [B, R, Hi, Di] -> [B, R, P] f32 ([count, R, P] with
    `seqs=(first, count)`: programs for those sequences only, each row's bits those of the
    whole batch's kernel; the Triton kernel reads the keys in place, the Mosaic one gets the
    range's keys sliced). `pools=(base, P)`: the keys `pool_keys[:, base:base + P]`, read in
    place by both kernels (the Mosaic one slices where P or Di needs padding). `positions`:
    as `pool_scores_xla`'s; the Mosaic kernel computes the counts itself (no pass before it).

    Hi and Di are padded to powers of two >= 16 (the smallest dot tile) with zeros, which add
    nothing: padded heads carry weight 0, padded dims multiply zero keys. R is padded to a
    multiple of `default_rows_per_program` with rows that have no candidate. `overrides`:
    fields of `tuning` by name (`backend="triton"`).
    """
    first, b = seq_range(qi.shape[0], seqs)
    base, p = pool_range(pool_keys.shape[1], pools)
    _, r, hi, di = qi.shape
    tuning = with_overrides(tuning, overrides)
    mosaic = pick_backend(tuning, hi, di, interpret, pool_keys.dtype) == "mosaic"
    if mosaic and seqs is None and positions is not None:
        row_counts(n_cand, positions)  # the arguments' check
        return mgpu_scores.pool_scores_mgpu(qi, w, pool_keys, None,
                                            pools=None if pools is None else (base, p),
                                            positions=positions)
    n_cand = row_counts(n_cand, positions)
    if seqs is not None:  # the rank's rows: small slices, fused with the padding below
        qi, w, n_cand = (lax.dynamic_slice_in_dim(a, first, b, 0) for a in (qi, w, n_cand))
    if mosaic:
        if seqs is not None:
            # The Mosaic kernel has no first-sequence operand yet: the range's keys are
            # sliced (a copy); a row's scores do not depend on its batch (GPU tests), so the
            # bits are those of the whole batch.
            pool_keys = lax.dynamic_slice_in_dim(pool_keys, first, b, 0)
        return mgpu_scores.pool_scores_mgpu(qi, w, pool_keys, n_cand,
                                            pools=None if pools is None else (base, p))
    bounded_loop = prompt_shaped(r)
    rb = default_rows_per_program(r)
    rp = pl.cdiv(r, rb) * rb  # rows per sequence, padded
    hp, dp = max(16, next_pow2(hi)), max(16, next_pow2(di))
    block_p = min(BLOCK_P, max(16, next_pow2(p)))
    tiles_all = pl.cdiv(p, block_p)
    groups = b * rp // rb
    chunks, tiles = chunk_split(groups, tiles_all, bounded_loop)
    qi_p = jnp.pad(qi.astype(jnp.float32), ((0, 0), (0, rp - r), (0, hp - hi), (0, dp - di)))
    w_p = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, rp - r), (0, hp - hi)))
    ncand_p = jnp.pad(n_cand.astype(jnp.int32), ((0, 0), (0, rp - r)))  # pad rows: none
    precision = lax.Precision.HIGHEST if interpret else _PRECISION
    kernel = functools.partial(_scores_kernel, group_rows=rb, groups_per_seq=rp // rb,
                               num_pools=p, width=di, block_p=block_p, tiles=tiles,
                               precision=precision, bounded_loop=bounded_loop)
    out = pl.pallas_call(
        kernel,
        grid=(groups, chunks),
        in_specs=[
            pl.BlockSpec(),  # first sequence, first pool [2]
            pl.BlockSpec(),  # n_cand [Np]
            pl.BlockSpec((None, rb * hp, dp), lambda g, t: (g, 0, 0)),  # qi [G, RB*Hp, Dp]
            pl.BlockSpec((None, rb * hp), lambda g, t: (g, 0)),  # w [G, RB*Hp]
            pl.BlockSpec(),  # keys [B, Pk, Di]
        ],
        out_specs=pl.BlockSpec(),  # [Np, P], stored with a mask
        out_shape=jax.ShapeDtypeStruct((b * rp, p), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="pool_scores",
    )(jnp.stack([first, base]), ncand_p.reshape(b * rp), qi_p.reshape(groups, rb * hp, dp),
      w_p.reshape(groups, rb * hp), pool_keys)
    return out.reshape(b, rp, p)[:, :r]
