"""The step's per-row integer metadata in one program, and that program in the x projection's
launch.

A decode step's rows need a handful of small integer arrays, all functions of the lengths,
the ring marks, the rows' counts and the block tables: the latent cache slots, the index
write's seven rows, the candidate pools and the positions the expanding top-k reads, and the
lengths and marks after the step. XLA computes them in one launch each (a launch's fixed
cost apiece, for a few integers); here one program computes all of them, and
`meta_matmul_pallas` runs that program beside the x projection's GEMM, whose output none of
them needs (`colaunch`).

`row_meta_xla` is the definition: the functions the consumers use when given no metadata
(`latent_write.flat_slots`, `index_write.row_meta`, `candidate_pools`, `pool_topk.positions`,
`mark_after`). The kernel runs the same jnp code on padded power-of-two tiles (the block-table
entries read by index): the same integers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from dsa_jax.numerics import candidate_pools, mark_after, next_pow2
from dsa_jax.pallas import index_write as iw
from dsa_jax.pallas import latent_write as lw
from dsa_jax.pallas import matmul as mm
from dsa_jax.pallas.colaunch import Part, colaunch
from dsa_jax.pallas.pool_topk import positions

__all__ = ["RowGeometry", "RowMeta", "candidate_pools", "mark_after", "meta_matmul_pallas",
           "meta_matmul_xla", "row_meta_pallas", "row_meta_part", "row_meta_xla"]


@dataclasses.dataclass(frozen=True)
class RowGeometry:
    """The static shape of a step's rows and caches.

    rows: R, rows per sequence; attended: the first rows per sequence that are selected and
    attended (`layer.cut_rows`; <= R); block_size: the latent cache's; kpool: KP;
    ring_rows: Rr per layer; ring_len: the ring's rows per sequence (all layers);
    num_pools: P per layer; keys_len: pool-key rows per sequence (all layers); layer: this
    layer's index among them."""
    rows: int
    attended: int
    block_size: int
    kpool: int
    ring_rows: int
    ring_len: int
    num_pools: int
    keys_len: int
    layer: int = 0

    def __post_init__(self):
        if not 1 <= self.attended <= self.rows:
            raise ValueError(f"RowGeometry: attended={self.attended} must be in [1, "
                             f"rows={self.rows}]")
        if self.ring_rows < self.kpool:
            raise ValueError(f"RowGeometry: ring_rows={self.ring_rows} must hold a pool of "
                             f"kpool={self.kpool}")


class RowMeta(NamedTuple):
    slots: jax.Array  # [B*R] int32: each row's flat latent cache row, -1: none
    index: jax.Array  # [7, B*R] int32: the index write's (`index_write.row_meta`)
    n_cand: jax.Array  # [B, k] int32: the first k rows' candidate pools (`candidate_pools`)
    pv: jax.Array  # [B*k] int32: their positions, -1 where not valid (`pool_topk.positions`)
    lengths: jax.Array  # [B] int32: lengths + n_new
    marks: jax.Array  # [B] int32: the ring marks after the step (`mark_after`)


def _rows(lengths: jax.Array, n_new: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
    """pos, valid `[B, R]` of rows `r [1, R]` appended at `lengths`, `n_new` `[B, 1]`."""
    return lengths + r, r < n_new


def _check(g: RowGeometry, lengths, marks, n_new, block_tables):
    b = lengths.shape[0]
    for name, a in (("lengths", lengths), ("marks", marks), ("n_new", n_new)):
        if a.shape != (b,):
            raise ValueError(f"row_meta: {name} has shape {a.shape}; lengths' is ({b},)")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"row_meta: block_tables has shape {block_tables.shape}; it needs "
                         f"[{b}, blocks]")
    return b


