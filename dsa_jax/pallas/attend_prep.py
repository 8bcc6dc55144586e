"""The Mosaic gather-attend kernel's inputs in one Pallas Triton launch.

`sparse_attend_mgpu` takes q as f16, each group of `SCALE_HEADS` heads of a query row scaled
by a power of two 2^k that brings the group's largest |q| into [2^13, 2^14)
(`mgpu_plan.head_scales`), the flat cache slots of every selected token padded with -1 to the
kernel's slot count, and each row's live extent. The jnp twin
(`sparse_attend.mosaic_inputs_jnp`) computes these in several XLA passes: the amax reduction
reads q, the scale and conversion reads it again, then the slots, their padding and the live
extent. This kernel does all of it in one launch: one program per (row, head group) reads
the group's q once (in column chunks, kept in registers between the amax and the stores) and
writes its scale and its f16 q; one more program per row writes the row's slots, padded, and
its live extent (their two dependent loads are then not ahead of any group's q). The results
are bitwise those of the twin (integer arithmetic, max, an exact power-of-two product, and
the same round-to-nearest-even f32 -> f16 conversion).

The power of two comes from the bits of the group's amax (frexp has no Triton lowering):
amax = f * 2^e with f in [0.5, 1) has e = biased exponent - 126 for a normal amax; a
subnormal amax (biased exponent 0) has e <= -126, where the clip already gives k = 126; a zero
group is scaled as if its amax were 1 (the twin's `where(amax > 0, amax, 1)`); an infinite
amax takes frexp's e = 0. A NaN in a row is outside the contract (q is finite).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.pallas.common import check_triton_addressable, next_pow2
from dsa_jax.pallas.mgpu_plan import SCALE_HEADS

NUM_WARPS = 16  # a program's warps

# Largest slot piece (int32 vectors, a power of two for Triton): Wp is cut into powers of two.
SLOT_BLOCK = 4096


def _pow2_pieces(x: int):
    """x (a multiple of 16) -> [(start, size)]: sizes powers of two <= SLOT_BLOCK, largest
    first, covering [0, x) exactly (so no store needs a mask)."""
    out, s0 = [], 0
    while s0 < x:
        size = min(SLOT_BLOCK, next_pow2(x - s0 + 1) // 2)
        out.append((s0, size))
        s0 += size
    return out


def _pow2_bits(k):
    """int32 k in [-126, 127] -> 2^k as f32, built from its exponent bits (exact)."""
    return lax.bitcast_convert_type(lax.shift_left(k + 127, 23), jnp.float32)


def scale_exponent(amax):
    """amax f32 (>= 0) -> the twin's k = clip(14 - e, -126, 126) int32, amax = f 2^e."""
    a = jnp.where(amax > 0, amax, 1.0)
    biased = lax.shift_right_logical(lax.bitcast_convert_type(a, jnp.int32), 23) & 0xFF
    e = jnp.where(biased == 0xFF, 0, biased - 126)  # inf: frexp's 0; subnormal: <= -126
    return jnp.clip(14 - e, -126, 126)


