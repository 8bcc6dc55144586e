"""Register gather of fp8 latent rows and their f16 store, for the Mosaic GPU attend kernel's
converting warpgroup (`sparse_attend_mgpu`), as inline Mosaic GPU code.

Pallas' Lane-level loads take one array per call from a sliced ref, so a tile of rows chosen
by index cannot be loaded into registers with them; `plgpu.inline_mgpu` gives the per-thread
loads. The warpgroup reads a tile's rows straight from the cache into registers (`gather`:
thread `tid` of 128 holds 8-byte chunks `k * 128 + tid` of the tile, so a warp reads 256
contiguous bytes of a row per load), converts them e4m3 -> f16 and writes the swizzled f16
tile that the wgmma reads (`store`). No fp8 staging buffer: its shared memory holds a second
f16 tile instead, so the conversion stays off the softmax warpgroup's critical path.

An empty slot (-1) yields zeros without any load (a branch per chunk), so no cache row
outside the selection is read.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, scf, vector

VEC = 8  # fp8 elements per chunk: one 8-byte load, one 16-byte f16 store
WG = 128  # threads of a warpgroup


class IntOps:
    """Index arithmetic on Python ints (tests model the kernel's placement with it)."""
    const = staticmethod(lambda v: v)
    add = staticmethod(lambda a, b: a + b)
    mul = staticmethod(lambda a, b: a * b)
    div = staticmethod(lambda a, b: a // b)
    rem = staticmethod(lambda a, b: a % b)
    xor = staticmethod(lambda a, b: a ^ b)


class _MlirOps:
    """The same on i32 MLIR values (unsigned: every index is >= 0)."""
    const = staticmethod(lambda v: arith.constant(ir.IntegerType.get_signless(32), v))
    add = staticmethod(arith.addi)
    mul = staticmethod(arith.muli)
    div = staticmethod(arith.divui)
    rem = staticmethod(arith.remui)
    xor = staticmethod(arith.xori)


def chunk_source(o, tid, k, c):
    """Thread tid's k-th chunk of a tile -> (row, first column) of the [block_w, c] rows."""
    f = o.add(o.const(k * WG), tid)
    per_row = o.const(c // VEC)
    return o.div(f, per_row), o.mul(o.rem(f, per_row), o.const(VEC))


def chunk_place(o, row, col, c):
    """(row, first column) -> index of the chunk in the f16 tile ref, tiled (8, 64) as
    [2 halves, rows / 8, half / 64, 8, 64] and 128-byte swizzled: the 16-byte chunk index
    within a 64-column tile row is XORed with the row's index within its 8-row tile."""
    half = o.const(c // 2)
    h, hc = o.div(col, half), o.rem(col, half)
    ri = o.rem(row, o.const(8))
    q = o.div(o.rem(hc, o.const(64)), o.const(VEC))
    return (h, o.div(row, o.const(8)), o.div(hc, o.const(64)), ri,
            o.mul(o.xor(q, ri), o.const(VEC)))


def _i32(v):
    return _MlirOps.const(v)


def _idx(v):
    return arith.index_cast(ir.IndexType.get(), v)


def _i64t():
    return ir.IntegerType.get_signless(64)


def _i64(v):  # an i32 index >= 0 -> i64 (byte offsets past 2^31 in a large cache)
    return arith.extui(_i64t(), v)


def _ptr(ref, elem_offset, elem_type):
    """Pointer to element `elem_offset` (i64) of ref's flat storage, counted in elem_type.
    Loads and stores go through llvm with their true alignment (vector.load assumes the
    element's, which splits an 8-byte fp8 load into bytes)."""
    return mgpu.utils.getelementptr(mgpu.utils.memref_ptr(ref), [elem_offset], elem_type)


def _tid():
    return arith.remui(mgpu.utils.thread_idx(), _i32(WG))


def tile_layout(block_w: int, c: int):
    """The register layout of one gathered tile: [block_w * c] flat, 8 elements a chunk."""
    return plgpu.Layout.WG_STRIDED((block_w * c,), vec_size=VEC)


def make_gather(block_w: int, c: int):
    """gather(slots [block_w] i32 ref, latent [NS, C] fp8 GMEM ref) -> the tile's rows, fp8
    [block_w * C] in `tile_layout` (row-major; rows of empty slots are zeros). Every chunk's
    slot index is loaded before the first row load, so the branches wait on registers, not on
    one index load each. block_w * C a multiple of 128 * 8 (whole chunks per thread)."""
    n_el = block_w * c
    lay = tile_layout(block_w, c)
    chunks = n_el // (WG * VEC)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((n_el,), jnp.float8_e4m3fn, lay))
    def gather(ctx, slots, lat):
        del ctx
        f8 = ir.Float8E4M3FNType.get()
        i8 = ir.IntegerType.get_signless(8)
        vty = ir.VectorType.get((VEC,), f8)
        ity = ir.VectorType.get((VEC,), i8)  # fp8 moves as bytes (LLVM has no fp8 type)
        zeros = arith.constant(ity, ir.DenseElementsAttr.get_splat(ity, ir.IntegerAttr.get(i8, 0)))
        tid = _tid()
        regs = []
        places = [chunk_source(_MlirOps, tid, k, c) for k in range(chunks)]
        first = [memref.load(slots, [_idx(row)]) for row, _ in places]
        for k in range(chunks):
            row, col = places[k]
            slot = first[k]  # i32
            live = arith.cmpi(arith.CmpIPredicate.sge, slot, _i32(0))
            branch = scf.IfOp(live, [ity], has_else=True)  # bytes through the branch
            with ir.InsertionPoint(branch.then_block):
                off = arith.addi(arith.muli(_i64(slot), arith.constant(_i64t(), c)), _i64(col))
                scf.yield_([llvm.load(ity, _ptr(lat, off, i8), alignment=VEC)])
            with ir.InsertionPoint(branch.else_block):
                scf.yield_([zeros])
            regs.append(vector.bitcast(vty, branch.result))
        return mgpu.FragmentedArray(_registers=np.array(regs, dtype=object).reshape(chunks),
                                    _layout=lay.to_mgpu(), _is_signed=None)

    return gather


def make_store(block_w: int, c: int, swz, row0: int = 0):
    """store(tile, dst): tile from `make_gather`; dst the f16 [2, rows, C/2] shared ref
    (column halves, as the wgmma reads them), tiled (8, 64) and 128-byte swizzled as `swz`;
    the tile's block_w rows land at rows row0.. (a multiple of 8)."""
    assert row0 % 8 == 0, row0
    lay = tile_layout(block_w, c)
    chunks = block_w * c // (WG * VEC)

    @plgpu.inline_mgpu(arg_types=(lay, plgpu.RefType(transforms=swz)))
    def store(ctx, x, dst):
        del ctx
        y = x.astype(ir.F16Type.get())  # cvt.rn.f16x2.e4m3x2: exact (e4m3 is a subset of f16)
        tid = _tid()
        regs = list(y.registers.flat)
        assert len(regs) == chunks, (len(regs), chunks)
        strides, _ = ir.MemRefType(dst.type).get_strides_and_offset()
        f16 = ir.F16Type.get()
        for k, reg in enumerate(regs):
            row, col = chunk_source(_MlirOps, tid, k, c)
            place = chunk_place(_MlirOps, _MlirOps.add(row, _MlirOps.const(row0)), col, c)
            off = _MlirOps.const(0)
            for i, st in zip(place, strides, strict=True):
                off = arith.addi(off, arith.muli(i, _MlirOps.const(st)))
            llvm.store(reg, _ptr(dst, _i64(off), f16), alignment=2 * VEC)  # 16 bytes

    return store
