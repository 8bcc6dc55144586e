"""Sparse MLA gather-attend as a Pallas Mosaic GPU kernel (Hopper: wgmma, bulk copies).

The same function as `sparse_attend.sparse_attend_xla` (the definition), for an fp8 e4m3 cache
and f16 dot operands (`scale_rows_f16`), in the FlashMLA shape, in two designs
(`MgpuTuning.design`): "flashmla" (`_flashmla_kernel`, the library's default through
`AttendTuning`: one warpgroup runs the logits and the softmax, the other gathers and converts
the next tile; see its docstring) and "exchange" (`_kernel`, below):

* one CTA owns 64 heads of one query row (the wgmma M) and a contiguous share ("split") of
  the row's slots, streamed in tiles of `block_w` slots;
* warpgroup 2 (producer) gathers each tile's latent rows by index, one bulk copy of C bytes per
  row into an fp8 staging buffer (`stages` deep), each of its 4 warps issuing a quarter of the
  rows after reading their slot indices in one go; an empty slot (-1) copies a row of zeros,
  so no cache row outside the selection is ever read;
* warpgroups 0 and 1 (consumers) each own half of the C = 512 latent columns: each converts its
  half of the staged tile to f16 (swizzled, for wgmma), computes the partial logits over its
  half (Q half [64, C/2] x tile half^T), the two partials are summed through shared memory
  (fp32 addition is commutative, so both warpgroups hold bitwise the same logits and the same
  softmax), and each accumulates P @ tile half into its own [64, C/2] fp32 accumulator.
  The latent tile is both K and V (MLA), so neither warpgroup touches the other half.
* the per-split partials (normalized output, running max, denominator) are merged by the
  caller with the Pallas merge kernel (`pallas/merge_splits.py`: one summation order in every
  program; the Triton kernel's are merged in jnp).

Restrictions (the dispatcher in `sparse_attend.py` picks the Triton kernel otherwise): fp8
e4m3 cache, C a multiple of 128 with C / 2 <= 256 (a TMA box), heads padded to a multiple of
64. jax's experimental GPU interpret mode (0.10.2) cannot run this kernel (no plgpu.load or
run_state there), so tests/test_attend_kernel.py models its arithmetic on the CPU and its
parity against the twin runs on the GPU (benchmarks/h200_attend.py, results committed).
Written for Lane lowering semantics, named explicitly (jax 0.11 defaults to Warpgroup).
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
from dsa_jax.pallas.common import sm_count
from dsa_jax.pallas.mgpu_plan import HEADS_PER_CTA as HEADS_PER_CTA
from dsa_jax.pallas.mgpu_plan import SMEM_LIMIT
from dsa_jax.pallas.mgpu_plan import MgpuTuning as MgpuTuning
from dsa_jax.pallas.mgpu_plan import head_scales as head_scales
from dsa_jax.pallas.mgpu_plan import num_splits as num_splits
from dsa_jax.pallas.mgpu_plan import row_scales as row_scales
from dsa_jax.pallas.mgpu_plan import scale_rows_f16 as scale_rows_f16
from dsa_jax.pallas.mgpu_plan import smem_bytes as smem_bytes
from dsa_jax.pallas.mgpu_plan import supports as supports

_DEFAULT = MgpuTuning()
_M_INIT = -1e30  # running max before any slot: finite, so an all-empty tile rescales by 1
_LOG2E = math.log2(math.e)


def _kernel(kv_ref, qscale_ref, rscale_ref, live_ref, q_ref, slots_ref, lat_ref, zero_ref,
            o_ref, m_ref, l_ref, *, softmax_scale: float, c: int, block_w: int, tiles: int,
            stages: int, row_pad: int,
            index_group: int, issue_warps: bool, q_in_kernel: bool, consumer_regs: int,
            producer_regs: int, programs: int, head_blocks: int, splits: int,
            rows: int, convert: str, gather_ahead: bool, full_logits: bool, pingpong: bool):
    """One (head block, split, row) CTA of 3 warpgroups; see the module docstring. With
    programs > 0 (persistent), CTA p handles the items p, p + programs, ... of the
    (row, split, head block) list (head block fastest), its barriers' stages and phases
    running on across items, so the producer gathers the next item's first tiles while the
    consumers finish the last one.

    kv_ref [1] f32 (the cache's scale: logits scale by it times softmax_scale, the output by
    it); qscale_ref, rscale_ref [N] f32 (each row's
    q scale 2^k and 2^-k); live_ref [N] int32; q_ref [N, Hp, C] f16 (already scaled), or f32
    when q_in_kernel;
    slots_ref [N, Wp] int32 flat cache slots (-1 empty); lat_ref [NS, C] fp8; zero_ref [1, C]
    fp8 zeros. Outputs o_ref [N, S, Hp, C] f32 (normalized partial), m_ref, l_ref [N, S, Hp].
    """
    half = c // 2

    def item(i):  # -> (head block, split, row, its tiles, its first slot)
        if programs:
            hb, rest = lax.rem(i, head_blocks), i // head_blocks
            split, row = lax.rem(rest, splits), rest // splits
        else:
            hb, split, row = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("r")
        live = live_ref[row]
        n_tiles = jnp.clip((live + block_w - 1) // block_w - split * tiles, 0, tiles)
        return hb, split, row, n_tiles, split * tiles * block_w

    def each_item(body):  # body(item, g) -> g: g counts the tiles of earlier items
        if not programs:
            body(item(None), 0)
            return
        pid = lax.axis_index("p")
        trips = (head_blocks * splits * rows - pid + programs - 1) // programs
        lax.fori_loop(0, trips, lambda i, g: body(item(pid + i * programs), g), jnp.int32(0))

    def step(g, t):  # the global tile index (a plain t without items, as before)
        return t if isinstance(g, int) and g == 0 else g + t
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # f16 wgmma tiles
    # fp32 partial logits, swizzled: the exchange's stores and loads are free of bank conflicts.
    swz32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

    # The conversion reads each 64-column chunk of the staged rows in the layout of a swizzled
    # 16-bit tile copy (8 contiguous elements per thread), so the f16 store is a plain tile copy.
    conv_layout = plgpu.Layout.SMEM_GMEM_COPY((block_w, 64), jnp.float16, 128)

    def load(ref, layout):  # ref (GMEM, or SMEM read in a layout with no planned transfer)
        return plgpu.load(ref, (), layout=layout, optimized=False)

    by_producer = convert == "producer"

    def scoped(q16, st8, kv16, xs, q_bar, full, free, x_full, x_free, sched=None):
        # by_producer: st8 is None and kv16 holds `stages` f16 tiles [stages, 2, BW, half];
        # full_logits: xs, x_full and x_free are None; pingpong: sched the schedule barrier.
        wg = lax.axis_index("wg")

        def rendezvous():  # pingpong: the consumers meet, alternating their phases
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        def consume(it, g):
            hb, split, row, n_tiles, base0 = it
            heads = pl.ds(hb * HEADS_PER_CTA, HEADS_PER_CTA)
            cols = pl.ds(wg * half, half)
            if q_in_kernel:  # fp32 rows -> scaled f16 tile, 64 columns at a time
                up = qscale_ref[row]
                for j in range(half // 64):
                    x = load(q_ref.at[row, heads, pl.ds(wg * half + j * 64, 64)],
                             plgpu.Layout.WGMMA)  # [64, 64] f32
                    q16.at[wg, :, pl.ds(j * 64, 64)][...] = (x * up).astype(jnp.float16)
            else:
                plgpu.copy_gmem_to_smem(q_ref.at[row, heads, cols], q16.at[wg], q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])
                if full_logits:  # our QK reads the other group's Q half too
                    plgpu.barrier_wait(q_bar.at[1 - wg])
            logit_scale = kv_ref[0] * softmax_scale * rscale_ref[row] * _LOG2E  # log2: exp2
            out_scale = kv_ref[0]

            def tile(t, carry):
                m, l, acc = carry  # [64] WGMMA_ROW, [64], [64, half] WGMMA
                s = lax.rem(step(g, t), stages)
                plgpu.barrier_wait(full.at[s])
                kv = kv16.at[s, wg] if by_producer else kv16.at[wg]  # [BW, half] f16
                if not by_producer:
                    plgpu.commit_smem()  # every warp's P @ V of tile t - 1 read kv16: rewrite
                    for j in range(half // 64):
                        x = load(st8.at[s, :, pl.ds(wg * half + j * 64, 64)], conv_layout)
                        kv16.at[wg, :, pl.ds(j * 64, 64)][...] = x.astype(jnp.float16)
                base = base0 + t * block_w
                valid = load(slots_ref.at[row, pl.ds(base, block_w)],
                             plgpu.Layout.WGMMA.reduce(0)) >= 0  # [BW] per slot
                if not by_producer:
                    plgpu.barrier_arrive(free.at[s])  # staging read: the producer may refill
                    plgpu.commit_smem()  # f16 tile visible to wgmma

                def qk(acc_ref):
                    if full_logits:  # all C: both halves, in the same order in both groups
                        for hh in range(2):
                            plgpu.wgmma(acc_ref, q16.at[hh],
                                        plgpu.transpose_ref(kv16.at[s, hh], (1, 0)))
                        if pingpong:
                            rendezvous()  # our QK issued: the other group may run softmax
                    else:
                        plgpu.wgmma(acc_ref, q16.at[wg], plgpu.transpose_ref(kv, (1, 0)))
                    return acc_ref[...]

                part = pl.run_scoped(qk, plgpu.ACC((HEADS_PER_CTA, block_w), jnp.float32))
                if full_logits:
                    logits = part * logit_scale  # [64, BW], same in both groups
                else:
                    @pl.when(step(g, t) > 0)
                    def _():
                        plgpu.barrier_wait(x_free)  # the other group read our last partial

                    xs[wg] = part
                    plgpu.barrier_arrive(x_full)
                    plgpu.barrier_wait(x_full)
                    other = plgpu.layout_cast(xs[1 - wg], plgpu.Layout.WGMMA)
                    logits = (part + other) * logit_scale  # [64, BW], same in both groups
                    plgpu.barrier_arrive(x_free)
                logits = jnp.where(lax.broadcast_in_dim(valid, logits.shape, [1]), logits,
                                   -jnp.inf)
                m_new = jnp.maximum(m, logits.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(jnp.float16)
                if pingpong:
                    rendezvous()  # our softmax done; wait for the tensor cores' turn

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, kv)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # waits for the wgmma
                if by_producer:
                    plgpu.barrier_arrive(free.at[s])  # f16 tile read: the producer may refill
                return m_new, l, acc

            m0 = plgpu.layout_cast(jnp.full((HEADS_PER_CTA,), _M_INIT, jnp.float32),
                                   plgpu.Layout.WGMMA.reduce(1))
            l0 = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA,), jnp.float32),
                                   plgpu.Layout.WGMMA.reduce(1))
            a0 = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, half), jnp.float32),
                                   plgpu.Layout.WGMMA)
            m, l, acc = lax.fori_loop(0, n_tiles, tile, (m0, l0, a0))
            inv = out_scale / jnp.where(l > 0, l, 1.0)
            o_ref.at[row, split, heads, cols][...] = (acc * lax.broadcast_in_dim(
                inv, acc.shape, [0])).astype(o_ref.dtype)

            @pl.when(wg == 0)
            def _():
                m_ref.at[row, split, heads][...] = m * (1.0 / _LOG2E)
                l_ref.at[row, split, heads][...] = l

            return step(g, n_tiles)

        def produce(it, g):
            _, _, row, n_tiles, base0 = it
            promise = plgpu.OOBFillMode.PROMISE_IN_BOUNDS

            def copy_row(slot, dst, bar):  # one C-byte row; an empty slot copies zeros
                @pl.when(slot >= 0)
                def _():
                    plgpu.copy_gmem_to_smem(lat_ref.at[pl.ds(slot, 1)], dst, bar,
                                            oob_mode=promise)

                @pl.when(slot < 0)
                def _():
                    plgpu.copy_gmem_to_smem(zero_ref, dst, bar, oob_mode=promise)

            def copy_rows(s, base, first, count):  # tile rows [first, first + count)
                for g0 in range(0, count, index_group):
                    n = min(index_group, count - g0)
                    # The group's indices are all read before its first copy: one memory
                    # latency per group rather than one per row.
                    slots = [slots_ref[row, base + first + g0 + i] for i in range(n)]
                    for i, slot in enumerate(slots):
                        copy_row(slot, st8.at[s, pl.ds(first + g0 + i, 1), pl.ds(0, c)],
                                 full.at[s])

            def gather_tile(t):  # t clamped into this item's tiles: always in bounds
                t = jnp.clip(t, 0, tiles - 1)
                return gather(slots_ref.at[row, pl.ds(base0 + t * block_w, block_w)], lat_ref)

            def fill_f16(t, tile_rows):  # by_producer: gather, wait, convert, store
                s = lax.rem(step(g, t), stages)
                if gather_ahead:  # tile t came in the carry; t + 1's loads fly meanwhile
                    ahead = gather_tile(t + 1)
                else:  # loads in flight across the wait below
                    tile_rows = gather_tile(t)

                @pl.when(step(g, t) >= stages)
                def _():
                    plgpu.barrier_wait(free.at[s])

                store(tile_rows, kv16.at[s])
                plgpu.commit_smem()  # the f16 tile visible to the consumers' wgmma
                plgpu.barrier_arrive(full.at[s])
                return ahead if gather_ahead else ()

            def fill(t, _):
                s = lax.rem(step(g, t), stages)

                @pl.when(step(g, t) >= stages)
                def _():
                    plgpu.barrier_wait(free.at[s])

                base = base0 + t * block_w
                if issue_warps:  # each warp issues a quarter of the rows
                    per = block_w // 4
                    plgpu.warp_map(lambda w: copy_rows(s, base, w * per, per))
                else:
                    copy_rows(s, base, 0, block_w)
                return ()

            if by_producer and gather_ahead:
                lax.fori_loop(0, n_tiles, fill_f16, gather_tile(0))
            else:
                lax.fori_loop(0, n_tiles, fill_f16 if by_producer else fill, ())
            return step(g, n_tiles)

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(consumer_regs, action="increase")
            if pingpong:  # group 1 starts one phase behind, group 0 catches up at the end
                pl.when(wg == 1)(rendezvous)
            each_item(consume)
            if pingpong:
                pl.when(wg == 0)(rendezvous)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(producer_regs, action="decrease")
            each_item(produce)

    if by_producer:
        gather = mgpu_gather.make_gather(block_w, c)
        store = mgpu_gather.make_store(block_w, c, swz)
    q_smem = plgpu.SMEM((2, HEADS_PER_CTA, half), jnp.float16, transforms=swz)  # Q halves
    xs_smem = plgpu.SMEM((2, HEADS_PER_CTA, block_w), jnp.float32, transforms=swz32)  # logits
    exchange = (plgpu.Barrier(num_arrivals=2),  # partial logits written
                plgpu.Barrier(num_arrivals=2))  # partial logits read
    kv_tiles = plgpu.SMEM((stages, 2, block_w, half), jnp.float16, transforms=swz)  # f16
    tile_bars = (plgpu.Barrier(num_barriers=2),  # Q loaded, per consumer
                 plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # tile written (x 128)
                 plgpu.Barrier(num_arrivals=2, num_barriers=stages))  # tile consumed
    if by_producer and full_logits:
        pl.run_scoped(
            lambda q16, kv16, qb, fb, eb, sb: scoped(q16, None, kv16, None, qb, fb, eb,
                                                     None, None, sb),
            q_smem, kv_tiles, *tile_bars,
            plgpu.Barrier(num_arrivals=2),  # schedule barrier (pingpong only)
            collective_axes="wg",
        )
        return
    if by_producer:  # every producer thread arrives after its stores (count x 128)
        pl.run_scoped(
            lambda q16, kv16, xs, *bars: scoped(q16, None, kv16, xs, *bars),
            q_smem, kv_tiles, xs_smem, *tile_bars, *exchange,
            collective_axes="wg",
        )
        return
    pl.run_scoped(
        scoped,
        q_smem,
        plgpu.SMEM((stages, block_w, c + row_pad), jnp.float8_e4m3fn),  # gathered rows
        plgpu.SMEM((2, block_w, half), jnp.float16, transforms=swz),  # f16 tile halves
        xs_smem,
        plgpu.Barrier(num_barriers=2),  # Q loaded, per consumer
        plgpu.Barrier(num_arrivals=block_w, num_barriers=stages),  # stage filled
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # stage consumed
        *exchange,
        collective_axes="wg",
    )


def _flashmla_kernel(kv_ref, qscale_ref, rscale_ref, live_ref, q_ref, slots_ref, lat_ref,
                     o_ref, m_ref, l_ref, *, softmax_scale: float, c: int, block_w: int,
                     tiles: int, converters: int, stage_slots: bool, regs: tuple[int, int],
                     per_head: bool, unscaled: bool):
    """`MgpuTuning(design="flashmla")`: one (head block, split, row) CTA with FlashMLA's
    division of the work, so the conversion runs beside the dots:

    * warpgroup 0 computes the logits over all C (both Q halves against both tile halves,
      one fp32 accumulator), the online softmax, writes P (f16) and the row statistics to
      shared memory for the others, and accumulates P @ tile[:, :C/2];
    * `converters` more warpgroups gather the next tiles' rows by index into registers
      (`mgpu_gather`; an empty slot loads nothing and yields zeros), convert them e4m3 -> f16
      into the other of two f16 tiles, and accumulate P @ tile[:, C/2:] with warpgroup 0's P
      and rescale: with 1, one warpgroup gathers whole tiles one ahead and owns C/2 columns;
      with 2, each gathers half of every tile's rows two tiles ahead and owns C/4 columns (twice
      the rows in flight; `regs`: the setmaxnreg budgets of warpgroup 0 and the others).
    * stage_slots: the split's slot indices are bulk-copied to shared memory once, so neither
      the gather nor the logit mask waits on a global load per tile.
    * per_head (`MgpuTuning.scale_heads`): rscale_ref is [N, Hp], each head's own 2^-k, and
      each logit row is scaled by its head's.
    * unscaled (`MgpuTuning.half_partials` with splits): the partial is written in the cache's
      units (not multiplied by kv_ref[0]: the merge scales), so it fits f16 whatever the scale,
      through shared memory (each warpgroup's Q half) by TMA.

    No producer warpgroup and no fp8 staging: Q (64 KiB), two f16 tiles (128 KiB), P and the
    slots fit in shared memory. Argument shapes as `_kernel` (q f16, already scaled; no zero
    row: an empty slot's row is zeros by the gather)."""
    half = c // 2
    cols = half // converters  # P @ V columns of each converter
    rows_each = block_w // converters  # tile rows each converter gathers
    ahead = converters  # tiles each converter holds in registers
    hb, split, row = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("r")
    live = live_ref[row]
    n_tiles = jnp.clip((live + block_w - 1) // block_w - split * tiles, 0, tiles)
    base0 = split * tiles * block_w
    heads = pl.ds(hb * HEADS_PER_CTA, HEADS_PER_CTA)
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # f16 wgmma tiles
    gather = mgpu_gather.make_gather(rows_each, c, slots_first=True)
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # [64] one value per head

    def load(ref, layout):
        return plgpu.load(ref, (), layout=layout, optimized=False)

    def finish(acc, l, cols_ds, q_half):  # [64, cols] normalized into this split's partial
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
        # [tiles * BW] i32 (stage_slots) or None.
        wg = lax.axis_index("wg")

        def tile_slots(t, first, count):  # slots of tile t's rows [first, first + count)
            start = t * block_w + first
            if stage_slots:
                return slot_s.at[pl.ds(start, count)]
            return slots_ref.at[row, pl.ds(base0 + start, count)]

        def wait_slots():
            if stage_slots:
                plgpu.barrier_wait(slot_bar)

        @pl.when(wg == 0)
        def _softmax_group():
            if converters > 1:
                plgpu.set_max_registers(regs[0], action="increase")
            if stage_slots:
                plgpu.copy_gmem_to_smem(slots_ref.at[row, pl.ds(base0, tiles * block_w)],
                                        slot_s, slot_bar,
                                        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            for hh in range(2):
                plgpu.copy_gmem_to_smem(q_ref.at[row, heads, pl.ds(hh * half, half)],
                                        q16.at[hh], q_bar.at[hh])
            for hh in range(2):
                plgpu.barrier_wait(q_bar.at[hh])
            wait_slots()
            if per_head:  # [64]: each head's
                rs = load(rscale_ref.at[row, heads], row_layout)
                logit_scale = kv_ref[0] * softmax_scale * rs * _LOG2E  # log2 units: exp2
            else:
                logit_scale = kv_ref[0] * softmax_scale * rscale_ref[row] * _LOG2E  # log2: exp2

            def scaled(logits):  # [64, BW] in log2 units
                if per_head:
                    return logits * lax.broadcast_in_dim(logit_scale, logits.shape, [0])
                return logits * logit_scale

            def softmax(t, valid, m, l, logits):  # -> m, l, alpha, p16; P and stats published
                logits = jnp.where(lax.broadcast_in_dim(valid, logits.shape, [1]),
                                   scaled(logits), -jnp.inf)  # [64, BW]
                m_new = jnp.maximum(m, logits.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(jnp.float16)

                @pl.when(t > 0)
                def _():
                    plgpu.barrier_wait(p_free)  # the converters have read the last P, alpha

                p16s[...] = p16
                stats.at[0][...] = alpha
                stats.at[1][...] = l
                plgpu.commit_smem()  # P visible to the converters' wgmma
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

        def convert_group(g):  # g: 0 .. converters - 1
            if converters > 1:
                plgpu.set_max_registers(regs[1], action="decrease")
            first = g * rows_each
            store = mgpu_gather.make_store(rows_each, c, swz, row0=first)
            my_cols = pl.ds(g * cols, cols)
            wait_slots()

            def gather_tile(t):  # t clamped into this split's tiles: always in bounds
                t = jnp.clip(t, 0, tiles - 1)
                return gather(tile_slots(t, first, rows_each), lat_ref)

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
                *held, l, acc = carry  # tiles t + 1 .. t + ahead's rows; [64]; [64, cols]

                @pl.when(t + 1 < n_tiles)
                def _():
                    put(held[0], t + 1)

                held = (*held[1:], gather_tile(t + 1 + ahead))  # loads fly meanwhile
                plgpu.barrier_wait(p_full)
                alpha = load(stats.at[0], row_layout)
                l = load(stats.at[1], row_layout)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16s, kv16.at[lax.rem(t, 2), 1, :, my_cols])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # waits for the wgmma
                plgpu.barrier_arrive(p_free)
                plgpu.barrier_arrive(free.at[lax.rem(t, 2)])
                return (*held, l, acc)

            l0 = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA,), jnp.float32), row_layout)
            a0 = plgpu.layout_cast(jnp.zeros((HEADS_PER_CTA, cols), jnp.float32),
                                   plgpu.Layout.WGMMA)
            init = (*(gather_tile(1 + i) for i in range(ahead)), l0, a0)
            *_, l, acc = lax.fori_loop(0, n_tiles, tile, init)
            finish(acc, l, pl.ds(half + g * cols, cols), q16.at[1])

        for g in range(converters):
            pl.when(wg == 1 + g)(functools.partial(convert_group, g))

    slot_smem = (plgpu.SMEM((tiles * block_w,), jnp.int32) if stage_slots else None)
    run = scoped if stage_slots else (
        lambda q16, kv16, p16s, stats, *bars: scoped(q16, kv16, p16s, stats, None, bars[0],
                                                     None, *bars[1:]))
    pl.run_scoped(
        run,
        plgpu.SMEM((2, HEADS_PER_CTA, half), jnp.float16, transforms=swz),  # Q halves
        plgpu.SMEM((2, 2, block_w, half), jnp.float16, transforms=swz),  # f16 tiles
        plgpu.SMEM((HEADS_PER_CTA, block_w), jnp.float16, transforms=swz),  # P
        plgpu.SMEM((2, HEADS_PER_CTA), jnp.float32),  # alpha, l
        *((slot_smem,) if stage_slots else ()),
        plgpu.Barrier(num_barriers=2),  # Q halves loaded
        *((plgpu.Barrier(),) if stage_slots else ()),  # slots staged
        plgpu.Barrier(num_arrivals=converters, num_barriers=2),  # f16 tile written
        plgpu.Barrier(num_arrivals=1 + converters, num_barriers=2),  # f16 tile read by all
        plgpu.Barrier(num_arrivals=1),  # P and stats written (group 0)
        plgpu.Barrier(num_arrivals=converters),  # P and stats read (the converters)
        collective_axes="wg",
    )


def partials_scaled(tuning: MgpuTuning, splits: int) -> bool:
    """Whether `sparse_attend_mgpu_partials` writes its partials scaled by the cache's scale
    (f32, or the result dtype with one split); else they are f16 in the cache's units and the
    merge scales them (`MgpuTuning.half_partials`)."""
    return not (tuning.half_partials and splits > 1)


def sparse_attend_mgpu_partials(kv_scale, q_scales, live, q, slots, latent_flat, *,
                                softmax_scale: float, splits: int, tiles: int,
                                tuning: MgpuTuning = _DEFAULT, sms: int | None = None,
                                out_dtype=jnp.float32):
    """The kernel call: q [N, Hp, C] (Hp a multiple of 64): f32 if tuning.q_in_kernel, else
    f16 already scaled (`scale_rows_f16`); q_scales: (2^k, 2^-k) [N] each (`row_scales`), or
    [N, Hp] with tuning.scale_heads (`head_scales`);
    slots [N, Wp] int32 flat cache slots with Wp = splits * tiles * block_w; latent_flat
    [NS, C] fp8; kv_scale [] or [1] f32 (the cache's scale: the logits are scaled by it times
    softmax_scale, the output by it; read in the kernel, no XLA op of its own); live [N]
    (`live_extent`). out_dtype: o's (float32, or with one split the attend's result dtype:
    the kernel then rounds its normalized rows once, as the merge would). sms: multiprocessors
    for tuning.persistent (default `common.sm_count()`) ->
    (o [N, S, Hp, C] f32, m [N, S, Hp], l [N, S, Hp]); with splits > 1 and
    tuning.half_partials o is f16 and not scaled by kv_scale (`partials_scaled`)."""
    n, hp, c = q.shape
    want = jnp.float32 if tuning.q_in_kernel else jnp.float16
    if q.dtype != want:
        raise ValueError(f"sparse_attend_mgpu: q is {q.dtype}, want {jnp.dtype(want).name}")
    want_scales = (n, hp) if tuning.scale_heads else (n,)
    if any(s.shape != want_scales for s in q_scales):
        raise ValueError(f"sparse_attend_mgpu: q scales {[s.shape for s in q_scales]}, want "
                         f"{want_scales} each (scale_heads={tuning.scale_heads})")
    why = supports(latent_flat.dtype, c, tuning)
    if why is not None:
        raise ValueError(f"sparse_attend_mgpu: unsupported {why}")
    if hp % HEADS_PER_CTA:
        raise ValueError(f"sparse_attend_mgpu: heads {hp} not a multiple of {HEADS_PER_CTA}")
    if slots.shape != (n, splits * tiles * tuning.block_w):
        raise ValueError(f"sparse_attend_mgpu: slots {slots.shape} != "
                         f"({n}, {splits * tiles * tuning.block_w})")
    kv = jnp.asarray(kv_scale, jnp.float32).reshape(1)  # read in the kernel: no XLA op
    part = jax.ShapeDtypeStruct((n, splits, hp), jnp.float32)
    if splits > 1 and jnp.dtype(out_dtype) != jnp.float32:
        raise ValueError(f"sparse_attend_mgpu: out_dtype={jnp.dtype(out_dtype).name} with "
                         f"{splits} splits: partials to be merged stay float32")
    unscaled = not partials_scaled(tuning, splits)
    o_dtype = jnp.float16 if unscaled else out_dtype
    out_type = (jax.ShapeDtypeStruct((n, splits, hp, c), o_dtype), part, part)
    params = plgpu.CompilerParams(  # Lane semantics named: jax 0.11 defaults to Warpgroup
        approx_math=True, unsafe_no_auto_barriers=True, reduction_scratch_bytes=0,
        lowering_semantics=plgpu.LoweringSemantics.Lane)
    if tuning.design == "flashmla":
        need = smem_bytes(c, tuning) + (tiles * tuning.block_w * 4 if tuning.stage_slots else 0)
        if need > SMEM_LIMIT:
            raise ValueError(f"sparse_attend_mgpu: design='flashmla' with {tiles} tiles per "
                             f"split stages {tiles * tuning.block_w * 4} B of slots: {need} B "
                             f"of shared memory > {SMEM_LIMIT}; use stage_slots=False")
        kernel = functools.partial(
            _flashmla_kernel, softmax_scale=softmax_scale, c=c, block_w=tuning.block_w,
            tiles=tiles, converters=tuning.converters, stage_slots=tuning.stage_slots,
            regs=tuning.flashmla_regs, per_head=bool(tuning.scale_heads), unscaled=unscaled)
        return plgpu.kernel(
            kernel, out_type=out_type, grid=(hp // HEADS_PER_CTA, splits, n),
            grid_names=("h", "s", "r"), num_threads=1 + tuning.converters, thread_name="wg",
            compiler_params=params,
        )(kv, *q_scales, live, q, slots, latent_flat)
    kernel = functools.partial(
        _kernel, softmax_scale=softmax_scale, c=c, block_w=tuning.block_w, tiles=tiles,
        stages=tuning.stages,
        row_pad=tuning.row_pad, index_group=tuning.index_group,
        issue_warps=tuning.issue_warps, q_in_kernel=tuning.q_in_kernel,
        consumer_regs=tuning.consumer_regs, producer_regs=tuning.producer_regs,
        convert=tuning.convert, gather_ahead=tuning.gather_ahead,
        full_logits=tuning.full_logits, pingpong=tuning.pingpong)
    head_blocks = hp // HEADS_PER_CTA
    programs = min(head_blocks * splits * n, sms or sm_count()) if tuning.persistent else 0
    kernel = functools.partial(kernel, programs=programs, head_blocks=head_blocks,
                               splits=splits, rows=n)
    return plgpu.kernel(
        kernel, out_type=out_type,
        grid=(programs,) if programs else (head_blocks, splits, n),
        grid_names=("p",) if programs else ("h", "s", "r"),
        num_threads=3, thread_name="wg", compiler_params=params,
    )(kv, *q_scales, live, q, slots, latent_flat, jnp.zeros((1, c), latent_flat.dtype))
