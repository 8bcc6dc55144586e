"""H200: the gather-attend kernel with the next tile's gather issued before this tile's dots
(`prefetch=True`) against the default, checked with `==` and timed, beside the XLA twin.

    PYTHONPATH=. python3 benchmarks/h200_attend_prefetch.py

Writes $OUT/h200-attend-prefetch.json (or ./h200-attend-prefetch.json). Times as
benchmarks/h200_kernels.py (`timed`: 8 copies of the op in one jitted call, median per op).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from h200_kernels import K_REPS, attend_bytes, attend_inputs, copy_bandwidth, timed  # noqa: E402

from dsa_jax.bench import sweep_row  # noqa: E402
from dsa_jax.pallas import sparse_attend as sa  # noqa: E402

# (label, B, R, H, W, ctx): the bench's kernel points (64 rows x 64 heads x 2051; 128 x 2 rows
# x 128 heads x 2048), one batch-1 decode, a 2048-row prompt chunk, TP 8's 8 heads.
CASES = [("b64-h64", 64, 1, 64, 2051, 16384), ("b128r2-h128", 128, 2, 128, 2048, 16384),
         ("b1-h64", 1, 1, 64, 2051, 16384), ("prompt2048-h64", 1, 2048, 64, 2048, 9000),
         ("b64-h8", 64, 1, 8, 2051, 16384)]
VARIANTS = {"default": {}, "prefetch": dict(prefetch=True),
            "prefetch-stages1": dict(prefetch=True, num_stages=1),
            "prefetch-bw16": dict(prefetch=True, block_w=16)}


def main() -> int:
    out = os.path.join(os.environ.get("OUT", "."), "h200-attend-prefetch.json")
    res = {"command": "PYTHONPATH=. python3 benchmarks/h200_attend_prefetch.py",
           "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "jax_version": jax.__version__, "device": jax.devices()[0].device_kind,
           "copy": copy_bandwidth(), "results": [], "errors": []}
    gbps = res["copy"]["GBps"]
    scale = 256 ** -0.5
    for label, b, r, h, w, ctx in CASES:
        key = jax.random.key(b * 7 + h + r)
        base = attend_inputs(key, b, r, h, 512, w, ctx, 64, jnp.float8_e4m3fn)
        qs = [jax.random.normal(jax.random.fold_in(key, i), base[0].shape)
              for i in range(K_REPS)]
        args_list = [(q,) + tuple(base[1:]) for q in qs]
        nbytes, flops = attend_bytes(b, r, h, 512, w), 4 * b * r * h * w * 512
        ref = None
        for name, kw in [("xla", None)] + list(VARIANTS.items()):
            row = {"case": label, "B": b, "R": r, "H": h, "W": w, "variant": name}

            def work(row, kw=kw, args_list=args_list, nbytes=nbytes, flops=flops):
                nonlocal ref
                if kw is None:
                    fn = functools.partial(sa.sparse_attend_xla, softmax_scale=scale)
                else:
                    fn = functools.partial(sa.sparse_attend_pallas, softmax_scale=scale, **kw)
                    got = np.asarray(jax.jit(fn)(*args_list[0]))
                    if ref is None:
                        ref = got  # the default kernel's output
                    row["equal_to_default"] = bool(np.array_equal(got, ref))
                    row["max_abs_vs_default"] = float(np.max(np.abs(got - ref)))
                t = timed(fn, args_list)
                row.update(us=t * 1e6, frac_copy_bw=nbytes / t / 1e9 / gbps,
                           TFLOPs=flops / t / 1e12)

            sweep_row(res, row, work, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
