"""Pooled indexer scores as a Pallas Mosaic GPU kernel (Hopper: bulk copies, wgmma).

The same function as `pool_scores.pool_scores_xla` (the definition): `score[b, r, p] =
sum_h w[b, r, h] * relu(qi[b, r, h] . K[b, p])`, -inf for `p >= n_cand[b, r]`, -0.0 -> 0.0.

* one CTA per (row group, pool chunk); the chunk is `tiles` tiles of `BLOCK_P` pools; a row
  group is `Plan.rows` rows of one sequence, their heads side by side in the wgmma N, so one
  key tile serves them all;
* warpgroup 2 (producer) streams the chunk's live key tiles [BLOCK_P, Dp] (f32, or bf16 as a
  bf16 index cache stores them) by bulk (TMA) copies into a ring of `Plan.stages` buffers;
  tiles past the rows' candidates are never read;
* warpgroups 0 and 1 (consumers) take the tiles in turn;
* for bf16 keys ("bf16x3", the GLM-5.3 default) each consumer feeds its tile straight from
  shared memory to one wgmma against qi's three bf16 parts (`split_bf16`, side by side in N):
  k q1 + (k q2 + k q3), every product exact; the parts are split from the row group's f32 qi
  by the consumers in shared memory (`Plan.split_q`; or in jnp before the call where the
  split's register layout does not fit);
* for fp32 keys ("tf32x3") each consumer splits its tile in registers into tf32 parts, K = hi
  + lo + (dropped, <= 2^-20 |K|), writes lo to its own buffer, and runs the products hi x qhi
  + lo x qhi + hi x qlo as two wgmmas (tf32 operands from shared memory, the pool tile as M
  and the heads as N; qi split the same way by `split_tf32`, in jnp, once per row): the raw
  keys are fed as hi, which Hopper's tensor core reads as their truncated tf32 bits
  (`dots_tf32x3`; the bound is `testing.TF32X3_ROUNDOFF`, as for the Triton kernel's tf32x3
  dot). The epilogue (both precisions) applies relu, the head weights and the head sum in
  registers and stores the tile's [BLOCK_P] scores;
* a pool's score depends only on its key, its row's qi and w and these fixed instructions, not
  on the chunking, the grid or the other rows: a row scores the same bits alone or batched.

Restrictions: Di is padded to a multiple of 32 (one 128-byte swizzle of f32) and Hi to a
multiple of 8 (the wgmma N step); keys whose Di is not a multiple of 32 or whose P is not a
multiple of 8 (the bulk copy's tiling of the pool axis) are copied padded (the GLM shapes,
Di = 128 and P = context / 4 pools of a capacity in whole pages, need none). A partial last
tile reads past P through the bulk copy's bounds check, which fills zeros. Compiled for a
Hopper GPU only: there is no interpret mode (jax's GPU interpret mode cannot run bulk
copies); tests/test_pool_scores_mgpu.py lowers it on the CPU and models its arithmetic; its
parity runs on the GPU. Written for Lane semantics, named explicitly (jax 0.11 defaults to
Warpgroup).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsa_jax.pallas.common import sm_count
from dsa_jax.pallas.pool_scores_mgpu_dots import (
    F32_SWIZZLE,
    TF32_MASK,
    dots_bf16x3,
    dots_tf32x3,
    split_bf16,
    split_bf16_into,
    split_tf32,
)

__all__ = ["Plan", "TF32_MASK", "fit", "pool_scores_mgpu", "split_bf16", "split_tf32",
           "supports"]

# The precision each key dtype runs: "tf32x3" for fp32 keys, "bf16x3" for bf16 keys (a bf16
# index cache), and the parts qi is split into for it.
KEY_PRECISIONS = {"float32": "tf32x3", "bfloat16": "bf16x3"}
_PARTS = {"tf32x3": 2, "bf16x3": 3}
DECODE_ROWS = 4  # rows per sequence of a decode or verify step (max_verify), see default_chunks
BLOCK_P = 64  # pools per tile: the wgmma M
CONSUMERS = 2  # compute warpgroups, taking the tiles in turn, each with its lo buffer
# Per-thread register budgets (setmaxnreg), within the CTA's registers at launch
# (`common.check_register_budgets`).
CONSUMER_REGS = 232
PRODUCER_REGS = 40


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel's schedule for one call, chosen by `fit` from Hi, Di, the rows per sequence
    and the keys' dtype (the library never sets one; tests pass one to compare schedules at
    one shape). None of its fields changes a score's bits: each pool's products and sums are
    the same instructions in any schedule (checked on the GPU).

    precision: "tf32x3" (fp32 keys) or "bf16x3" (bf16 keys): `KEY_PRECISIONS`.
    rows: rows of one sequence per CTA (a power of two), their heads side by side in the
      wgmma N (rows x Hp, or 2 x rows x Hp for tf32x3's hi x [qhi | qlo], at most 256); a
      sequence's rows are padded to a multiple with rows that have no candidate.
    stages: key buffers in the ring, a multiple of `CONSUMERS` (consumer c owns the buffers
      s = c mod CONSUMERS, so each of its barriers is waited on at every phase).
    split_q: bf16x3 only: qi's bf16 parts split in the kernel (the producer loading the row
      group's f32 qi and the consumers writing its parts in shared memory, `split_bf16_into`,
      whose register layout takes 64 rows: a row group of fewer rows x heads is computed as
      more heads there, `kernel_heads`) instead of in jnp, whose three bf16 copies of a
      prompt's qi XLA writes and the kernel reads back. The parts have the same bits either
      way (exact masks, one rounding)."""
    precision: str
    rows: int
    stages: int
    split_q: bool

    def __post_init__(self):
        if self.precision not in _PARTS:
            raise ValueError(f"precision={self.precision!r} must be one of {sorted(_PARTS)}")
        if self.stages < CONSUMERS or self.stages % CONSUMERS:
            raise ValueError(f"stages={self.stages} must be a positive multiple of "
                             f"CONSUMERS={CONSUMERS}")
        if self.rows < 1 or self.rows & (self.rows - 1):
            raise ValueError(f"rows={self.rows} must be a power of two")