def _pow2_divisor(x: int, cap: int) -> int:
    """The largest power of two <= cap dividing x."""
    return min(x & -x, next_pow2(cap + 1) // 2)


def _load_slots(seq, src, sel_ref, bt_ref, *, w: int, wp: int, bs: int, mb: int):
    """Row `src`'s selected tokens and their blocks' physical ids, piece by piece -> (pieces,
    tokens, physical blocks), every load issued before anything is stored."""
    pieces = _pow2_pieces(wp)
    toks = []
    for s0, sz in pieces:
        ws = s0 + jnp.arange(sz, dtype=jnp.int32)  # [SZ]
        toks.append(plt.load(sel_ref.at[src * w + jnp.minimum(ws, w - 1)], mask=ws < w,
                             other=-1))
    phys = []
    for tok in toks:
        # The empty slots' arithmetic is masked: keep it in range.
        logical = jnp.clip(jnp.maximum(tok, 0) // bs, 0, mb - 1)
        phys.append(plt.load(bt_ref.at[seq * mb + logical], mask=tok >= 0, other=0))
    return pieces, toks, phys


def _store_slots(row, pieces, toks, phys, slots_ref, live_ref, *, wp: int, bs: int):
    """Output row `row`'s flat slots (-1 empty) and its live extent."""
    live = jnp.int32(0)
    for (s0, sz), tok, ph in zip(pieces, toks, phys, strict=True):
        ws = s0 + jnp.arange(sz, dtype=jnp.int32)
        valid = tok >= 0
        slot = jnp.where(valid, ph * bs + jnp.maximum(tok, 0) % bs, -1)  # [SZ]
        plt.store(slots_ref.at[row * wp + ws], slot)
        live = jnp.maximum(live, jnp.max(jnp.where(valid, ws + 1, 0)))
    live_ref[pl.ds(row, 1)] = jnp.full((1,), live, jnp.int32)


def _prep_kernel(q_ref, sel_ref, bt_ref, q16_ref, up_ref, down_ref, slots_ref, live_ref, *,
                 groups: int, g: int, h: int, c: int, hp: int, w: int, wp: int, r: int,
                 r_src: int, bs: int, mb: int, cb: int):
    """Program p < (groups + 1) * N prepares, for output row p // (groups + 1), head group
    j = p % (groups + 1) (g heads, their own scale) or, for j == groups, the row's slots and
    live extent. Output row `row` is row `row % r` of sequence `row // r`, read in place from
    q's and sel's row `(row // r) * r_src + row % r` (their sequences hold r_src >= r rows).
    q_ref [N*H, C] f32, sel_ref [N*W] int32 tokens, bt_ref [B*MB] int32; outputs q16_ref
    [N*Hp, C] f16, up_ref / down_ref [N*Hp] f32 (each head its group's), slots_ref [N*Wp]
    int32, live_ref [N] int32 (whole arrays, flattened)."""
    pid = pl.program_id(0)
    per_row = groups + 1
    row, j = pid // per_row, pid % per_row
    seq = row // r
    src = seq * r_src + row % r

    @pl.when(j == groups)
    def _():
        _store_slots(row, *_load_slots(seq, src, sel_ref, bt_ref, w=w, wp=wp, bs=bs, mb=mb),
                     slots_ref, live_ref, wp=wp, bs=bs)

    @pl.when(j < groups)
    def _():
        _store_group(j, row, src, q_ref, q16_ref, up_ref, down_ref, g=g, h=h, c=c, hp=hp, cb=cb)


def _store_group(j, row, src, q_ref, q16_ref, up_ref, down_ref, *, g: int, h: int, c: int,
                 hp: int, cb: int):
    """Head group j of output row `row` (q's row `src`): its amax's scale and its f16 q."""
    cols = jnp.arange(cb, dtype=jnp.int32)  # [CB]
    hs = j * g + jnp.arange(g, dtype=jnp.int32)  # [G] this group's heads
    blocks = []
    for k in range(c // cb):  # the group's [G, C] in column chunks, 0 past H
        blocks.append(plt.load(q_ref.at[(src * h + jnp.minimum(hs, h - 1))[:, None],
                                        (k * cb + cols)[None, :]],
                               mask=jnp.broadcast_to((hs < h)[:, None], (g, cb)), other=0.0))
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x)) for x in blocks])
    k_exp = scale_exponent(amax)
    up = _pow2_bits(k_exp)
    plt.store(up_ref.at[row * hp + hs], jnp.full((g,), up, jnp.float32))
    plt.store(down_ref.at[row * hp + hs], jnp.full((g,), _pow2_bits(-k_exp), jnp.float32))
    for k, x in enumerate(blocks):
        plt.store(q16_ref.at[(row * hp + hs)[:, None], (k * cb + cols)[None, :]],
                  (x * up).astype(jnp.float16))


