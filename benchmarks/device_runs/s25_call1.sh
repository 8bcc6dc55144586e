#!/usr/bin/env bash
# Twenty-fifth session, call 1 (H200). No kernel changed since s22 (a61c6f0); the bench's attend
# point now jits the attend over the three arrays it reads. First the bench's kernels group
# (both attend points), then the attend at 64x1 called both ways side by side, interleaved in
# rounds (the host's speed drifts): the whole state pytree (the bench before this change) and
# the three arrays, with the same kernels (the device time of each).
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
export PYTHONPATH=.
timeout 150 python3 -m benchmarks --no-hf --no-progress --only kernels --budget-s 120 --out $OUT --name h200-bench.json 2>&1 | tail -6
timeout 150 python3 - <<'PY'
import functools, json, os
import jax, jax.numpy as jnp, numpy as np
from benchmarks.harness import kernel_us, measure
from benchmarks.workloads import Cycle, attend_inputs
from dsa_jax.attend import attend
from dsa_jax.shapes import glm53_flash
from dsa_jax.state import DsaState
cfg = glm53_flash(implementation="pallas")
st, sets = attend_inputs(cfg, 64, 1, 64, 2051, 16384, 77 + 1 + 64)
whole = jax.jit(functools.partial(attend, cfg))
def arrays_fn(latent, kv_scale, block_tables, q, sel):
    unread = {f: jnp.zeros(getattr(st, f).shape, getattr(st, f).dtype) for f in
              ("index_k", "index_g", "pool_keys", "lengths", "index_lengths")}
    return attend(cfg, DsaState(latent, kv_scale, block_tables, **unread), q, sel)
arrays = jax.jit(arrays_fn)
calls = {"state": Cycle(lambda q, sel: whole(st, q, sel), sets),
         "arrays": Cycle(lambda q, sel: arrays(st.latent, st.kv_scale, st.block_tables, q, sel), sets)}
outs = {k: np.asarray(c()) for k, c in calls.items()}
res = {"command": "benchmarks/device_runs/s25_call1.sh (inline: the attend 64x1 called two ways)",
       "device": str(jax.devices()[0]), "jax_version": jax.__version__,
       "same_bits": bool((outs["state"] == outs["arrays"]).all()), "rounds": []}
for r in range(5):
    row = {}
    for k, c in calls.items():
        row[k] = measure(c, warmup=3, groups=20, inner=10)["median_us"]
    res["rounds"].append(row)
for k, c in calls.items():
    res[f"{k}_median_us"] = float(np.median([row[k] for row in res["rounds"]]))
    res[f"{k}_kernel_us"] = kernel_us(c)
json.dump(res, open(os.path.join(os.environ["OUT"], "h200-attend-call.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "rounds"}))
print(res["rounds"])
PY
