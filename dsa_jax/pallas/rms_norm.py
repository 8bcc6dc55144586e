"""RMSNorm: `w * v / sqrt(mean(v^2) + eps)` in fp32, and the same as one Pallas launch.

Why a kernel for a norm: XLA picks a reduction's order (how it tiles and vectorizes the row
sum) per program, from the fusion around it, and barriers on the norm's input and output do
not pin it: the q_a norm of the scanned model and of the unrolled stack can come out a last
bit apart with equal inputs, which then moves whole rows of the next GEMM. A Pallas kernel
compiles as written wherever it appears: the same code, the same sum order, in every program
that calls it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.numerics import tree_sum
from dsa_jax.pallas.colaunch import Part
from dsa_jax.pallas.common import layer_index, load_parts, next_pow2

# Warps per program, each program normalizing one row held in registers (the decode front's
# shared launch runs its parts at this count too: `decode_front`).
NUM_WARPS = 4


def _columns(full: int, cols: tuple[int, int] | None, w: jax.Array,
             layer: jax.Array | None = None) -> tuple[int, int, jax.Array | None]:
    """`(start, n, index)` of the columns normalized (all `full` where `cols` is None),
    checked against v's width and w's shape (`[G, n]` with a `layer` index, returned clamped;
    None without one)."""
    start, width = (0, full) if cols is None else cols
    if not (0 <= start and 1 <= width and start + width <= full):
        raise ValueError(f"rms_norm: cols={cols} must lie within v's last axis of {full}")
    if layer is None and w.shape != (width,):
        raise ValueError(f"rms_norm: w has shape {w.shape}, expected ({width},)")
    if layer is None:
        return start, width, None
    if w.ndim != 2 or w.shape[1] != width:
        raise ValueError(f"rms_norm: a stacked w must be [G, {width}]; got {w.shape}")
    return start, width, layer_index(layer, w.shape[0], "rms_norm: ")


def rms_norm_xla(v: jax.Array, w: jax.Array, eps: float, *, cols: tuple[int, int] | None = None,
                 dtype=jnp.float32, layer: jax.Array | None = None) -> jax.Array:
    """The definition: `v [..., n]`, `w [n]` -> `[..., n]` f32, as an island of its own.
    layer: `w` is a stack `[G, n]` of weights and this is the index `[]` of the one to use
    (clamped to [0, G), as XLA's dynamic index).

    cols: `(start, n)` static: normalize columns `start .. start + n - 1` of a wider `v`
    (a GEMM's output holding several projections: the kernel reads them in place, no slice
    copy). dtype: the result's, rounded from the fp32 norm (the next GEMM's operand dtype: the
    kernel then writes it directly, no conversion pass).

    The barriers on its input and output keep XLA from fusing the norm with what surrounds it
    (fused differently in two programs, it rounds differently); they do not pin the
    reduction's order, which the Pallas kernel does."""
    start, width, at = _columns(v.shape[-1], cols, w, layer)
    if at is not None:
        w = w[at]  # [n]
    v = lax.optimization_barrier(v[..., start:start + width].astype(jnp.float32))
    out = lax.optimization_barrier(
        w * v * lax.rsqrt(tree_sum(v * v)[..., None] / width + eps))
    return out.astype(dtype)


def _norm_program(ids, *refs, start: int, width: int, eps: float, stacked: bool, parts: int):
    """Row ids[0]: [l_ref [1] int32, when `stacked`], v_ref [S, N, >= start + n] f32 (its S
    parts summed: `load_parts`), w_ref [n] f32 (or [G, n] read at row l: in place, the same
    numbers), whole arrays; out_ref [N, n] in the result's dtype (rounded to nearest even,
    as XLA's conversion)."""
    l_ref, (v_ref, w_ref, out_ref) = (refs[0], refs[1:]) if stacked else (None, refs)
    (i,) = ids
    cols = jnp.arange(next_pow2(width), dtype=jnp.int32)  # [np2]
    in_width = cols < width
    v = load_parts(v_ref, parts, i, start + cols, mask=in_width)  # [np2], zero padding
    at = (l_ref[0], cols) if stacked else (cols,)  # one indexer (Triton takes no chain)
    w = plt.load(w_ref.at[at], mask=in_width, other=0.0)  # [np2]
    out = w * v * lax.rsqrt(jnp.sum(v * v) / width + eps)  # [np2]
    plt.store(out_ref.at[i, cols], out.astype(out_ref.dtype), mask=in_width)


def rms_norm_part(v: jax.Array, w: jax.Array, eps: float, *,
                  cols: tuple[int, int] | None = None, dtype=jnp.float32,
                  layer: jax.Array | None = None, parts: int | None = None):
    """`rms_norm_pallas`'s kernel as a `colaunch.Part` (a program per row) and `finish(outs)`,
    which turns its output into that function's result (for a launch shared with other
    kernels: the same program, so the same bits at the same warps, `NUM_WARPS`). parts: v is
    `[S, ..., full]`, a split GEMM's K parts (`matmul_part(summed=False)`), normalized as
    their sum (`load_parts`: the same values as the summed v)."""
    full = v.shape[-1]
    start, width, at = _columns(full, cols, w, layer)
    s = 1 if parts is None else parts
    if parts is not None and v.shape[0] != parts:
        raise ValueError(f"rms_norm: v has shape {v.shape}; parts={parts} needs [{parts}, ...]")
    lead_shape = v.shape[:-1] if parts is None else v.shape[1:-1]
    rows = v.reshape(s, -1, full).astype(jnp.float32)  # [S, N, full]
    stacked = at is not None
    lead = (jnp.reshape(at, (1,)),) if stacked else ()
    body = functools.partial(_norm_program, start=start, width=width, eps=eps, stacked=stacked,
                             parts=s)
    n = rows.shape[1]
    part = Part(body, (n,), (*lead, rows, w.astype(jnp.float32)),
                (jax.ShapeDtypeStruct((n, width), dtype),))
    return part, lambda outs: outs[0].reshape(*lead_shape, width)


def rms_norm_pallas(v: jax.Array, w: jax.Array, eps: float, *, cols: tuple[int, int] | None = None,
                    dtype=jnp.float32, layer: jax.Array | None = None, interpret: bool = False
                    ) -> jax.Array:
    """`rms_norm_xla` as one Pallas launch, a program per row (the columns `cols` of `v` read
    in place, the result written in `dtype`; with `layer`, row `layer` of the stacked weights
    `w [G, n]` read in place: a kernel operand is a whole buffer, so a slice would be a copy)."""
    part, finish = rms_norm_part(v, w, eps, cols=cols, dtype=dtype, layer=layer)
    out = pl.pallas_call(
        lambda *refs: part.body((pl.program_id(0),), *refs),
        grid=part.grid,
        in_specs=[pl.BlockSpec()] * len(part.inputs),  # [layer], v [1, N, full], w [n] or [G, n]
        out_specs=pl.BlockSpec(),
        out_shape=part.out_shape[0],
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="rms_norm",
    )(*part.inputs)  # [N, n]
    return finish((out,))