def prep_pallas(q: jax.Array, sel: jax.Array, block_tables: jax.Array, block_size: int, *,
                hp: int, wp: int, rows: int | None = None, scale_heads: int = SCALE_HEADS,
                interpret: bool = False):
    """q [N, H, C] f32 (N = B * R), sel [B, R, W] int32 tokens (-1 empty), block_tables
    [B, MB] int32 -> (q16 [N, Hp, C] f16 (each head group's q * 2^k, zero rows past H), up
    [N, Hp] f32 (2^k, each head its group's), down [N, Hp] f32 (2^-k), slots [N, Wp] int32
    (-1 empty and past W), live [N] int32).

    rows: only each sequence's first `rows` of its R rows, read in place (a decode's real row
    of its max_verify rows: no slice copies); the outputs then hold N = B * rows rows.
    scale_heads: heads per q scale (a power of two >= 16 dividing Hp). Hp, Wp and C multiples
    of 16 (the Mosaic kernel's are multiples of 64). Bitwise equal to
    `sparse_attend.mosaic_inputs_jnp` of those rows."""
    n_src, h, c = q.shape
    b, r_src, w = sel.shape
    mb = block_tables.shape[1]
    if b * r_src != n_src:
        raise ValueError(f"prep_pallas: sel {sel.shape} does not match q rows {n_src}")
    r = r_src if rows is None else rows
    if not 1 <= r <= r_src:
        raise ValueError(f"prep_pallas: rows={rows} must be in [1, {r_src}]")
    n = b * r
    if hp < h or wp < w:
        raise ValueError(f"prep_pallas: hp={hp} < H={h} or wp={wp} < W={w}")
    for what, shape, dtype in (("q", (n_src * h, c), q.dtype),
                               ("q16", (n * hp, c), jnp.float16),
                               ("sel", (n_src * w,), sel.dtype), ("slots", (n * wp,), jnp.int32),
                               ("block_tables", block_tables.shape, block_tables.dtype)):
        check_triton_addressable(shape, dtype, f"attend prep {what}")
    if hp % 16 or wp % 16 or c % 16:
        raise ValueError(f"prep_pallas: hp={hp}, wp={wp} and C={c} must be multiples of 16")
    g = scale_heads
    if g < 16 or g & (g - 1) or hp % g:
        raise ValueError(f"prep_pallas: scale_heads={g} must be a power of two >= 16 "
                         f"dividing hp={hp}")
    groups = hp // g
    kernel = functools.partial(
        _prep_kernel, groups=groups, g=g, h=h, c=c, hp=hp, w=w, wp=wp, r=r, r_src=r_src,
        bs=block_size, mb=mb, cb=_pow2_divisor(c, 512))
    shapes = [jax.ShapeDtypeStruct((n * hp, c), jnp.float16),
              jax.ShapeDtypeStruct((n * hp,), jnp.float32),
              jax.ShapeDtypeStruct((n * hp,), jnp.float32),
              jax.ShapeDtypeStruct((n * wp,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32)]
    q16, up, down, slots, live = _launch(kernel, n * (groups + 1), shapes, NUM_WARPS,
                                         interpret, q, sel, block_tables)
    return (q16.reshape(n, hp, c), up.reshape(n, hp), down.reshape(n, hp), slots.reshape(n, wp),
            live)


def _launch(kernel, programs: int, shapes, num_warps: int, interpret: bool, q, sel, tables):
    """The prep's one launch: `programs` programs over q [N*H, C], sel and the tables flat,
    writing `shapes` (whole arrays)."""
    return pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[pl.BlockSpec()] * 3,
        out_specs=[pl.BlockSpec()] * len(shapes),
        out_shape=shapes,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="attend_prep",
    )(q.reshape(-1, q.shape[-1]), sel.reshape(-1), tables.reshape(-1))