def row_meta_xla(g: RowGeometry, lengths: jax.Array, marks: jax.Array, n_new: jax.Array,
                 block_tables: jax.Array) -> RowMeta:
    """The definition: `lengths`, `marks` (the ring marks), `n_new` `[B]` int32 and
    `block_tables [B, NB]` -> `RowMeta` of the step's `g.rows` rows per sequence at `lengths`
    (the first `n_new` real)."""
    b = _check(g, lengths, marks, n_new, block_tables)
    r = jnp.arange(g.rows, dtype=jnp.int32)[None, :]  # [1, R]
    pos, valid = _rows(lengths.astype(jnp.int32)[:, None], n_new[:, None], r)  # [B, R]
    k = g.attended
    return RowMeta(
        slots=lw.flat_slots(pos, valid, block_tables, g.block_size).reshape(b * g.rows
                                                                            ).astype(jnp.int32),
        index=iw.row_meta(pos, valid, g.layer, kp=g.kpool, rows=g.ring_rows,
                          num_pools=g.num_pools, keys_len=g.keys_len, ring_len=g.ring_len),
        n_cand=candidate_pools(pos[:, :k], valid[:, :k], g.kpool).astype(jnp.int32),
        pv=positions(pos[:, :k], valid[:, :k]).reshape(b * k),
        lengths=(lengths + n_new).astype(jnp.int32),
        marks=mark_after(lengths, marks, n_new, g.ring_rows).astype(jnp.int32))


def _program(ids, l_ref, m_ref, n_ref, bt_ref, slots_ref, index_ref, cand_ref, pv_ref,
             len_ref, mark_ref, *, g: RowGeometry, b: int, barrier: bool):
    """The one program: every sequence's rows as a padded `[Bp, Rp]` tile."""
    del ids
    nblocks = bt_ref.shape[1]
    seq = jnp.arange(next_pow2(b), dtype=jnp.int32)  # [Bp]
    r = jnp.arange(next_pow2(g.rows), dtype=jnp.int32)[None, :]  # [1, Rp]
    in_b = seq < b  # [Bp]
    lengths = plt.load(l_ref.at[seq], mask=in_b, other=0)  # [Bp]
    marks = plt.load(m_ref.at[seq], mask=in_b, other=0)
    n_new = plt.load(n_ref.at[seq], mask=in_b, other=0)
    real = in_b[:, None] & (r < g.rows)  # [Bp, Rp]: the tile's entries that are rows
    pos, valid = _rows(lengths[:, None], n_new[:, None], r)
    valid = valid & real
    seq2 = seq[:, None]  # [Bp, 1]
    entry = plt.load(bt_ref.at[seq2, lw.table_column(pos, nblocks, g.block_size)],
                     mask=real, other=0)  # [Bp, Rp]
    # Entries that are not rows store past the arrays' ends (masked on the GPU, dropped in
    # interpret mode): never at another row's index.
    n, k = b * g.rows, g.attended
    flat = jnp.where(real, seq2 * g.rows + r, n)  # [Bp, Rp]
    plt.store(slots_ref.at[flat], lw.slot_at(entry, pos, valid, nblocks, g.block_size),
              mask=real)
    parts = iw.meta_rows(pos, valid, lengths[:, None], seq2, g.layer, kp=g.kpool,
                         rows=g.ring_rows, num_pools=g.num_pools, keys_len=g.keys_len,
                         ring_len=g.ring_len, r=g.rows)
    for i, a in enumerate(parts):
        plt.store(index_ref.at[i, flat], a, mask=real)
    first = real & (r < k)  # the attended rows
    at = jnp.where(first, seq2 * k + r, b * k)  # [Bp, Rp]
    plt.store(cand_ref.at[at], candidate_pools(pos, valid, g.kpool), mask=first)
    plt.store(pv_ref.at[at], positions(pos, valid), mask=first)
    new_lengths, new_marks = lengths + n_new, mark_after(lengths, marks, n_new, g.ring_rows)
    # The two are written in their inputs' buffers (aliased: no copy into the donated
    # state): every thread has read them before any writes (interpret mode runs the
    # program's operations in order, and has no barrier).
    if barrier:
        plt.debug_barrier()
    plt.store(len_ref.at[seq], new_lengths, mask=in_b)
    plt.store(mark_ref.at[seq], new_marks, mask=in_b)


