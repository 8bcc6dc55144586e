"""Sparse MLA gather-attend over the paged latent cache.

For every sequence `b`, query row `r` and head `h`: gather the latents of the selected tokens
`sel[b, r]` (`-1` slots skipped) through the sequence's block table, dequantize, and return the
softmax-weighted latent sum `sum_j p_j c_j` with `p = softmax_j((q . c_j) * softmax_scale)`.
A row with an empty selection returns 0. The XLA twin is fp32 throughout. Two Pallas kernels
compute the same function (`AttendTuning.backend` picks, by a fixed rule): the Triton kernel
below feeds its dots bf16 operands for fp8 / bf16 caches (fp32 accumulation) and fp32 operands
for an fp32 cache (tests/test_kernels.py derives the resulting tolerance); the Mosaic GPU
kernel (`sparse_attend_mgpu`, fp8 caches on Hopper) feeds them f16 operands
(tests/test_attend_kernel.py derives its tolerance; the GPU tests check it against the twin).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.numerics import tree_sum
from dsa_jax.pallas import attend_prep, tuned
from dsa_jax.pallas import sparse_attend_mgpu as mgpu_op
from dsa_jax.pallas.common import (
    check_triton_addressable,
    next_pow2,
    sm_count,
)
from dsa_jax.pallas.merge_splits import merge_splits_pallas, padded_rows_jnp
from dsa_jax.pallas.mgpu_plan import BLOCK_W, HEADS_PER_CTA, SCALE_HEADS

# Rows per lax.map step of the XLA twin: bounds the gathered [rows, W, C] fp32 block.
XLA_ROW_CHUNK = 64
BACKENDS = ("auto", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class AttendTuning:
    """Which gather-attend kernel runs, and its tuning; `AttendTuning()` is what the library
    runs.

    backend: "triton" (the Pallas Triton kernel below: every cache dtype, interpret mode),
      "mosaic" (`sparse_attend_mgpu`: Pallas Mosaic GPU, fp8 e4m3 caches with C a multiple of
      128 up to 512, compiled for a Hopper GPU only; anything else raises), or "auto" (the
      default): mosaic where it applies and was measured faster on the H200 (fp8 cache,
      supported C, at least half of every 64-row head tile real heads (`mosaic_fills`: 64 per
      device at TP 1, 32 at TP 2 padded with zero rows; the tile's cost is mostly the latents'
      gather and conversion, shared by its rows), not interpret mode, no explicit Triton tile
      or dtype argument, a Hopper GPU: `common.gpu_is_not_hopper`), triton otherwise (e.g. 8
      heads per device at TP 8: unmeasured, and 56 of every 64 tile rows would be padding).
      The rule is fixed (`tuned.DEFAULTS`); nothing depends on the environment but the GPU's
      generation.
    mosaic: the Mosaic GPU kernel's tuning (`sparse_attend_mgpu.MgpuTuning`).
    """

    backend: str = "auto"
    mosaic: mgpu_op.MgpuTuning = mgpu_op.MgpuTuning()

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: must be one of {BACKENDS}")


def takes_scaled_q(cache_dtype, heads: int, c: int, interpret: bool,
                   tuning: AttendTuning = AttendTuning()) -> bool:
    """Whether `sparse_attend_pallas` reads `q_scaled=` (a prompt's rows) for these inputs:
    `tuning` picks the Mosaic kernel for them (`pick_backend`: never in interpret mode), which
    takes a prompt's q already scaled. The layer makes that q only then."""
    if interpret:
        return False
    return pick_backend(tuning, cache_dtype, heads, c, interpret, False) == "mosaic"


def token_slots(tokens: jax.Array, block_table: jax.Array, block_size: int) -> jax.Array:
    """Token positions `[...]` of one sequence -> flat cache slots; -1 stays -1."""
    logical = jnp.clip(tokens // block_size, 0, block_table.shape[0] - 1)
    slots = block_table[logical] * block_size + tokens % block_size
    return jnp.where(tokens >= 0, slots, -1)


def _attend_row(q, latent_flat, kv_scale, slots, softmax_scale):
    """One query row: q [H, C] f32, slots [W] -> [H, C] f32 (slots < 0 are empty)."""
    valid = slots >= 0  # [W]
    # Empty slots load nothing: they point past the cache and the gather fills 0, since a
    # physical row of another sequence may hold anything (a zero weight times NaN is NaN).
    rows = jnp.where(valid, slots, latent_flat.shape[0])  # [W]
    c = jnp.take(latent_flat, rows, axis=0, mode="fill", fill_value=0).astype(jnp.float32)  # [W, C]
    if latent_flat.dtype == jnp.float8_e4m3fn:
        c = c * kv_scale
    # HIGHEST: the definition is fp32 on every backend (a GPU would otherwise use tf32).
    logits = jnp.einsum("hc,wc->hw", q, c, precision=lax.Precision.HIGHEST) * softmax_scale
    logits = jnp.where(valid[None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)  # exactly 0 where invalid
    denom = tree_sum(p)[:, None]  # [H, 1]: a fixed order, whatever the batch
    out = jnp.einsum("hw,wc->hc", p, c, precision=lax.Precision.HIGHEST)
    return out / jnp.where(denom > 0, denom, 1.0)


def sparse_attend_xla(q: jax.Array, latent: jax.Array, kv_scale: jax.Array,
                      block_tables: jax.Array, sel: jax.Array, *, softmax_scale: float,
                      out_dtype=jnp.float32, rows: int | None = None,
                      fill: jax.Array | None = None) -> jax.Array:
    """The definition.

    q: [B, R, H, C] f32 absorbed queries; latent: [NB, bs, C] cache dtype; kv_scale: [] f32
    (applied to float8_e4m3fn caches only); block_tables: [B, MB] int32; sel: [B, R, W] int32
    token indices, -1 padded. Returns [B, R, H, C] f32, rounded to `out_dtype` if given.
    rows, fill: static `rows < R` attends only each sequence's first `rows` rows; row r >= rows
    of sequence b is then fill[b, r] (fill [B, R] f32: a decode attends the first of its
    max_verify rows, the others are padding; the Mosaic path reads those rows in place and
    writes the whole block with its split merge, in one pass).
    """
    r = _attended_rows(q.shape[:2], rows, fill)
    out = _sparse_attend_f32(q[:, :r], latent, kv_scale, block_tables, sel[:, :r],
                             softmax_scale)
    return _finish(out, out_dtype, None if r == q.shape[1] else fill)


def _finish(out: jax.Array, out_dtype, fill: jax.Array | None) -> jax.Array:
    """out [B, r, H, C] f32 -> out_dtype, padded with `fill [B, R]` rows
    (`sparse_attend_xla`)."""
    if fill is None:
        return out.astype(out_dtype)
    return padded_rows_jnp(out, fill, out_dtype)


def _attended_rows(shape: tuple[int, int], rows: int | None, fill: jax.Array | None) -> int:
    """The rows per sequence attended (`sparse_attend_xla`'s rows and fill), checked."""
    b, r = shape
    if rows is None or rows == r:
        return r
    if not 1 <= rows < r:
        raise ValueError(f"sparse_attend: rows={rows} must be in [1, R = {r}]")
    if fill is None or fill.shape != (b, r):
        raise ValueError(f"sparse_attend: rows={rows} < R needs fill [B, R] = {(b, r)}, got "
                         f"{None if fill is None else fill.shape}")
    return rows


def _sparse_attend_f32(q, latent, kv_scale, block_tables, sel, softmax_scale):
    """`sparse_attend_xla`'s [B, R, H, C] f32 result, before its rounding and padding."""
    b, r, h, c = q.shape
    nb, bs, _ = latent.shape
    latent_flat = latent.reshape(nb * bs, c)
    slots = jax.vmap(token_slots, in_axes=(0, 0, None))(sel, block_tables, bs)  # [B, R, W]
    q_rows = q.reshape(b * r, h, c)
    slot_rows = slots.reshape(b * r, -1)
    def row(args):
        return _attend_row(args[0], latent_flat, kv_scale, args[1], softmax_scale)

    if b * r <= XLA_ROW_CHUNK:
        out = jax.vmap(row)((q_rows, slot_rows))
    else:
        out = lax.map(row, (q_rows, slot_rows), batch_size=XLA_ROW_CHUNK)
    return out.reshape(b, r, h, c)


# ---------------------------------------------------------------------------------------------
# Pallas (Triton) kernel.
#
# Grid (head block, split, row). Every program owns HB heads of one query row and a contiguous
# 1/n_split share of that row's slot list; it streams that share in tiles of BW slots, gathers
# the tiles' latent rows straight from the paged cache (masked: empty slots cost no traffic),
# and keeps a flash-style online softmax (m, l, acc). A program stops at the row's last
# non-empty slot (`live`, computed in jnp), so padded rows (a decode padded to max_verify) and
# short selections cost no tile work; the skipped tiles held only empty slots (they added
# exact zeros), so no value changes. The head block is the fastest grid axis so that the
# programs loading the same latents run side by side and share them through L2. The per-split
# partials are merged by the merge kernel (`merge_splits_pallas`; `merge_splits` is its twin).
# ---------------------------------------------------------------------------------------------

# Running max before any slot is seen: finite, so an all-empty tile rescales by exp(0) = 1
# instead of exp(-inf + inf) = NaN; every real logit is far above it.
_M_INIT = -1e30


def _attend_kernel(scale_ref, live_ref, q_ref, slots_ref, lat_ref, o_ref, m_ref, l_ref, *,
                   width: int, tiles: int, block_w: int, compute_dtype, precision):
    """One (head block, split, row) program.

    scale_ref: [2] f32 (logit scale, output scale); live_ref: [N] int32 (whole array), slots
    past which a row has no non-empty slot; q_ref: [HB, Cp] compute dtype; slots_ref:
    [N, Wp] int32 (whole array); lat_ref: [NS, C] cache dtype (whole flat cache). Outputs this
    split's normalized partial o_ref [HB, Cp] f32 (0 if it saw no valid slot), its running
    max m_ref [HB] f32 and softmax denominator l_ref [HB] f32.
    """
    split, row = pl.program_id(1), pl.program_id(2)
    hb, cp = q_ref.shape
    logit_scale, out_scale = scale_ref[0], scale_ref[1]

    def gather(slots, valid, cols):  # -> [BW, len(cols)] compute dtype; 0 at empty slots
        mask = valid[:, None] if width == cp else valid[:, None] & (cols < width)[None, :]
        mask = jnp.broadcast_to(mask, (block_w, cols.shape[0]))  # Triton wants the pointer's
        return plt.load(lat_ref.at[jnp.maximum(slots, 0)[:, None], cols[None, :]], mask=mask,
                        other=jnp.zeros((), lat_ref.dtype)).astype(compute_dtype)

    q = q_ref[...]  # [HB, Cp]
    cols = jnp.arange(cp, dtype=jnp.int32)  # [Cp]

    def tile(t, carry):
        m, l, acc = carry  # [HB], [HB], [HB, Cp]
        start = (split * tiles + t) * block_w
        slots = slots_ref[row, pl.ds(start, block_w)]  # [BW]
        valid = slots >= 0  # [BW]
        c = gather(slots, valid, cols)  # [BW, Cp]
        logits = _dot(q, c, ((1,), (1,)), precision)
        logits = jnp.where(valid[None, :], logits * logit_scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))  # [HB]
        alpha = jnp.exp(m - m_new)  # [HB]
        p = jnp.exp(logits - m_new[:, None])  # [HB, BW], 0 at empty slots
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(compute_dtype), c, ((1,), (0,)), precision)
        return m_new, l, acc

    init = (jnp.full((hb,), _M_INIT, jnp.float32), jnp.zeros((hb,), jnp.float32),
            jnp.zeros((hb, cp), jnp.float32))
    live_tiles = (live_ref[row] + block_w - 1) // block_w - split * tiles
    m, l, acc = lax.fori_loop(0, jnp.clip(live_tiles, 0, tiles), tile, init)
    # Normalized here so that one split needs no merge pass at all.
    o_ref[...] = acc * (out_scale / jnp.where(l > 0, l, 1.0))[:, None]
    m_ref[...] = m
    l_ref[...] = l


def _dot(a, b, contract, precision):
    """2-D dot with fp32 accumulation."""
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_precision(compute_dtype, interpret: bool):
    """fp32 operands: 3-pass tf32 on the GPU (fp32-level error on tensor cores; Triton's IEEE
    fp32 dot measured far slower); IEEE fp32 in interpret mode, where the CPU has no tf32.
    bf16 operands: a plain bf16 MMA either way."""
    if compute_dtype == jnp.float32 and not interpret:
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.HIGHEST


def live_extent(slots: jax.Array) -> jax.Array:
    """`slots [N, W]` -> `[N]` int32: one past each row's last non-empty slot (0 if none)."""
    pos = jnp.arange(1, slots.shape[-1] + 1, dtype=jnp.int32)  # [W]
    return jnp.max(jnp.where(slots >= 0, pos, 0), axis=-1)


def merge_splits(o, m, l, scale=None):
    """Normalized partials o [N, S, Hp, Cp] (f32, or f16 in the cache's units with `scale`
    [] / [1] f32 the cache's scale, applied to the merged rows), m, l [N, S, Hp] f32 ->
    [N, Hp, Cp] f32; 0 where no split saw a valid slot."""
    o = o.astype(jnp.float32)
    if scale is not None:
        return _merge_partials(o, m, l) * jnp.asarray(scale, jnp.float32).reshape(())
    return _merge_partials(o, m, l)


def _merge_partials(o, m, l):
    """`merge_splits` of f32 partials, before any scale."""
    if o.shape[1] == 1:
        return o[:, 0]
    m_all = jnp.max(m, axis=1, keepdims=True)  # [N, 1, Hp]
    wgt = jnp.exp(m - m_all) * l  # [N, S, Hp]: each split's share of the softmax mass
    total = jnp.sum(wgt, axis=1)  # [N, Hp]
    out = jnp.sum(wgt[..., None] * o, axis=1)  # [N, Hp, Cp]
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def default_compute_dtype(cache_dtype) -> jnp.dtype:
    """bf16 dot operands for fp8 / bf16 caches (their values are exact in bf16), fp32 for fp32."""
    return jnp.dtype(jnp.float32 if cache_dtype == jnp.float32 else jnp.bfloat16)


def default_tiles(padded_heads: int, compute_dtype=jnp.bfloat16) -> dict:
    """Heads per program, slots per tile, warps, and how many such programs one multiprocessor
    holds at a time, the fastest of the H200 sweeps. The accumulator [HB, C] fp32 and the
    latent tile [BW, C] live in registers: BW = 64 with HB = 64 and C = 512 spills. fp32
    operands (3-pass tf32) need the most shared memory: HB = 64 asks for more than a
    multiprocessor has."""
    if jnp.dtype(compute_dtype) == jnp.float32:
        return dict(block_h=16, block_w=32, num_warps=4, per_sm=1)
    if padded_heads >= 64:
        return dict(block_h=64, block_w=32, num_warps=8, per_sm=1)
    if padded_heads == 32:
        return dict(block_h=32, block_w=32, num_warps=4, per_sm=2)
    return dict(block_h=16, block_w=32, num_warps=4, per_sm=4)


def _num_splits(programs_per_split: int, per_sm: int, tiles: int, max_splits: int = 16,
                sms: int | None = None) -> int:
    """Splits per row and head block: as many as fill the multiprocessors (`sms`, default
    `sm_count()`) in one wave (a second, partial wave measured slower), at most max_splits
    (partials cost traffic and a merge) and tiles."""
    fit = ((sms or sm_count()) * per_sm) // max(1, programs_per_split)
    return max(1, min(max_splits, tiles, fit))


def mosaic_fills(heads: int) -> bool:
    """Whether at least half of the Mosaic kernel's 64-row head tiles are real heads once
    `heads` is padded to a multiple of 64 (the rest are zero rows whose outputs are dropped)."""
    padded = -(-heads // HEADS_PER_CTA) * HEADS_PER_CTA
    return 2 * heads >= padded


def pick_backend(tuning: AttendTuning, cache_dtype, heads: int, c: int, interpret: bool,
                 triton_args: bool) -> str:
    """"triton" or "mosaic" for these inputs (AttendTuning's rule); raises where "mosaic" was
    asked for and cannot run."""
    why = mgpu_op.supports(cache_dtype, c)
    if tuning.backend == "mosaic":
        if interpret:
            raise ValueError("backend='mosaic': Mosaic GPU kernels have no interpret mode")
        if why is not None:
            raise ValueError(f"backend='mosaic' does not run {why}; use backend='triton'")
        return "mosaic"
    if (tuning.backend == "triton" or triton_args or why is not None or not mosaic_fills(heads)
            or tuned.backends(interpret).attend != "mosaic"):
        return "triton"
    return "mosaic"


def sparse_attend_pallas(q: jax.Array, latent: jax.Array, kv_scale: jax.Array,
                         block_tables: jax.Array, sel: jax.Array, *, softmax_scale: float,
                         interpret: bool = False, block_h: int | None = None,
                         block_w: int | None = None, num_splits: int | None = None,
                         compute_dtype=None, num_warps: int | None = None,
                         num_stages: int = 2, live_rows: int | None = None,
                         tuning: AttendTuning = AttendTuning(), out_dtype=jnp.float32,
                         rows: int | None = None, fill: jax.Array | None = None,
                         q_scaled: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`sparse_attend_xla` as a Pallas kernel; same arguments, same result (see tolerances in
    tests/test_kernels.py and tests/test_attend_kernel.py). q [B, R, H, C] f32 -> [B, R, H, C]
    f32.

    tuning: which kernel (`AttendTuning.backend`) and its tuning. num_splits: programs per row
    and head block (None: enough to fill the GPU); live_rows: how many of the B*R rows the
    split heuristic should plan for (None: all); a decode padded to max_verify rows has about
    B non-empty rows, and planning for the padded ones would leave most of the GPU idle.
    Triton only (giving one selects the Triton kernel under backend="auto"): block_h: heads
    per program (H is padded to a power of two >= 16, the smallest dot tile); block_w: slots
    per tile; compute_dtype: dot operand dtype (None: `default_compute_dtype`); num_warps,
    num_stages. None tile arguments take `default_tiles`. out_dtype, rows, fill: as
    `sparse_attend_xla`'s; the Mosaic path reads the rows in place and writes the padded block
    with its split merge, in one pass. q_scaled: (q16 [B, R, H, C] f16, down [B, R, H] f32),
    q scaled per (row, head) by a power of two with every |q 2^k| below 2^14 and rounded to
    f16 (`projection.scaled_q_abs`, the U_k GEMM's kernel, from a bound known before the GEMM):
    the Mosaic path takes it in place of q for rows without padding (a prompt's): no f32 q
    written and read back, no prep (q is not read); other paths ignore it.
    """
    b, r_all, h, c = q.shape
    r = _attended_rows((b, r_all), rows, fill)
    pad = None if r == r_all else (r, fill)
    nb, bs, _ = latent.shape
    n, w = b * r, sel.shape[-1]
    triton_args = any(a is not None for a in (block_h, block_w, compute_dtype, num_warps))
    backend = pick_backend(tuning, latent.dtype, h, c, interpret, triton_args)
    is_fp8 = latent.dtype == jnp.float8_e4m3fn
    kv = jnp.asarray(kv_scale, jnp.float32) if is_fp8 else jnp.float32(1.0)
    if backend == "mosaic":
        out = _mosaic_attend(q.reshape(b * r_all, h, c), latent.reshape(nb * bs, c), kv, sel,
                             block_tables, bs, softmax_scale, tuning.mosaic, num_splits,
                             live_rows or n, out_dtype, pad,
                             None if q_scaled is None else
                             (q_scaled[0].reshape(b * r_all, h, c),
                              q_scaled[1].reshape(b * r_all, h)))
        return out.reshape(b, r_all, h, c)
    q, sel = q[:, :r], sel[:, :r]  # the Triton kernel takes its rows whole

    # Kept for this kernel (the write stores through XLA instead): its gather reads the cache
    # in place; reading it as words would need an unpack on the hot path (unmeasured). The
    # Mosaic kernel above addresses rows in 64 bits (memref offsets) and takes any cache size.
    check_triton_addressable(latent.shape, latent.dtype, "latent cache")
    slots = jax.vmap(token_slots, in_axes=(0, 0, None))(sel, block_tables, bs)  # [B, R, W]
    slots = slots.reshape(n, w)
    compute_dtype = jnp.dtype(compute_dtype or default_compute_dtype(latent.dtype))
    hp2 = next_pow2(max(h, 16))
    tiles_cfg = default_tiles(hp2, compute_dtype)
    block_h = block_h or tiles_cfg["block_h"]
    block_w = block_w or tiles_cfg["block_w"]
    num_warps = num_warps or tiles_cfg["num_warps"]
    hb = min(next_pow2(block_h), hp2)
    hp = -(-max(h, 16) // hb) * hb  # padded heads
    cp = max(16, next_pow2(c))  # padded latent width (masked loads, no cache copy)
    tiles_all = -(-w // block_w)
    splits = num_splits or _num_splits((live_rows or n) * (hp // hb), tiles_cfg["per_sm"],
                                       tiles_all)
    tiles = -(-tiles_all // splits)  # tiles per split
    wp = splits * tiles * block_w

    slots = jnp.pad(slots, ((0, 0), (0, wp - w)), constant_values=-1)  # [N, Wp]
    live = live_extent(slots)  # [N]
    q_p = q.reshape(n, h, c)  # [N, Hp, Cp] once padded
    if (hp, cp) != (h, c):
        q_p = jnp.pad(q_p, ((0, 0), (0, hp - h), (0, cp - c)))
    # The fp8 scale is applied to the logits and the output, not to the latents, so the dot
    # sees the stored e4m3 values, which bf16 holds exactly.
    scales = jnp.stack([kv * softmax_scale, kv]).astype(jnp.float32)  # [2]

    kernel = functools.partial(_attend_kernel, width=c, tiles=tiles, block_w=block_w,
                               compute_dtype=compute_dtype,
                               precision=_dot_precision(compute_dtype, interpret))
    part = jax.ShapeDtypeStruct((n, splits, hp), jnp.float32)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(hp // hb, splits, n),  # (head block, split, row)
        in_specs=[
            pl.BlockSpec(),  # scales [2]
            pl.BlockSpec(),  # live [N]
            pl.BlockSpec((None, hb, cp), lambda i, s, j: (j, i, 0)),  # q [N, Hp, Cp]
            pl.BlockSpec(),  # slots [N, Wp]
            pl.BlockSpec(),  # flat cache [NS, C]
        ],
        out_specs=[
            pl.BlockSpec((None, None, hb, cp), lambda i, s, j: (j, s, i, 0)),
            pl.BlockSpec((None, None, hb), lambda i, s, j: (j, s, i)),
            pl.BlockSpec((None, None, hb), lambda i, s, j: (j, s, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((n, splits, hp, cp), jnp.float32), part, part],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_attend",
    )(scales, live, q_p.astype(compute_dtype), slots, latent.reshape(nb * bs, c))
    # The merge kernel, as on the Mosaic path: jnp's merge fused with what follows it differed
    # between a decode's program and a verify's (decode_k != serial at TP 8 on the H200).
    out = merge_splits_pallas(o, m, l, interpret=interpret, dtype=out_dtype,
                              pad=pad)  # [B * R, Hp, Cp]
    return out[:, :h, :c].reshape(b, -1, h, c)


def padded_slots(sel, block_tables, block_size: int, wp: int):
    """sel [B, R, W] tokens, block_tables [B, MB] -> the flat cache slots [B * R, Wp] int32,
    -1 where empty and past W."""
    b, r, w = sel.shape
    slots = jax.vmap(token_slots, in_axes=(0, 0, None))(sel, block_tables, block_size)
    return jnp.pad(slots.reshape(b * r, w), ((0, 0), (0, wp - w)), constant_values=-1)


def mosaic_inputs_jnp(q, sel, block_tables, block_size: int, *, hp: int, wp: int,
                      scale_heads: int = SCALE_HEADS):
    """The Mosaic kernel's inputs in jnp (the twin of `attend_prep.prep_pallas`): q [N, H, C]
    f32, sel [B, R, W] tokens, block_tables [B, MB] -> (q16 [N, Hp, C] f16, each group of
    `scale_heads` heads scaled by its 2^k (padded heads zeros), up = 2^k [N, Hp], down = 2^-k
    [N, Hp] (each head its group's), slots [N, Wp] (-1 past W), live [N])."""
    n, h, _ = q.shape
    slots = padded_slots(sel, block_tables, block_size, wp)  # [N, Wp]
    q_p = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))  # [N, Hp, C]
    up, down = mgpu_op.head_scales(q_p, scale_heads)  # [N, Hp] each
    return ((q_p * up[:, :, None]).astype(jnp.float16), up, down, slots, live_extent(slots))


def scaled_inputs(q16, down, sel, block_tables, block_size: int, *, hp: int, wp: int):
    """The Mosaic kernel's inputs from a q already scaled per head (`projection.scaled_q_abs`:
    q16 [N, H, C] f16, down [N, H] f32 = 2^-k): (q16 [N, Hp, C], up [N, Hp], down [N, Hp],
    slots [N, Wp], live [N]), padded heads zero (scale 1). q_abs's products are rounded to f16
    as the head-group scales round them, except for values below f16's normal range (2^-27 of
    their bound)."""
    n, h, _ = q16.shape
    slots = padded_slots(sel, block_tables, block_size, wp)  # [N, Wp]
    up = 1.0 / down  # exact: powers of two
    if hp != h:
        q16 = jnp.pad(q16, ((0, 0), (0, hp - h), (0, 0)))
        up, down = (jnp.pad(x, ((0, 0), (0, hp - h)), constant_values=1.0) for x in (up, down))
    return q16, up, down, slots, live_extent(slots)


def _mosaic_attend(q, latent_flat, kv, sel, block_tables, bs, softmax_scale,
                   t: mgpu_op.MgpuTuning, num_splits, live_rows, dtype, pad, q_scaled=None):
    """q [B * R, H, C] f32, latent_flat [NS, C] fp8, sel [B, R, W] tokens -> [B * R, H, C]
    `dtype`; with `pad = (r, fill [B, R])` only each sequence's first r rows are attended
    (read in place by the prep), the others are fill (`merge_splits_pallas`'s padding).
    q_scaled (q16 [B * R, H, C], down [B * R, H]): `sparse_attend_pallas`'s, taken in place of
    q where there is no pad (a prompt's rows)."""
    b, r_all, w = sel.shape
    r = r_all if pad is None else pad[0]
    h = q.shape[1]
    hp = -(-h // HEADS_PER_CTA) * HEADS_PER_CTA
    tiles_all = -(-w // BLOCK_W)
    splits = num_splits or mgpu_op.num_splits(live_rows * (hp // HEADS_PER_CTA), tiles_all,
                                              sm_count(), t.max_splits)
    tiles = -(-tiles_all // splits)
    wp = splits * tiles * BLOCK_W
    if q_scaled is not None and pad is None:  # a prompt's rows
        qk, up, down, slots, live = scaled_inputs(*q_scaled, sel, block_tables, bs, hp=hp,
                                                  wp=wp)
    else:
        qk, up, down, slots, live = attend_prep.prep_pallas(q, sel, block_tables, bs, hp=hp,
                                                            wp=wp, rows=r)
    direct = splits == 1 and pad is None  # the partial is the result: the kernel rounds it
    o, m, l = mgpu_op.sparse_attend_mgpu_partials(
        kv, (up, down), live, qk, slots, latent_flat, softmax_scale=softmax_scale,
        splits=splits, tiles=tiles, out_dtype=dtype if direct else jnp.float32)
    scale = kv if splits > 1 else None  # f16 partials in the cache's units: the merge scales
    if direct:
        return o[:, 0, :h]
    # The merge as a kernel: one summation order in every program. A jnp merge is fused into
    # whatever follows it, which differs between a decode (its rows cut and padded) and a
    # max_verify-row verify, and on the H200 they then differed in y's last bits. It also
    # rounds to `dtype` and writes a decode's padded block, so neither needs a pass of its own.
    return merge_splits_pallas(o, m, l, dtype=dtype, pad=pad, scale=scale)[:, :h]
