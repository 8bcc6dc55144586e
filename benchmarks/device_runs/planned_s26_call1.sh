#!/usr/bin/env bash
# Planned for the next session's first call (the twenty-fifth had no device left for it; H200):
# which side of the Mosaic attend kernel (FlashMLA split) sets its time at 64x1 once memory is
# out of the way (s25 call 2: 39.9 us with no row loaded against 47.4 with the bench's random
# selection, h200-attend-limits-20261204-s25-call2.json). Diagnostic variants, timing only (their outputs are
# wrong by construction), made by replacing `mgpu_gather.make_store` before tracing:
# "no-store" (the converter stores nothing: its gather is dead code, so no conversion and no
# loads either), "store-zeros" (it stores f16 zeros at the same swizzled addresses: no
# conversion, no loads). Each on the random and the empty-but-last selections.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
export PYTHONPATH=.
timeout 300 python3 - <<'PY'
import functools, json, os
import jax, numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm
from jax.experimental.pallas import mosaic_gpu as plgpu
from benchmarks.harness import profile
from benchmarks.workloads import Cycle, attend_inputs
from dsa_jax.attend import attend
from dsa_jax.pallas import mgpu_gather as G
from dsa_jax.shapes import glm53_flash

real_store = G.make_store

def zeros_store(block_w, c, swz, row0=0):
    lay = G.tile_layout(block_w, c)
    chunks = block_w * c // (G.WG * G.VEC)
    @plgpu.inline_mgpu(arg_types=(lay, plgpu.RefType(transforms=swz)))
    def store(ctx, x, dst):
        del ctx, x
        f16 = ir.F16Type.get()
        vty = ir.VectorType.get((G.VEC,), f16)
        z = arith.constant(vty, ir.DenseElementsAttr.get_splat(vty, ir.FloatAttr.get(f16, 0.0)))
        tid = G._tid()
        strides, _ = ir.MemRefType(dst.type).get_strides_and_offset()
        for k in range(chunks):
            row, col = G.chunk_source(G._MlirOps, tid, k, c)
            place = G.chunk_place(G._MlirOps, G._MlirOps.add(row, G._MlirOps.const(row0)), col, c)
            off = G._MlirOps.const(0)
            for i, st in zip(place, strides, strict=True):
                off = arith.addi(off, arith.muli(i, G._MlirOps.const(st)))
            llvm.store(z, G._ptr(dst, G._i64(off), f16), alignment=2 * G.VEC)
    return store

def no_store(block_w, c, swz, row0=0):
    return lambda x, dst: None

cfg = glm53_flash(implementation="pallas")
ctx, w = 16384, 2051
st, sets = attend_inputs(cfg, 64, 1, 64, w, ctx, 77 + 1 + 64)
q, sel = sets[0]
empty = np.full(sel.shape, -1, np.int32)
empty[..., -1] = ctx - 1
data = {"random": sel, "empty-but-last": jax.device_put(empty)}
res = {"command": "benchmarks/device_runs/planned_s26_call1.sh (inline)", "device": str(jax.devices()[0]),
       "jax_version": jax.__version__, "variants": {}}
for vname, maker in (("default", real_store), ("store-zeros", zeros_store), ("no-store", no_store)):
    G.make_store = maker
    fn = jax.jit(functools.partial(attend, cfg))  # a fresh trace under this store
    for dname, s in data.items():
        try:
            call = Cycle(lambda q, s: fn(st, q, s), [(q, s)])
            call()
            p = profile(call, 20, top=4)
            row = {"kernel_us": p.get("kernel_us_per_step"),
                   "top": [(k["name"][:40], round(k["us_per_step"], 2)) for k in p.get("top_kernels", [])]}
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["variants"][f"{vname}/{dname}"] = row
        print(vname, dname, json.dumps(row))
G.make_store = real_store
json.dump(res, open(os.path.join(os.environ["OUT"], "h200-attend-limits2.json"), "w"), indent=1)
PY
