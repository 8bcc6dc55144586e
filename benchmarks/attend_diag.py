"""What paces the FlashMLA-split attend kernel's tiles: timing-only variants of its converter.

Each patches `mgpu_gather`'s gather or store for the time of one variant of `h200_attend.py`
(never in the library: the outputs are wrong by design, so their checks fail; only their
times mean something):

* "diag-noload": the converter loads no latent row from global memory; each chunk's bytes
  come from its slot index (already in shared memory), then are converted and stored as
  usual. Faster than the default by about what the gather's loads cost a tile.
* "diag-nostore": the converter neither loads, converts nor stores (the store is a no-op, so
  the compiler drops the gather too); the wgmmas read whatever the tiles hold. What is left
  is warpgroup 0's work, the converter's P @ V and the barriers.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

from dsa_jax.pallas import mgpu_gather

WG, VEC = mgpu_gather.WG, mgpu_gather.VEC


def _i32(v):
    return arith.constant(ir.IntegerType.get_signless(32), v)


class _Ops(mgpu_gather.IntOps):
    """`mgpu_gather.chunk_source`'s index arithmetic on i32 MLIR values."""
    const = staticmethod(_i32)
    add = staticmethod(arith.addi)
    mul = staticmethod(arith.muli)
    div = staticmethod(arith.divui)
    rem = staticmethod(arith.remui)


def make_gather_noload(block_w: int, c: int, slots_first: bool = False):
    """`mgpu_gather.make_gather`'s signature; each chunk's 8 bytes are its slot index's bits."""
    del slots_first
    n_el = block_w * c
    lay = mgpu_gather.tile_layout(block_w, c)
    chunks = n_el // (WG * VEC)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((n_el,), jnp.float8_e4m3fn, lay))
    def gather(ctx, slots, lat):
        del ctx, lat
        i64 = ir.IntegerType.get_signless(64)
        v1 = ir.VectorType.get((1,), i64)
        vty = ir.VectorType.get((VEC,), ir.Float8E4M3FNType.get())
        tid = arith.remui(mgpu.utils.thread_idx(), _i32(WG))
        regs = []
        for k in range(chunks):
            row, _ = mgpu_gather.chunk_source(_Ops, tid, k, c)
            slot = memref.load(slots, [arith.index_cast(ir.IndexType.get(), row)])  # i32
            word = vector.broadcast(v1, arith.extui(i64, slot))
            regs.append(vector.bitcast(vty, word))
        return mgpu.FragmentedArray(_registers=np.array(regs, dtype=object).reshape(chunks),
                                    _layout=lay.to_mgpu(), _is_signed=None)

    return gather


def make_store_noop(block_w: int, c: int, swz, row0: int = 0):
    """`mgpu_gather.make_store`'s signature; stores nothing."""
    del row0
    lay = mgpu_gather.tile_layout(block_w, c)

    @plgpu.inline_mgpu(arg_types=(lay, plgpu.RefType(transforms=swz)))
    def store(ctx, x, dst):
        del ctx, x, dst

    return store


@contextlib.contextmanager
def patched(name: str):
    """The diagnostic `name` in force (module attributes of `mgpu_gather` swapped back after)."""
    saved = mgpu_gather.make_gather, mgpu_gather.make_store
    try:
        if name == "diag-noload":
            mgpu_gather.make_gather = make_gather_noload
        elif name == "diag-nostore":
            mgpu_gather.make_store = make_store_noop
        else:
            raise ValueError(f"unknown diagnostic {name!r}")
        yield
    finally:
        mgpu_gather.make_gather, mgpu_gather.make_store = saved


DIAGNOSTICS = ("diag-noload", "diag-nostore")