def row_meta_part(g: RowGeometry, lengths: jax.Array, marks: jax.Array, n_new: jax.Array,
                  block_tables: jax.Array, *, interpret: bool = False):
    """`row_meta_xla`'s kernel as a `colaunch.Part` (one program) and `finish(outs) ->
    RowMeta`. The new lengths and marks are written in the buffers of `lengths` and `marks`
    (donate them, as the step's state is: otherwise XLA copies them first)."""
    b = _check(g, lengths, marks, n_new, block_tables)
    i32 = jnp.int32
    n, k = b * g.rows, g.attended
    out = tuple(jax.ShapeDtypeStruct(s, i32) for s in ((n,), (7, n), (b * k,), (b * k,),
                                                        (b,), (b,)))
    part = Part(lambda ids, *refs: _program(ids, *refs, g=g, b=b, barrier=not interpret), (1,),
                tuple(a.astype(i32) for a in (lengths, marks, n_new, block_tables)), out,
                aliases={0: 4, 1: 5})  # lengths and marks in place
    def finish(outs):
        slots, index, n_cand, pv, new_lengths, marks = outs
        return RowMeta(slots, index, n_cand.reshape(b, k), pv, new_lengths, marks)

    return part, finish


def row_meta_pallas(g: RowGeometry, lengths: jax.Array, marks: jax.Array, n_new: jax.Array,
                    block_tables: jax.Array, *, interpret: bool = False) -> RowMeta:
    """`row_meta_xla` as one Pallas program (its launch alone; the step runs it beside the x
    projection's GEMM, `meta_matmul_pallas`): the same integers."""
    part, finish = row_meta_part(g, lengths, marks, n_new, block_tables, interpret=interpret)
    (outs,) = colaunch([part], num_warps=4, num_stages=1, interpret=interpret,
                       name="row_meta")
    return finish(outs)


def meta_matmul_xla(g: RowGeometry, lengths: jax.Array, marks: jax.Array, n_new: jax.Array,
                    block_tables: jax.Array, v: jax.Array, w: jax.Array,
                    layer: jax.Array | None = None) -> tuple[RowMeta, jax.Array]:
    """The definition: `row_meta_xla(...)` and `v [..., K] @ w [N, K].T` (`matmul_xla`; w a
    stack [G, N, K] at `layer` where given)."""
    return row_meta_xla(g, lengths, marks, n_new, block_tables), mm.matmul_xla(v, w, layer)


def meta_matmul_pallas(g: RowGeometry, lengths: jax.Array, marks: jax.Array,
                       n_new: jax.Array, block_tables: jax.Array, v: jax.Array, w: jax.Array,
                       layer: jax.Array | None = None, *, interpret: bool = False,
                       summed: bool = True) -> tuple[RowMeta, jax.Array]:
    """`meta_matmul_xla` as one launch: the metadata program first, then the GEMM's tiles
    (`matmul_part`: its own tiles, so `matmul_pallas`'s bits), at the GEMM's warps and
    pipeline depth. summed False: the GEMM's K parts `[S, ..., N]`, unsummed
    (`matmul_part`'s)."""
    m_part, m_finish = row_meta_part(g, lengths, marks, n_new, block_tables,
                                     interpret=interpret)
    rows = max(1, v.size // v.shape[-1])
    mt = mm.default_tuning(*w.shape[-2:], 1, rows, mm.reads_fp8(w))
    g_part, g_finish = mm.matmul_part(v, w, layer, tuning=mt, summed=summed)
    m_outs, g_outs = colaunch([m_part, g_part], num_warps=mt.num_warps,
                              num_stages=mt.num_stages, interpret=interpret, name="meta_matmul")
    return m_finish(m_outs), g_finish(g_outs)
