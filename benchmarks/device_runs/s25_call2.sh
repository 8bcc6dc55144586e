#!/usr/bin/env bash
# Twenty-fifth session, call 2 (H200). First the bench's kernels group on the committed bench
# (the attend point on the whole state again, as before call 1). Then what limits the Mosaic
# attend kernel at 64x1 (h64, w2051), with data alone (the kernel unchanged): its kernel time
# with the random selection of the bench, every slot the same token (each row load an L1/L2
# hit), the newest 2051 tokens in order (block-contiguous rows), and every slot empty but the
# last (the kernel still runs all 33 tiles of every row, converting zeros: no row is loaded).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
export PYTHONPATH=.
timeout 150 python3 -m benchmarks --no-hf --no-progress --only kernels --budget-s 120 --out $OUT --name h200-bench.json 2>&1 | tail -5
timeout 200 python3 - <<'PY'
import functools, json, os
import jax, numpy as np
from benchmarks.harness import profile
from benchmarks.workloads import Cycle, attend_inputs
from dsa_jax.attend import attend
from dsa_jax.shapes import glm53_flash
cfg = glm53_flash(implementation="pallas")
ctx, w = 16384, 2051
st, sets = attend_inputs(cfg, 64, 1, 64, w, ctx, 77 + 1 + 64)
fn = jax.jit(functools.partial(attend, cfg))
q, sel = sets[0]
shape = sel.shape
empty = np.full(shape, -1, np.int32)
empty[..., -1] = ctx - 1
variants = {"random": sel,
            "same-token": np.full(shape, ctx - 1, np.int32),
            "newest-in-order": np.broadcast_to(np.arange(ctx - w, ctx, dtype=np.int32), shape).copy(),
            "empty-but-last": empty}
ref = np.asarray(fn(st, q, jax.device_put(variants["random"])))
res = {"command": "benchmarks/device_runs/s25_call2.sh (inline: the attend 64x1 kernel's time by selection)",
       "device": str(jax.devices()[0]), "jax_version": jax.__version__, "variants": {}}
for name, s in variants.items():
    s = jax.device_put(s)
    call = Cycle(lambda q, s: fn(st, q, s), [(q, s)])
    out = np.asarray(call())
    p = profile(call, 20, top=6)
    res["variants"][name] = {"finite": bool(np.isfinite(out).all()),
                             "kernel_us": p.get("kernel_us_per_step"),
                             "top": [(k["name"][:60], round(k["us_per_step"], 2)) for k in p.get("top_kernels", [])]}
    print(name, json.dumps(res["variants"][name]))
json.dump(res, open(os.path.join(os.environ["OUT"], "h200-attend-limits.json"), "w"), indent=1)
PY
