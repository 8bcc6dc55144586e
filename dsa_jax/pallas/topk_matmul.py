"""The pool top-k of a decode's rows and the q_b GEMM of its rows in one launch.

The two are independent (the top-k reads the pool scores, the GEMM the normalized query
residual) and opposite in kind: the top-k of a few rows is a few programs waiting on their
own reductions, the GEMM streams a 50 MB weight over every multiprocessor. In one launch
(`colaunch`: the top-k's programs first, then the GEMM's tiles) the top-k runs beside the
GEMM instead of before it.

`topk_matmul_xla` is the definition: `pool_topk_xla` (with an `Expansion`, the pools' token
slots: `pool_topk.expand_xla`) and `matmul_xla`. The kernel returns what `pool_topk_pallas`
(or `pool_topk_expand_pallas`) and `matmul_pallas` return, bit for bit: each part is its kernel's
own program with its own tiles. Where the two cannot share a launch (the top-k would run the
raw Triton kernel, a row longer than the top-k kernel holds, other warp counts, no rows)
they run one after the other: the same results.
"""

from __future__ import annotations

import math

import jax

from dsa_jax.pallas import matmul as mm
from dsa_jax.pallas import pool_topk as tk
from dsa_jax.pallas.colaunch import colaunch

__all__ = ["shares_launch", "topk_matmul_pallas", "topk_matmul_xla"]


def topk_matmul_xla(scores: jax.Array, k: int, v: jax.Array, w: jax.Array,
                    layer: jax.Array | None = None, *, expand: tk.Expansion | None = None,
                    pos: jax.Array | None = None, valid: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """The definition: scores [..., P] f32 -> pools [..., k] int32 (`pool_topk_xla`), or
    with `expand` their token slots [..., W] (`pool_topk.expand_xla` at pos, valid [...]);
    v [..., K] @ w [N, K].T -> [..., N] f32 (`matmul_xla`; w a stack [G, N, K] at `layer`
    where given)."""
    pools = tk.pool_topk_xla(scores, k)
    if expand is not None:
        pools = tk.expand_xla(pools, pos, valid, expand)
    return pools, mm.matmul_xla(v, w, layer)


def shares_launch(scores_shape: tuple[int, ...], v_shape: tuple[int, ...],
                  w_shape: tuple[int, ...], interpret: bool,
                  topk_tuning: tk.PoolTopkTuning | None = None,
                  matmul_tuning: mm.MatmulTuning | None = None) -> bool:
    """Whether the two kernels run in one launch for these shapes (static; w_shape [N, K] or
    a stack's [G, N, K]; tunings None: the kernels' defaults, the GEMM's for a 16-bit weight:
    an fp8 weight's caller passes its tiles, `default_tuning(..., fp8_weight=True)`)."""
    topk_tuning = topk_tuning or tk.PoolTopkTuning()
    rows = math.prod(scores_shape[:-1])
    m = math.prod(v_shape[:-1])
    mt = matmul_tuning or mm.default_tuning(*w_shape[-2:], 1, m)
    return (rows > 0 and m > 0 and not tk.runs_triton(topk_tuning, rows, interpret)
            and scores_shape[-1] <= tk.KERNEL_MAX_P and mt.num_warps == tk.NUM_WARPS)


def topk_matmul_pallas(scores: jax.Array, k: int, v: jax.Array, w: jax.Array,
                       layer: jax.Array | None = None, *, expand: tk.Expansion | None = None,
                       pos: jax.Array | None = None, valid: jax.Array | None = None,
                       pv: jax.Array | None = None, interpret: bool = False,
                       topk_tuning: tk.PoolTopkTuning | None = None,
                       matmul_tuning: mm.MatmulTuning | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """`topk_matmul_xla` as `pool_topk_pallas` (with `expand`, `pool_topk_expand_pallas`:
    the kernel writes the slots) and `matmul_pallas` (w a stack [G, N, K] read in place at
    `layer` where given) in one launch (where
    `shares_launch`; else one after the other): their results, bit for bit. The launch runs
    the GEMM's pipeline depth (the top-k alone runs 1: its loops hold no streamed loads).
    pv: `pool_topk.positions(pos, valid)` flattened, computed by the caller (the step's
    metadata launch, `pallas/row_meta.py`; where the two share the launch). Tunings None: the
    kernels' defaults."""
    topk_tuning = topk_tuning or tk.PoolTopkTuning()
    m = math.prod(v.shape[:-1])
    mt = matmul_tuning or mm.default_tuning(*w.shape[-2:], 1, m, mm.reads_fp8(w))
    if not shares_launch(scores.shape, v.shape, w.shape, interpret, topk_tuning, mt):
        if scores.shape[-1] > tk.KERNEL_MAX_P:  # past the kernels' rows: lax.top_k
            pools = tk.pool_topk_xla(scores, k)
            if expand is not None:
                pools = tk.expand_xla(pools, pos, valid, expand)
        elif expand is None:
            pools = tk.pool_topk_pallas(scores, k, interpret=interpret, tuning=topk_tuning)
        elif tk.runs_triton(topk_tuning, math.prod(scores.shape[:-1]), interpret):
            pools = tk.expand_xla(tk.pool_topk_pallas(scores, k, interpret=interpret,
                                                      tuning=topk_tuning), pos, valid, expand)
        else:
            pools = tk.pool_topk_expand_pallas(scores, k, pos, valid, expand,
                                               interpret=interpret, tuning=topk_tuning)
        return pools, mm.matmul_pallas(v, w, layer, interpret=interpret,
                                       tuning=matmul_tuning)
    t_part, t_finish = tk.topk_part(scores, k, interpret=interpret, tuning=topk_tuning,
                                    expand=expand, pos=pos, valid=valid, pv=pv)
    m_part, m_finish = mm.matmul_part(v, w, layer, tuning=mt)
    t_outs, m_outs = colaunch([t_part, m_part], num_warps=mt.num_warps,
                              num_stages=mt.num_stages, interpret=interpret, name="topk_matmul")
    return t_finish(t_outs), m_finish(m_outs)
