"""H200: the Mosaic attend writing a prompt's result in the caller's dtype itself
(`MgpuTuning.direct_out`, one split per row) beside the f32 partial and the merge kernel's cast
(`direct_out=False`), on the prompt chunk of `h200_attend.py` (1 x 2048 rows, 64 heads, 2051
slots, GLM-5.3-Flash's C) with a bf16 result, as a prefill's layer asks for it.

    PYTHONPATH=. python3 benchmarks/h200_direct_out.py --out $OUT/h200-direct-out.json
    PYTHONPATH=. python3 benchmarks/h200_direct_out.py --smoke --out /tmp/d.json  # CPU: xla

Checks the two results bitwise (`==` of their bit patterns) and times each (wall of back-to-back
calls and kernel time, `harness.sweep_times`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_script import header, json_parser, write_json
from benchmarks.harness import sweep_times
from benchmarks.workloads import attend_inputs
from dsa_jax.pallas import mgpu_plan
from dsa_jax.pallas import sparse_attend as sa
from dsa_jax.shapes import glm53_flash, tiny


def main(argv: list[str] | None = None) -> int:
    args = json_parser(__doc__).parse_args(argv)
    cfg = tiny() if args.smoke else glm53_flash()
    rows, w = (8, cfg.sel_width) if args.smoke else (2048, 2051)
    st, sets = attend_inputs(cfg, 1, rows, cfg.num_heads, w, cfg.max_context, 11)
    q, sel = sets[0]
    res = {**header("h200_direct_out.py", argv), "rows": [], "errors": []}
    outs = {}
    for direct in (True, False):
        backend = "triton" if args.smoke else "mosaic"
        tuning = sa.AttendTuning(backend, mosaic=mgpu_plan.MgpuTuning(design="flashmla",
                                                                      direct_out=direct))
        fn = jax.jit(functools.partial(
            sa.sparse_attend_pallas, softmax_scale=cfg.qk_nope_head_dim ** -0.5,
            tuning=tuning, out_dtype=jnp.bfloat16, interpret=args.smoke))

        def call(fn=fn):
            return fn(q, st.latent, st.kv_scale, st.block_tables, sel)

        outs[direct] = np.asarray(call().astype(jnp.float32))
        res["rows"].append({"direct_out": direct, **sweep_times(call, heavy=True,
                                                                 heavy_inner=3)})
        print(res["rows"][-1], flush=True)
        write_json(res, args.out)
    bits = {d: o.view(np.uint32) for d, o in outs.items()}
    res["bitwise_equal"] = bool(np.array_equal(bits[True], bits[False]))
    res["finite"] = bool(np.isfinite(outs[True]).all())
    print("bitwise_equal", res["bitwise_equal"], "finite", res["finite"], flush=True)
    write_json(res, args.out)
    return 0 if res["bitwise_equal"] and res["finite"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
