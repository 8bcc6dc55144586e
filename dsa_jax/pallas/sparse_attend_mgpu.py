"""Sparse MLA gather-attend as a Pallas Mosaic GPU kernel (Hopper: wgmma, bulk copies).

The same function as `sparse_attend.sparse_attend_xla` (the definition), for an fp8 e4m3 cache
and f16 dot operands (q scaled per head group by a power of two, `mgpu_plan.head_scales`), in
FlashMLA's division of the work (`_kernel`): one CTA owns 64 heads of one query row (the wgmma
M) and a contiguous share ("split") of the row's slots, streamed in tiles of 64 slots;

* warpgroup 0 computes the logits over all C, the online softmax, and P @ V of the first half
  of the latent columns;
* warpgroup 1 gathers the next tile's rows by index into registers (`mgpu_gather`), converts
  them e4m3 -> f16 into the other of two f16 tiles, and runs P @ V of the second half with
  warpgroup 0's P, so the gather and the conversion run beside the dots. FlashMLA's split was
  faster on the H200 than a producer warpgroup staging fp8 rows for two consumers that each
  own half of C and exchange partial logits (that design is restorable from the tag
  lab-2026-12). The latent tile is both K and V (MLA).
* the per-split partials (normalized output, running max, denominator) are merged by the
  caller with the Pallas merge kernel (`pallas/merge_splits.py`: one summation order in every
  program); one split's partial is the result, which the kernel then writes in the caller's
  dtype itself (rounded once, as the merge would round it), so no merge pass reads it back.

Restrictions (the dispatcher in `sparse_attend.py` picks the Triton kernel otherwise): fp8
e4m3 cache, C a multiple of 128 with C / 2 <= 256 (a TMA box), heads padded to a multiple of
64. jax's experimental GPU interpret mode (0.10.2) cannot run this kernel (no plgpu.load or
run_state there), so tests/test_attend_kernel.py models its arithmetic on the CPU and its
parity against the twin runs in the GPU tests. Written for Lane lowering semantics, named
explicitly (jax 0.11 defaults to Warpgroup).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dsa_jax.pallas import mgpu_gather
from dsa_jax.pallas.mgpu_plan import BLOCK_W as BLOCK_W
from dsa_jax.pallas.mgpu_plan import HEADS_PER_CTA as HEADS_PER_CTA
from dsa_jax.pallas.mgpu_plan import SCALE_HEADS as SCALE_HEADS
from dsa_jax.pallas.mgpu_plan import SMEM_LIMIT
from dsa_jax.pallas.mgpu_plan import MgpuTuning as MgpuTuning
from dsa_jax.pallas.mgpu_plan import head_scales as head_scales
from dsa_jax.pallas.mgpu_plan import num_splits as num_splits
from dsa_jax.pallas.mgpu_plan import row_scales as row_scales
from dsa_jax.pallas.mgpu_plan import smem_bytes as smem_bytes
from dsa_jax.pallas.mgpu_plan import supports as supports

_M_INIT = -1e30  # running max before any slot: finite, so an all-empty tile rescales by 1
_LOG2E = math.log2(math.e)


def _kernel(kv_ref, qscale_ref, rscale_ref, live_ref, q_ref, slots_ref, lat_ref, o_ref, m_ref,
            l_ref, *, softmax_scale: float, c: int, block_w: int, tiles: int, unscaled: bool):
    """One (head block, split, row) CTA of two warpgroups:

    * warpgroup 0 computes the logits over all C (both Q halves against both tile halves,
      one fp32 accumulator), each logit row scaled by its head's 2^-k, the online softmax,
      writes P (f16) and the row statistics to shared memory for warpgroup 1, and accumulates
      P @ tile[:, :C/2];
    * warpgroup 1 gathers whole tiles one ahead into registers (`mgpu_gather`; an empty slot
      loads nothing and yields zeros), converts them e4m3 -> f16 into the other of two f16
      tiles, and accumulates P @ tile[:, C/2:] with warpgroup 0's P and rescale;
    * the split's slot indices are bulk-copied to shared memory once, so neither the gather
      nor the logit mask waits on a global load per tile;
    * unscaled (more than one split): the partial is written in the cache's units (not
      multiplied by kv_ref[0]: the merge scales), so it fits f16 whatever the scale, through
      shared memory (each warpgroup's Q half) by TMA: half the bytes written and read back.

    kv_ref [1] f32 (the cache's scale: logits scale by it times softmax_scale, the output by
    it); qscale_ref, rscale_ref [N, Hp] f32 (each head's q scale 2^k and 2^-k); live_ref [N]
    int32; q_ref [N, Hp, C] f16 (already scaled); slots_ref [N, Wp] int32 flat cache slots
    (-1 empty); lat_ref [NS, C] fp8. Outputs o_ref [N, S, Hp, C] (normalized partial), m_ref,
    l_ref [N, S, Hp] f32. No producer warpgroup and no fp8 staging: Q (64 KiB), two f16 tiles
    (128 KiB), P and the slots fit in shared memory."""
    half = c // 2
    ahead = 1  # tiles the converting warpgroup holds in registers
    hb, split, row = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("r")
    live = live_ref[row]
    n_tiles = jnp.clip((live + block_w - 1) // block_w - split * tiles, 0, tiles)
    base0 = split * tiles * block_w
    heads = pl.ds(hb * HEADS_PER_CTA, HEADS_PER_CTA)
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # f16 wgmma tiles
    gather = mgpu_gather.make_gather(block_w, c)
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # [64] one value per head

    def load(ref, layout):
        return plgpu.load(ref, (), layout=layout, optimized=False)

    def finish(acc, l, cols_ds, q_half):  # [64, half] normalized into this split's partial
        inv = (1.0 if unscaled else kv_ref[0]) / jnp.where(l > 0, l, 1.0)
        y = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_ref.dtype)
        if not unscaled:
            o_ref.at[row, split, heads, cols_ds][...] = y
            return
        # f16 rows stored from registers write 16 of a 32-byte sector per row and instruction:
        # staged in this warpgroup's Q half (no longer read: its last QK has completed) and
        # written by TMA in whole lines instead.
        q_half[...] = y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_half, o_ref.at[row, split, heads, cols_ds])
        plgpu.wait_smem_to_gmem(0)

    def scoped(q16, kv16, p16s, stats, slot_s, q_bar, slot_bar, full, free, p_full, p_free):
        # q16 [2, 64, half] f16; kv16 [2 buffers, 2 halves, BW, half] f16; p16s [64, BW] f16;
        # stats [2, 64] f32 (the tile's rescale alpha, the running denominator l); slot_s
        # [tiles * BW] i32.
        wg = lax.axis_index("wg")

        def tile_slots(t, first, count):  # slots of tile t's rows [first, first + count)
            start = t * block_w + first
            return slot_s.at[pl.ds(start, count)]

        @pl.when(wg == 0)
        def _softmax_group():
            plgpu.copy_gmem_to_smem(slots_ref.at[row, pl.ds(base0, tiles * block_w)],
                                    slot_s, slot_bar,
                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            for hh in range(2):
                plgpu.copy_gmem_to_smem(q_ref.at[row, heads, pl.ds(hh * half, half)],
                                        q16.at[hh], q_bar.at[hh])
            for hh in range(2):
                plgpu.barrier_wait(q_bar.at[hh])
            plgpu.barrier_wait(slot_bar)
            rs = load(rscale_ref.at[row, heads], row_layout)  # [64]: each head's
            logit_scale = kv_ref[0] * softmax_scale * rs * _LOG2E  # log2 units: exp2

            def softmax(t, valid, m, l, logits):  # -> m, l, alpha, p16; P and stats published
                logits = jnp.where(lax.broadcast_in_dim(valid, logits.shape, [1]),
                                   logits * lax.broadcast_in_dim(logit_scale, logits.shape, [0]),
                                   -jnp.inf)  # [64, BW]
                m_new = jnp.maximum(m, logits.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(jnp.float16)

                @pl.when(t > 0)
                def _():
                    plgpu.barrier_wait(p_free)  # warpgroup 1 has read the last P, alpha

                p16s[...] = p16
                stats.at[0][...] = alpha
                stats.at[1][...] = l
                plgpu.commit_smem()  # P visible to warpgroup 1's wgmma
                plgpu.barrier_arrive(p_full)
                return m_new, l, alpha, p16

            def tile(t, carry):
                m, l, acc = carry  # [64], [64], [64, half]
                s = lax.rem(t, 2)
                valid = load(tile_slots(t, 0, block_w), plgpu.Layout.WGMMA.reduce(0)) >= 0
                plgpu.barrier_wait(full.at[s])

                def qk(acc_ref):
                    for hh in range(2):
                        plgpu.wgmma(acc_ref, q16.at[hh],
                                    plgpu.transpose_ref(kv16.at[s, hh], (1, 0)))
                    return acc_ref[...]

                logits = pl.run_scoped(qk, plgpu.ACC((HEADS_PER_CTA, block_w), jnp.float32))
                m_new, l, alpha, p16 = softmax(t, valid, m, l, logits)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, kv16.at[s, 0])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # waits for the wgmma
                plgpu.barrier_arrive(free.at[s])
                return m_new, l, acc

            m0 = plgpu.layout_cast(jnp.full((HEADS_PER_CTA,), _M_INIT, jnp.float32), row_layout)
            l0 = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA,), jnp.float32), row_layout)
            a0 = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, half), jnp.float32),
                                   plgpu.Layout.WGMMA)
            m, l, acc = lax.fori_loop(0, n_tiles, tile, (m0, l0, a0))
            finish(acc, l, pl.ds(0, half), q16.at[0])
            m_ref.at[row, split, heads][...] = m * (1.0 / _LOG2E)
            l_ref.at[row, split, heads][...] = l

        @pl.when(wg == 1)
        def _convert_group():
            store = mgpu_gather.make_store(block_w, c, swz)
            plgpu.barrier_wait(slot_bar)

            def gather_tile(t):  # t clamped into this split's tiles: always in bounds
                t = jnp.clip(t, 0, tiles - 1)
                return gather(tile_slots(t, 0, block_w), lat_ref)

            def put(rows, t):  # tile t's rows into buffer t % 2, once tile t - 2 left it
                s = lax.rem(t, 2)

                @pl.when(t >= 2)
                def _():
                    plgpu.barrier_wait(free.at[s])

                store(rows, kv16.at[s])
                plgpu.commit_smem()  # the f16 rows visible to the wgmma
                plgpu.barrier_arrive(full.at[s])

            pl.when(n_tiles > 0)(lambda: put(gather_tile(0), 0))

            def tile(t, carry):
                held, l, acc = carry  # tile t + 1's rows; [64]; [64, half]

                @pl.when(t + 1 < n_tiles)
                def _():
                    put(held, t + 1)

                held = gather_tile(t + 1 + ahead)  # loads fly meanwhile
                plgpu.barrier_wait(p_full)
                alpha = load(stats.at[0], row_layout)
                l = load(stats.at[1], row_layout)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16s, kv16.at[lax.rem(t, 2), 1, :, pl.ds(0, half)])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # waits for the wgmma
                plgpu.barrier_arrive(p_free)
                plgpu.barrier_arrive(free.at[lax.rem(t, 2)])
                return held, l, acc

            l0 = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA,), jnp.float32), row_layout)
            a0 = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, half), jnp.float32),
                                   plgpu.Layout.WGMMA)
            _, l, acc = lax.fori_loop(0, n_tiles, tile, (gather_tile(1), l0, a0))
            finish(acc, l, pl.ds(half, half), q16.at[1])

    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, HEADS_PER_CTA, half), jnp.float16, transforms=swz),  # Q halves
        plgpu.SMEM((2, 2, block_w, half), jnp.float16, transforms=swz),  # f16 tiles
        plgpu.SMEM((HEADS_PER_CTA, block_w), jnp.float16, transforms=swz),  # P
        plgpu.SMEM((2, HEADS_PER_CTA), jnp.float32),  # alpha, l
        plgpu.SMEM((tiles * block_w,), jnp.int32),  # the split's slots
        plgpu.Barrier(num_barriers=2),  # Q halves loaded
        plgpu.Barrier(),  # slots staged
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # f16 tile written
        plgpu.Barrier(num_arrivals=2, num_barriers=2),  # f16 tile read by both
        plgpu.Barrier(num_arrivals=1),  # P and stats written (warpgroup 0)
        plgpu.Barrier(num_arrivals=1),  # P and stats read (warpgroup 1)
        collective_axes="wg",
    )


def sparse_attend_mgpu_partials(kv_scale, q_scales, live, q, slots, latent_flat, *,
                                softmax_scale: float, splits: int, tiles: int,
                                out_dtype=jnp.float32):
    """The kernel call: q [N, Hp, C] f16 already scaled (Hp a multiple of 64); q_scales:
    (2^k, 2^-k) [N, Hp] each (`head_scales`); slots [N, Wp] int32 flat cache slots with
    Wp = splits * tiles * BLOCK_W; latent_flat [NS, C] fp8; kv_scale [] or [1] f32 (the
    cache's scale: the logits are scaled by it times softmax_scale, the output by it; read in
    the kernel, no XLA op of its own); live [N] (`live_extent`). out_dtype: o's with one split
    (float32, or the attend's result dtype: the kernel then rounds its normalized rows once,
    as the merge would) -> (o [N, S, Hp, C], m [N, S, Hp] f32, l [N, S, Hp] f32). With
    splits > 1, o is f16 in the cache's units, not scaled by kv_scale (the merge scales it:
    |o| <= 448, the largest e4m3 value, in f16's range whatever the cache's scale)."""
    n, hp, c = q.shape
    if q.dtype != jnp.float16:
        raise ValueError(f"sparse_attend_mgpu: q is {q.dtype}, want float16")
    if any(s.shape != (n, hp) for s in q_scales):
        raise ValueError(f"sparse_attend_mgpu: q scales {[s.shape for s in q_scales]}, want "
                         f"{(n, hp)} each (one per head)")
    why = supports(latent_flat.dtype, c)
    if why is not None:
        raise ValueError(f"sparse_attend_mgpu: unsupported {why}")
    if hp % HEADS_PER_CTA:
        raise ValueError(f"sparse_attend_mgpu: heads {hp} not a multiple of {HEADS_PER_CTA}")
    if slots.shape != (n, splits * tiles * BLOCK_W):
        raise ValueError(f"sparse_attend_mgpu: slots {slots.shape} != "
                         f"({n}, {splits * tiles * BLOCK_W})")
    kv = jnp.asarray(kv_scale, jnp.float32).reshape(1)  # read in the kernel: no XLA op
    part = jax.ShapeDtypeStruct((n, splits, hp), jnp.float32)
    if splits > 1 and jnp.dtype(out_dtype) != jnp.float32:
        raise ValueError(f"sparse_attend_mgpu: out_dtype={jnp.dtype(out_dtype).name} with "
                         f"{splits} splits: partials to be merged stay float32")
    unscaled = splits > 1
    o_dtype = jnp.float16 if unscaled else out_dtype
    out_type = (jax.ShapeDtypeStruct((n, splits, hp, c), o_dtype), part, part)
    params = plgpu.CompilerParams(  # Lane semantics named: jax 0.11 defaults to Warpgroup
        approx_math=True, unsafe_no_auto_barriers=True, reduction_scratch_bytes=0,
        lowering_semantics=plgpu.LoweringSemantics.Lane)
    need = smem_bytes(c) + tiles * BLOCK_W * 4
    if need > SMEM_LIMIT:
        raise ValueError(f"sparse_attend_mgpu: {tiles} tiles per split stage "
                         f"{tiles * BLOCK_W * 4} B of slots: {need} B of shared memory > "
                         f"{SMEM_LIMIT}; use more splits")
    kernel = functools.partial(_kernel, softmax_scale=softmax_scale, c=c, block_w=BLOCK_W,
                               tiles=tiles, unscaled=unscaled)
    return plgpu.kernel(
        kernel, out_type=out_type, grid=(hp // HEADS_PER_CTA, splits, n),
        grid_names=("h", "s", "r"), num_threads=2, thread_name="wg", compiler_params=params,
    )(kv, *q_scales, live, q, slots, latent_flat)
