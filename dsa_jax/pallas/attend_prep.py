"""The Mosaic gather-attend kernel's inputs in one Pallas Triton launch.

`sparse_attend_mgpu` takes q as f16, each query row scaled by a power of two 2^k that brings
its largest |q| into [2^13, 2^14) (`sparse_attend_mgpu.row_scales`), the flat cache slots of
every selected token padded with -1 to the kernel's slot count, and each row's live extent.
The jnp twin (`sparse_attend.mosaic_inputs_jnp`) computes these in ~5 XLA passes: the amax
reduction reads q, the scale and conversion reads it again, then the slots, their padding and
the live extent. This kernel does all of it with one program per query row: the row's q is
read once from memory (in head chunks: with more than one chunk the second read of a chunk
comes from L2, the row having just been read), the slots come out padded, and the results are
bitwise those of the twin (integer arithmetic, max, an exact power-of-two product, and the
same round-to-nearest-even f32 -> f16 conversion).

The power of two comes from the bits of the row's amax (frexp has no Triton lowering):
amax = f * 2^e with f in [0.5, 1) has e = biased exponent - 126 for a normal amax; a
subnormal amax (biased exponent 0) has e <= -126, where the clip already gives k = 126; a zero
row is scaled as if its amax were 1 (the twin's `where(amax > 0, amax, 1)`); an infinite amax
takes frexp's e = 0. A NaN in a row is outside the contract (q is finite).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.pallas.common import check_triton_addressable, next_pow2

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


def _prep_kernel(q_ref, sel_ref, bt_ref, *outs, n: int, programs: int, write_q: bool, **kw):
    """Rows pid, pid + programs, ... (one row when programs == N). q_ref [N*H, C] f32,
    sel_ref [N*W] int32 tokens, bt_ref [B*MB] int32; outputs q16_ref [N*Hp, C] f16 (absent
    unless write_q),
    up_ref / down_ref [N] f32, slots_ref [N*Wp] int32, live_ref [N] int32 (whole arrays,
    flattened)."""
    refs = (q_ref, sel_ref, bt_ref, *(outs if write_q else (None, *outs)))
    pid = pl.program_id(0)
    if programs == n:
        _prep_row(pid, *refs, **kw)
        return

    def step(i, carry):
        row = pid + i * programs

        @pl.when(row < n)
        def _():
            _prep_row(row, *refs, **kw)

        return carry

    lax.fori_loop(0, -(-n // programs), step, None)


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


def _prep_group_kernel(q_ref, sel_ref, bt_ref, q16_ref, up_ref, down_ref, slots_ref, live_ref,
                       *, groups: int, g: int, h: int, c: int, hp: int, w: int, wp: int,
                       r: int, r_src: int, bs: int, mb: int, cb: int, slots_apart: bool):
    """`scale_heads`: program p prepares head group p % per_row of output row p // per_row (g
    heads, their own scale), per_row = groups (+ 1 with slots_apart). The row's slots and live
    extent: with slots_apart its program j == groups writes them and nothing else (their two
    dependent loads no longer ahead of group 0's q in one program), else its group-0 program
    writes them before its group. Refs as `_prep_kernel`'s with up_ref / down_ref [N * Hp]
    (each head its group's)."""
    pid = pl.program_id(0)
    per_row = groups + 1 if slots_apart else groups
    row, j = pid // per_row, pid % per_row
    seq = row // r
    src = seq * r_src + row % r

    @pl.when(j == (groups if slots_apart else 0))
    def _():
        _store_slots(row, *_load_slots(seq, src, sel_ref, bt_ref, w=w, wp=wp, bs=bs, mb=mb),
                     slots_ref, live_ref, wp=wp, bs=bs)

    if slots_apart:
        @pl.when(j < groups)
        def _():
            _store_group(j, row, src, q_ref, q16_ref, up_ref, down_ref, g=g, h=h, c=c, hp=hp,
                         cb=cb)
    else:
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


def _prep_row(row, q_ref, sel_ref, bt_ref, q16_ref, up_ref, down_ref, slots_ref, live_ref, *,
              h: int, c: int, hp: int, w: int, wp: int, r: int, r_src: int, bs: int, mb: int,
              hb: int, cb: int, keep: bool):
    """One query row (see `_prep_kernel`): output row `row` is row `row % r` of sequence
    `row // r`, read in place from q's and sel's row `(row // r) * r_src + row % r` (their
    sequences hold r_src >= r rows). hb | Hp, cb | C and the slot pieces tile Wp, so every
    store is whole (no masked store: a clamped index would write one element twice)."""
    seq = row // r
    src = seq * r_src + row % r
    cols = jnp.arange(cb, dtype=jnp.int32)  # [CB]
    heads = jnp.arange(hb, dtype=jnp.int32)  # [HB]

    def load(j, k):  # block (head chunk j, column chunk k) -> [HB, CB] f32, 0 past H
        hs = j * hb + heads
        return plt.load(q_ref.at[(src * h + jnp.minimum(hs, h - 1))[:, None],
                                 (k * cb + cols)[None, :]],
                        mask=jnp.broadcast_to((hs < h)[:, None], (hb, cb)), other=0.0)

    # The slots first: every piece's token loads are issued before any store (a store between
    # them would order each piece's two dependent loads after the last: one latency chain per
    # piece), and their latency overlaps the q loads below.
    slots = _load_slots(seq, src, sel_ref, bt_ref, w=w, wp=wp, bs=bs, mb=mb)

    blocks = [(j, k) for j in range(-(-h // hb)) for k in range(c // cb)]
    kept = {}
    amax = None
    for j, k in blocks:
        x = load(j, k)
        if keep:  # the whole row stays in registers for the stores
            kept[j, k] = x
        a = jnp.max(jnp.abs(x))
        amax = a if amax is None else jnp.maximum(amax, a)
    _store_slots(row, *slots, slots_ref, live_ref, wp=wp, bs=bs)
    k_exp = scale_exponent(amax)
    up = _pow2_bits(k_exp)
    up_ref[pl.ds(row, 1)] = jnp.full((1,), up, jnp.float32)
    down_ref[pl.ds(row, 1)] = jnp.full((1,), _pow2_bits(-k_exp), jnp.float32)
    for j in range(hp // hb if q16_ref is not None else 0):  # padded heads load as 0
        for k in range(c // cb):
            x = kept[j, k] if (j, k) in kept else load(j, k)
            plt.store(q16_ref.at[(row * hp + j * hb + heads)[:, None], (k * cb + cols)[None, :]],
                      (x * up).astype(jnp.float16))


def prep_pallas(q: jax.Array, sel: jax.Array, block_tables: jax.Array, block_size: int, *,
                hp: int, wp: int, heads_per_chunk: int = 32, num_warps: int = 8,
                programs: int | None = None, write_q: bool = True, rows: int | None = None,
                scale_heads: int = 0, slots_apart: bool = True, interpret: bool = False):
    """q [N, H, C] f32 (N = B * R), sel [B, R, W] int32 tokens (-1 empty), block_tables
    [B, MB] int32 -> (q16 [N, Hp, C] f16 (q * 2^k, zero rows past H), up [N] f32 (2^k),
    down [N] f32 (2^-k), slots [N, Wp] int32 (-1 empty and past W), live [N] int32).

    heads_per_chunk: heads read per load (a power of two); when >= H the whole row stays in
    registers between the amax and the stores, else each chunk is read twice (the second time
    from L2: the row's amax needs all of it before the first store). programs: how many
    programs share the rows (None: one per row; fewer bound the rows in flight, and so the
    L2 footprint of the second read). write_q=False: no q16 (None in its place; the Mosaic
    kernel's q_in_kernel scales and converts q itself). rows: only each sequence's first
    `rows` of its R rows, read in place (a decode's real row of its max_verify rows: no slice
    copies); the outputs then hold N = B * rows rows. scale_heads: one scale per group of
    that many heads (a power of two dividing Hp; `MgpuTuning.scale_heads`): one program per
    (row, group), up and down [N, Hp] (each head its group's); not with programs or
    write_q=False; slots_apart (scale_heads only): each row's slots by a program of their own
    (else by its group-0 program; the same outputs either way). Hp, Wp and C multiples
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
    if heads_per_chunk < 1 or heads_per_chunk & (heads_per_chunk - 1):
        raise ValueError(f"prep_pallas: heads_per_chunk={heads_per_chunk} must be a power of 2")
    for what, shape, dtype in (("q", (n_src * h, c), q.dtype),
                               ("q16", (n * hp, c), jnp.float16),
                               ("sel", (n_src * w,), sel.dtype), ("slots", (n * wp,), jnp.int32),
                               ("block_tables", block_tables.shape, block_tables.dtype)):
        check_triton_addressable(shape, dtype, f"attend prep {what}")
    if hp % 16 or wp % 16 or c % 16:
        raise ValueError(f"prep_pallas: hp={hp}, wp={wp} and C={c} must be multiples of 16")
    if programs is not None and programs < 1:
        raise ValueError(f"prep_pallas: programs={programs} must be >= 1")
    if scale_heads:
        return _prep_groups(q, sel, block_tables, block_size, n=n, h=h, c=c, hp=hp, w=w, wp=wp,
                            r=r, r_src=r_src, mb=mb, g=scale_heads, num_warps=num_warps,
                            programs=programs, write_q=write_q, slots_apart=slots_apart,
                            interpret=interpret)
    programs = min(n, programs or n)
    hb = _pow2_divisor(hp, min(heads_per_chunk, next_pow2(h)))
    kernel = functools.partial(
        _prep_kernel, n=n, programs=programs, write_q=write_q, h=h, c=c, hp=hp, w=w, wp=wp,
        r=r, r_src=r_src, bs=block_size, mb=mb, hb=hb,
        cb=_pow2_divisor(c, 512), keep=heads_per_chunk >= h)
    shapes = [jax.ShapeDtypeStruct((n * hp, c), jnp.float16),
              jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32),
              jax.ShapeDtypeStruct((n * wp,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32)]
    shapes = shapes if write_q else shapes[1:]
    outs = _launch(kernel, programs, shapes, num_warps, interpret, q, sel, block_tables)
    q16, up, down, slots, live = outs if write_q else (None, *outs)
    return (q16 if q16 is None else q16.reshape(n, hp, c)), up, down, slots.reshape(n, wp), live


def _prep_groups(q, sel, block_tables, block_size, *, n, h, c, hp, w, wp, r, r_src, mb, g,
                 num_warps, programs, write_q, slots_apart, interpret):
    """`prep_pallas` with `scale_heads=g` (arguments checked there)."""
    if g < 16 or g & (g - 1) or hp % g:
        raise ValueError(f"prep_pallas: scale_heads={g} must be a power of two >= 16 "
                         f"dividing hp={hp}")
    if programs is not None or not write_q:
        raise ValueError(f"prep_pallas: scale_heads={g} runs one program per (row, head "
                         f"group) and writes q: programs={programs}, write_q={write_q}")
    groups = hp // g
    kernel = functools.partial(
        _prep_group_kernel, groups=groups, g=g, h=h, c=c, hp=hp, w=w, wp=wp, r=r, r_src=r_src,
        bs=block_size, mb=mb, cb=_pow2_divisor(c, 512), slots_apart=slots_apart)
    shapes = [jax.ShapeDtypeStruct((n * hp, c), jnp.float16),
              jax.ShapeDtypeStruct((n * hp,), jnp.float32),
              jax.ShapeDtypeStruct((n * hp,), jnp.float32),
              jax.ShapeDtypeStruct((n * wp,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32)]
    per_row = groups + 1 if slots_apart else groups
    q16, up, down, slots, live = _launch(kernel, n * per_row, shapes, num_warps, interpret, q,
                                         sel, block_tables)
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