def key_precision(key_dtype) -> str:
    """The precision for pool keys of `key_dtype`; raises, naming the supported dtypes, for
    another."""
    name = jnp.dtype(key_dtype).name
    if name not in KEY_PRECISIONS:
        raise ValueError(f"pool_scores_mgpu: pool keys of dtype {name} are not supported "
                         f"(one of {sorted(KEY_PRECISIONS)})")
    return KEY_PRECISIONS[name]


def padded_dims(hi: int, di: int, precision: str = "tf32x3") -> tuple[int, int]:
    """(Hp, Dp): heads to a multiple of 8, dims to a multiple of one 128-byte swizzle of the
    dot's operands (32 f32, 64 bf16)."""
    step = 64 if precision == "bf16x3" else F32_SWIZZLE
    return -(-hi // 8) * 8, -(-di // step) * step


def kernel_heads(hp: int, t: Plan) -> int:
    """The qi rows per score row in shared memory and the wgmma N: Hp (`padded_dims`), and
    with `split_q` more until rows x heads is a multiple of 64, the register layout's rows
    that the split works in (a decode row of 32 heads: 64). The extra rows are never written
    (qi and w stay [.., Hp] in memory: no padded copy) and their product columns are never
    read: each wgmma output column depends on its own B column only, and the epilogue takes
    each row's Hp columns, so every score has the bits of the unpadded kernel."""
    if not t.split_q:
        return hp
    step = max(8, 64 // t.rows)  # rows: a power of two
    return -(-hp // step) * step


def smem_bytes(hp: int, dp: int, t: Plan) -> int:
    """Shared memory the kernel allocates (a Hopper CTA gets at most 227 KiB); hp as
    `padded_dims` gives it (`kernel_heads` applied here)."""
    hp = kernel_heads(hp, t)
    if t.split_q:  # the f32 qi the parts are split from
        return 4 * dp * t.rows * hp + smem_bytes(hp, dp, dataclasses.replace(t, split_q=False))
    if t.precision == "bf16x3":  # bf16 keys, no lo buffers; qi in three bf16 parts
        return 2 * dp * t.stages * BLOCK_P + 2 * dp * 3 * t.rows * hp
    return 4 * dp * (t.stages * BLOCK_P + CONSUMERS * BLOCK_P + 2 * t.rows * hp)


# `fit`'s plans in order of preference (the first that fits): (rows, stages) for a prompt's
# rows (more than DECODE_ROWS per sequence), and for decode and verify rows.
PROMPT_PLANS = ((2, 2), (1, 4), (1, 2))
DECODE_PLANS = ((1, 4), (1, 2))


def fit(hi: int, di: int, r: int, key_dtype=jnp.float32) -> Plan:
    """The plan for Hi, Di, r rows per sequence and keys of `key_dtype`: the first of
    PROMPT_PLANS (r > DECODE_ROWS) or DECODE_PLANS whose wgmma N and shared memory fit, qi
    split in the kernel wherever it can be. Raises (naming the limit) if none fits."""
    precision = key_precision(key_dtype)
    plans = PROMPT_PLANS if r > DECODE_ROWS else DECODE_PLANS
    last = None
    for rows, stages in plans:
        cand = Plan(precision, rows, max(stages, CONSUMERS), split_q=False)
        split = dataclasses.replace(cand, split_q=True)
        cand = dataclasses.replace(cand, split_q=why_not(split, hi, di) is None)
        last = why_not(cand, hi, di)
        if last is None:
            return cand
    raise ValueError(f"pool_scores_mgpu: {last}")


def why_not(t: Plan, hi: int, di: int) -> str | None:
    """None if the kernel runs plan t at Hi, Di; else why not."""
    if t.split_q and t.precision != "bf16x3":
        return (f"split_q=True needs a precision that splits qi into bf16 parts (bf16x3; "
                f"precision {t.precision})")
    hp, dp = padded_dims(hi, di, t.precision)
    hk = kernel_heads(hp, t)
    n_max = _PARTS[t.precision] * t.rows * hk
    if n_max > 256:
        return (f"wgmma N = {n_max} > 256 (Hi {hi} padded to {hk}, rows {t.rows}, precision "
                f"{t.precision}, split_q {t.split_q})")
    if smem_bytes(hp, dp, t) > 227 * 1024:
        return (f"shared memory {smem_bytes(hp, dp, t)} B > 227 KiB (Hi {hi}, Di {di}, "
                f"stages {t.stages}, rows {t.rows})")
    return None


def supports(hi: int, di: int, key_dtype=jnp.float32) -> str | None:
    """None if the kernel runs at Hi, Di and keys of `key_dtype` (at its smallest plan: one
    row per CTA, one buffer per consumer, qi split in jnp); else why not."""
    try:
        precision = key_precision(key_dtype)
    except ValueError as e:
        return str(e)
    return why_not(Plan(precision, rows=1, stages=CONSUMERS, split_q=False), hi, di)


def default_chunks(b: int, r: int, tiles_all: int, sms: int) -> int:
    """CTAs per row: about one CTA per multiprocessor in all (the kernel's shared memory
    allows one per multiprocessor), at least one per row, at most one per tile. Decode and
    verify rows (r <= `DECODE_ROWS`) count per sequence, since most of a padded decode's rows
    have no candidate (their CTAs only store -inf); a prompt's rows count one by one."""
    rows = b if r <= DECODE_ROWS else b * r
    return max(1, min(tiles_all, sms // rows))


def _kernel(*refs, block_p: int, tiles: int, chunks: int, stages: int, consumers: int,
            groups_per_seq: int, rows: int, hp: int, hk: int, dp: int, precision: str,
            split_q: bool, consumer_regs: int, producer_regs: int, items: int, kpool: int,
            real_rows: int):
    """CTAs of consumers + 1 warpgroups; see the module docstring. An item is a (row group,
    chunk) pair; each CTA takes one item (grid index i: chunk fastest, then sequence, then the
    row group within its sequence). Its loops carry (tiles so far, qi loads, row group) from
    (0, 0, -1): the ring's phases and the qi buffer follow from them.

    refs: ncand_ref [N] int32 (N = G * rows), or with kpool pos_ref and valid_ref [B*R] int32
    and bool, each row's count `candidate_pools` of them, computed here (no pass before the
    kernel; rows r >= real_rows = R of a sequence, the padding, have none); then base_ref, ...,
    out_ref. base_ref [1] int32: pool p's key is read at pool
    `base + p` of keys_ref's pool axis; q_ref [G, 2 rows Hp, Dp] f32 (the group's qi split:
    every row's tf32 hi parts, then every row's lo parts; for bf16x3 [G, 3 rows Hp, Dp]
    bf16, the three parts; with split_q the f32 qi [G, rows Hp, Dp], each row's Hp heads
    loaded at row r * hk of shared memory: `kernel_heads`); w_ref [G, rows Hp] f32 (padded
    heads 0); keys_ref [B, Pk, Dp] f32;
    out_ref [N, Pc] f32 with Pc = chunks * tiles * block_p >= P (every element written).
    """
    if kpool:
        pos_ref, valid_ref, base_ref, q_ref, w_ref, keys_ref, out_ref = refs

        def n_cand(i):  # padded row i = seq * Rp + r -> row seq * R + r, none past R
            rp = groups_per_seq * rows
            seq, r = i // rp, lax.rem(i, rp)
            at = seq * real_rows + jnp.minimum(r, real_rows - 1)
            live = (r < real_rows) & valid_ref[at]
            return jnp.where(live, (pos_ref[at] + 1) // kpool, 0)
    else:
        ncand_ref, base_ref, q_ref, w_ref, keys_ref, out_ref = refs

        def n_cand(i):
            return ncand_ref[i]

    nq = rows * hk  # the wgmma N of one of qi's parts (hk > hp: columns never read)
    tf32 = (plgpu.TilingTransform((8, F32_SWIZZLE)), plgpu.SwizzleTransform(128))
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # [block_p]: one value per accumulator row
    q_slots = 1  # qi buffers

    def item():  # -> (row group, first tile, live tiles, the rows' candidate counts)
        # the first row group of every sequence first: in a padded decode the real rows
        # (each sequence's first) start in the first wave
        i = lax.axis_index("i")
        chunk, rest = lax.rem(i, chunks), i // chunks
        seqs = items // (chunks * groups_per_seq)
        group = lax.rem(rest, seqs) * groups_per_seq + rest // seqs
        first = chunk * tiles
        n_cands = [n_cand(group * rows + r) for r in range(rows)]
        most = functools.reduce(jnp.maximum, n_cands)
        live = jnp.clip((most + block_p - 1) // block_p - first, 0, tiles)
        return group, first, live, n_cands

    def each_item(body):  # body(item, carry) -> carry; carry (tiles so far, qi loads, group)
        body(item(), (jnp.int32(0), jnp.int32(0), jnp.int32(-1)))

    def scoped(kbuf, qbuf, q_full, q_free, full, free, lobuf=None, q_f32=None,
               q_split=None):
        wg = lax.axis_index("wg")

        def store(group, first, r, t, scores):  # row r of the group; [block_p] row_layout
            out_ref.at[group * rows + r, pl.ds((first + t) * block_p, block_p)][...] = scores

        def consume(it, carry):
            group, first, live, n_cands = it
            gt, qc, last = carry
            new_q = (live > 0) & (group != last)

            @pl.when(new_q)
            def _():
                slot = lax.rem(qc, q_slots)
                plgpu.barrier_wait(q_full.at[slot])
                if split_q:  # qi's parts from its f32 values, by every consumer's share
                    split_bf16_into(q_f32.at[slot], qbuf.at[slot], wg, consumers=consumers)
                    plgpu.commit_smem()  # the parts visible to wgmma
                    if consumers > 1:  # and the other consumers' parts to this one's
                        plgpu.barrier_arrive(q_split.at[slot])
                        plgpu.barrier_wait(q_split.at[slot])

            qc = qc + new_q.astype(jnp.int32)
            qb = qbuf.at[lax.rem(qc + q_slots - 1, q_slots)]
            lo_ref = lobuf.at[wg] if lobuf is not None else None
            mine = lax.rem(wg - lax.rem(gt, consumers) + consumers, consumers)  # first own t

            @pl.when(live > 0)
            def _():
                ws = [plgpu.load(w_ref.at[group, pl.ds(r * hp, hp)], (),
                                 layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                      for r in range(rows)]  # rows x [Hp]

                def tile(j, c):
                    t = mine + consumers * j
                    s = lax.rem(gt + t, stages)
                    k_ref = kbuf.at[s]
                    plgpu.barrier_wait(full.at[s])
                    if precision == "bf16x3":
                        acc = dots_bf16x3(k_ref, qb, block_p=block_p, nq=nq)
                        plgpu.barrier_arrive(free.at[s])  # wgmma done: refill the buffer
                    else:
                        acc = dots_tf32x3(k_ref, lo_ref, qb, nq=nq, dp=dp)
                        plgpu.barrier_arrive(free.at[s])  # wgmmas done: refill the buffer
                    pools = (first + t) * block_p + plgpu.broadcasted_iota(
                        jnp.int32, (block_p,), 0, layout=row_layout)
                    for r, w in enumerate(ws):
                        a = acc[:, r * hk:r * hk + hp]  # [BP, Hp]: row r's real heads
                        heads = jnp.maximum(a, 0.0) * lax.broadcast_in_dim(w, a.shape, [1])
                        scores = heads.sum(axis=1)  # [BP]
                        scores = jnp.where(scores == 0, 0.0, scores)  # -0.0 -> 0.0
                        store(group, first, r, t, jnp.where(pools < n_cands[r], scores,
                                                            -jnp.inf))
                    return c

                lax.fori_loop(0, jnp.maximum(live - mine + consumers - 1, 0) // consumers,
                              tile, 0)

            def dead(j, c):  # tiles with no candidate: -inf, no key read
                t = live + consumers * j + wg
                for r in range(rows):
                    store(group, first, r, t, plgpu.layout_cast(
                        jnp.full((block_p,), -jnp.inf, jnp.float32), row_layout))
                return c

            lax.fori_loop(0, (tiles - live - wg + consumers - 1) // consumers, dead, 0)
            return gt + live, qc, jnp.where(new_q, group, last)

        def produce(it, carry):
            group, first, live, _ = it
            gt, qc, last = carry
            new_q = (live > 0) & (group != last)

            @pl.when(new_q)
            def _():
                slot = lax.rem(qc, q_slots)
                if hk == hp:
                    plgpu.copy_gmem_to_smem(q_ref.at[group],
                                            (q_f32 if split_q else qbuf).at[slot],
                                            q_full.at[slot])
                else:  # split_q: each row's Hp heads at its hk rows (the rest never read)
                    for r in range(rows):
                        plgpu.copy_gmem_to_smem(q_ref.at[group, pl.ds(r * hp, hp)],
                                                q_f32.at[slot, pl.ds(r * hk, hp)],
                                                q_full.at[slot])

            def fill(t, c):
                s = lax.rem(gt + t, stages)

                @pl.when(gt + t >= stages)
                def _():
                    plgpu.barrier_wait(free.at[s])

                plgpu.copy_gmem_to_smem(
                    keys_ref.at[group // groups_per_seq,
                                pl.ds(base_ref[0] + (first + t) * block_p, block_p)],
                    kbuf.at[s], full.at[s])
                return c

            lax.fori_loop(0, live, fill, 0)
            return gt + live, qc + new_q.astype(jnp.int32), jnp.where(new_q, group, last)

        @pl.when(wg < consumers)
        def _consumer():
            if consumers > 1:  # (two warpgroups in all start with enough registers)
                plgpu.set_max_registers(consumer_regs, action="increase")
            each_item(consume)

        @pl.when(wg == consumers)
        def _producer():
            if consumers > 1:
                plgpu.set_max_registers(producer_regs, action="decrease")
            each_item(produce)

    bf16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    part = (jnp.bfloat16, bf16) if precision == "bf16x3" else (jnp.float32, tf32)
    ring = part  # bf16x3: bf16 keys and qi parts; tf32x3: f32 keys and qi parts
    scratch = [
        plgpu.SMEM((stages, block_p, dp), ring[0], transforms=ring[1]),  # key ring
        plgpu.SMEM((q_slots, _PARTS[precision] * nq, dp), part[0], transforms=part[1]),  # qi
        plgpu.Barrier(num_arrivals=1 if hk == hp else rows, num_barriers=q_slots),  # qi loaded
        # qi no longer read: waited on by no one with one item per CTA; allocated so that the
        # kernel's shared memory (and its compiled code) stays the one checked on the GPU
        plgpu.Barrier(num_arrivals=consumers, num_barriers=q_slots),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # key buffer filled
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # key buffer consumed
    ]
    extra = {}
    if precision == "tf32x3":  # lo parts of the keys, per consumer
        extra["lobuf"] = plgpu.SMEM((consumers, block_p, dp), jnp.float32, transforms=tf32)
    if split_q:  # the row group's f32 qi; all consumers' parts written
        extra["q_f32"] = plgpu.SMEM((q_slots, nq, dp), jnp.float32, transforms=tf32)
        extra["q_split"] = plgpu.Barrier(num_arrivals=consumers, num_barriers=q_slots)
    pl.run_scoped(scoped, *scratch, collective_axes="wg", **extra)


def pool_scores_mgpu(qi: jax.Array, w: jax.Array, pool_keys: jax.Array,
                     n_cand: jax.Array | None, *, sms: int | None = None, pools=None,
                     positions: tuple[jax.Array, jax.Array, int] | None = None,
                     plan: Plan | None = None) -> jax.Array:
    """`pool_scores_xla` as a Mosaic GPU kernel; same arguments, the result within the tf32x3
    bound (tests/test_pool_scores_mgpu.py). qi [B, R, Hi, Di] f32, w [B, R, Hi] f32,
    pool_keys [B, P, Di] f32 or bf16 (read as stored; `KEY_PRECISIONS`), n_cand [B, R] int32
    -> [B, R, P] f32. sms: multiprocessors for `default_chunks` (default
    `common.sm_count()`). pools: `(base, P)` with base an int32 scalar (checked by the caller,
    `pool_scores.pool_range`): the keys are pools base .. base + P - 1 of `pool_keys`' pool
    axis, read in place where P and Di need no padding. positions: `(pos [B, R] int32, valid
    [B, R] bool, KP)` in place of n_cand (None): the kernel takes each row's count as
    `row_meta.candidate_pools(pos, valid, KP)` itself, so no pass runs before it (a lone
    selection call's launch). plan: the schedule (None: `fit`'s for these shapes)."""
    b, r, hi, di = qi.shape
    base, p = (jnp.int32(0), pool_keys.shape[1]) if pools is None else pools
    if (n_cand is None) == (positions is None):
        raise ValueError("pool_scores_mgpu: give exactly one of n_cand and positions=(pos, valid, "
                         "kpool) (not both, not neither)")
    if positions is not None and positions[2] < 1:
        raise ValueError(f"pool_scores_mgpu: positions' pool size {positions[2]} must be >= 1")
    rows_shape = (n_cand if positions is None else positions[0]).shape
    if (pool_keys.shape[::2] != (b, di) or w.shape != (b, r, hi) or rows_shape != (b, r)
            or (positions is not None and positions[1].shape != (b, r))):
        raise ValueError(f"pool_scores_mgpu: shapes qi {qi.shape}, w {w.shape}, keys "
                         f"{pool_keys.shape}, n_cand or pos {rows_shape} do not agree")
    t = plan or fit(hi, di, r, pool_keys.dtype)
    if t.precision != key_precision(pool_keys.dtype):
        raise ValueError(f"pool_scores_mgpu: precision={t.precision!r} does not apply to "
                         f"{jnp.dtype(pool_keys.dtype).name} pool keys "
                         f"({key_precision(pool_keys.dtype)!r})")
    if (why := why_not(t, hi, di)) is not None:
        raise ValueError(f"pool_scores_mgpu: {why}")
    hp, dp = padded_dims(hi, di, t.precision)
    rb = t.rows
    rp = -(-r // rb) * rb  # rows per sequence, padded
    groups = b * rp // rb
    n = b * rp
    tiles_all = pl.cdiv(p, BLOCK_P)
    chunks = default_chunks(b, rp // rb, tiles_all, sms or sm_count())
    chunks = min(chunks, tiles_all)
    tiles = pl.cdiv(tiles_all, chunks)
    chunks = pl.cdiv(tiles_all, tiles)  # no chunk without a tile
    width = chunks * tiles * BLOCK_P  # >= P: whole tiles are stored
    q = jnp.pad(qi.astype(jnp.float32), ((0, 0), (0, rp - r), (0, hp - hi), (0, dp - di)))
    q = q.reshape(groups, rb * hp, dp)  # [G, rows Hp, Dp] f32: what the kernel reads if split_q
    if not t.split_q:  # bf16 parts [G, 3 rows Hp, Dp]: q1, q2, q3; or tf32 [G, 2 rows Hp, Dp]
        q = jnp.concatenate((split_bf16 if t.precision == "bf16x3" else split_tf32)(q),
                            axis=1)
    w_p = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, rp - r), (0, hp - hi)))
    w_p = w_p.reshape(groups, rb * hp)  # [G, rows Hp]
    if positions is None:
        row_args = (jnp.pad(n_cand.astype(jnp.int32), ((0, 0), (0, rp - r))).reshape(n),)
    else:  # flattened (free); the kernel pads past R itself
        row_args = (positions[0].astype(jnp.int32).reshape(b * r),
                    positions[1].astype(jnp.bool_).reshape(b * r))
    keys = pool_keys  # [B, Pk, Di] as stored: f32 or bf16 (key_precision checked which)
    p8 = -(-p // 8) * 8  # the bulk copy tiles the pool axis by 8
    if (p8, dp) != (p, di):  # odd P or Di: a padded copy (the GLM shapes need none)
        if keys.shape[1] != p:
            keys = lax.dynamic_slice_in_dim(keys, base, p, 1)
        base = jnp.int32(0)
        keys = jnp.pad(keys, ((0, 0), (0, p8 - p), (0, dp - di)))
    items = groups * chunks
    kernel = functools.partial(
        _kernel, block_p=BLOCK_P, tiles=tiles, stages=t.stages, consumers=CONSUMERS,
        groups_per_seq=rp // rb, rows=rb, hp=hp, hk=kernel_heads(hp, t), dp=dp,
        precision=t.precision, split_q=t.split_q, consumer_regs=CONSUMER_REGS,
        producer_regs=PRODUCER_REGS, chunks=chunks, items=items,
        kpool=0 if positions is None else positions[2], real_rows=r)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((n, width), jnp.float32),
        grid=(items,),  # the x axis (y and z allow 65535)
        grid_names=("i",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=False, unsafe_no_auto_barriers=True, reduction_scratch_bytes=0,
            lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(*row_args, jnp.asarray(base, jnp.int32).reshape(1), q, w_p, keys)
    out = out.reshape(b, rp, width)
    if (rp, width) != (r, p):
        out = out[:, :r, :p]
    return out
