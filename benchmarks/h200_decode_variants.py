"""H200: the decode step (`decode-b64-k1-tp1`, `decode-b1-k1-tp1` shapes) with this session's
two changes on and off, timed and profiled side by side in one process: the gather-attend on
the call's rows only (`layer.step(..., attend_rows=1)`) and the raw Triton top-k for 16+ rows
(`PoolTopkTuning(backend="auto")` in the layer's `top_pools`; else the default Pallas one);
and every GEMM through cuBLAS (`xla_gpu_enable_triton_gemm=False`) alone and with both.

    PYTHONPATH=. python3 benchmarks/h200_decode_variants.py --out $OUT/variants.json
    PYTHONPATH=. python3 benchmarks/h200_decode_variants.py --smoke --out /tmp/v.json  # CPU
"""

from __future__ import annotations

import argparse
import functools
import hashlib

import jax
import numpy as np

from benchmarks.device_script import command, utc_now, write_json
from benchmarks.harness import measure, profile_step
from benchmarks.workloads import StepRunner, random_hf_tensors, random_weights
from dsa_jax import bitwise_jit, layer, select
from dsa_jax.pallas import pool_topk
from dsa_jax.shapes import glm53_flash, tiny

# name -> (attend_rows cut, Triton top-k for 16+ rows, extra compile options)
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}  # every GEMM through cuBLAS
VARIANTS = {"now": (True, True, None), "before": (False, False, None),
            "cut-only": (True, False, None), "topk-only": (False, True, None),
            "cublas": (False, False, NO_TRITON_GEMM), "all": (True, True, NO_TRITON_GEMM)}


def run(cfg, weights, b: int, ctx: int, name: str, smoke: bool) -> dict:
    cut, triton, options = VARIANTS[name]
    layer.top_pools = functools.partial(select.top_pools, tuning=pool_topk.PoolTopkTuning(
        backend="auto" if triton else "pallas"))
    # A fresh function per variant: the top-k rule is read when the step is traced, and jax
    # reuses one function's trace across jit wrappers (the 20261201-s4 run wrapped layer.step
    # itself: "cut-only" then ran the Triton top-k of "now", "topk-only" the Pallas one).
    @functools.wraps(layer.step)  # its signature, for the static argument names
    def fresh(*args, **kwargs):
        return layer.step(*args, **kwargs)

    step = bitwise_jit(fresh, static_argnames=("cfg", "attend_rows"),
                       donate_argnames=("state",), compiler_options=options)
    runner = StepRunner(cfg, weights, b, 1, cfg.max_verify, ctx - 40, 4242 + b, step=step)
    runner.kwargs = dict(attend_rows=1) if cut else {}
    jax.block_until_ready(runner())
    t = measure(runner, warmup=2, groups=3 if smoke else 10, inner=2 if smoke else 10,
                reset=runner.reset)
    prof = profile_step(runner, 2 if smoke else 8, top=12)
    return {"variant": name, "batch": b, "median_us": t["median_us"], "p10_us": t["p10_us"],
            "p90_us": t["p90_us"], "kernel_us": prof.get("kernel_us_per_step"),
            "launches": prof.get("launches_per_step"), "top": prof.get("top_kernels"),
            "finite": bool(np.isfinite(np.asarray(runner.last[0], np.float32)).all()),
            # the same inputs every call (reset): equal digests = equal bits across variants
            "y_sel_sha1": hashlib.sha1(np.asarray(runner.last[0]).tobytes()
                                       + np.asarray(runner.last[1]).tobytes()).hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batches", type=int, nargs="*", default=[64, 1])
    a = ap.parse_args()
    cfg = (tiny() if a.smoke else glm53_flash()).replace(
        implementation="xla" if a.smoke else "pallas")
    weights = random_weights(cfg, random_hf_tensors(cfg, 0), 1)
    res = {"command": command("h200_decode_variants.py"), "date": utc_now(),
           "device": jax.devices()[0].device_kind, "results": [], "errors": []}
    for b in a.batches:
        for name in VARIANTS:
            try:
                row = run(cfg, weights, 2 if a.smoke else b, cfg.max_context, name, a.smoke)
            except Exception as e:  # recorded, the next variant runs
                row = {"variant": name, "batch": b, "error": f"{type(e).__name__}: {e}"[:500]}
                res["errors"].append(row["error"])
            res["results"].append(row)
            print({k: v for k, v in row.items() if k != "top"}, flush=True)
            write_json(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
