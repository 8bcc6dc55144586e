"""H200: the decode step (`decode-b64-k1-tp1`, `decode-b1-k1-tp1` shapes) in variants, timed
and profiled side by side in one process, each traced afresh: "now" (the library: the
gather-attend on the call's rows, `attend_rows=1`), "before" (every padded row attended),
"topk" (now + the raw Triton top-k for 16+ rows, `PoolTopkTuning(backend="triton")`), "cublas"
(now + every GEMM through cuBLAS, `xla_gpu_enable_triton_gemm=False`), "headmajor" (now with
the attended latents laid out head-major for the `U_v` GEMM: a lever under test, below),
"autotune0" (now with GEMM autotuning off), "cublas0" (every GEMM through cuBLAS's heuristic
algorithm: the serving loop's options), and the earlier defaults named in `VARIANTS`.
A digest of y and sel per variant: equal digests are equal bits.

    PYTHONPATH=. python3 benchmarks/h200_decode_variants.py --out $OUT/variants.json
    PYTHONPATH=. python3 benchmarks/h200_decode_variants.py --smoke --out /tmp/v.json  # CPU
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dsa_jax.attend
from benchmarks.device_script import command, utc_now, write_json
from benchmarks.h200_scan_check import glue_patch
from benchmarks.harness import measure, profile_step
from benchmarks.workloads import StepRunner, random_hf_tensors, random_weights
from dsa_jax import bitwise_jit, layer, projection, select
from dsa_jax.implementation import resolve
from dsa_jax.pallas import pool_topk
from dsa_jax.shapes import glm53_flash, tiny

# name -> (attend_rows cut, Triton top-k for 16+ rows, extra compile options, the
#          `layer.attend_first_rows` / `layer.output_projection` pair (None: the library's),
#          glue patch of benchmarks/h200_scan_check.py or None)
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}  # every GEMM through cuBLAS
VARIANTS = {"now": (True, False, None, None, None), "before": (False, False, None, None, None),
            "topk": (True, True, None, None, None),
            "cublas": (True, False, NO_TRITON_GEMM, None, None),
            "headmajor": (True, False, None, "head_major", None),
            # The Mosaic attend's split merge, which XLA fused into the pad's concatenate (30.6
            # us at b64, h200-decode-variants-20261201-s4-headmajor.json), kept a fusion of its
            # own (barriers) or run as the Pallas merge kernel: the merge then took ~5 us and
            # the pad alone still 30.6 (h200-decode-variants-20261201-s4-merge.json).
            "mergebarrier": (True, False, None, None, "merge_barrier"),
            "mergepallas": (True, False, None, None, "merge_pallas"),  # Mosaic: default since s5
            # The pad as a concatenate (the default before 20261201-s5: the fill and in-place
            # update of "now" took 14 us less at b64, the same bits,
            # h200-decode-variants-20261201-s5-padfill.json).
            "padconcat": (True, False, None, "pad_concat", None),
            # The fill and in-place update in jnp after the merge (the default of 20261201-s5;
            # now the Mosaic path's merge kernel writes the padded bf16 block itself).
            "padfill": (True, False, None, "pad_fill", None),
            # GEMM autotuning off (cuBLAS's heuristic algorithm per shape, as the serving loop
            # compiles): the single step's bits then should not depend on the process (two
            # processes picked two algorithms for one GEMM: h200-decode-kernels-20261201-s6.json).
            "autotune0": (True, False, {"xla_gpu_autotune_level": 0}, None, None),
            # Every GEMM through cuBLAS, its heuristic algorithm (the serving loop's options):
            # autotuning off alone leaves XLA's Triton GEMMs on default tiles, ~5x slower at
            # b1 in a fresh process (h200-decode-variants-20261201-s7-autotune0-p2.json).
            "cublas0": (True, False, {**NO_TRITON_GEMM, "xla_gpu_autotune_level": 0}, None,
                        None),
            # The row-invariant GEMMs (cfg.gemm = "pallas", pallas/matmul.py): the decode runs
            # its one row per sequence instead of max_verify (`layer.decode_rows`).
            "rowgemm": (True, False, None, None, None)}
CFG_CHANGES = {"rowgemm": {"gemm": "pallas"}}  # variant -> config fields it changes


def attend_first_rows_head_major(cfg, state, q_abs, sel, valid, live, rows, dtype=jnp.float32):
    """Lever under test: `layer.attend_first_rows` laid out `[Hl, B, R, C]`, the layout the
    per-head `U_v` GEMM batches over, so that the padding needs no transposing copy (the
    default's pad fusion: 30.6 us at b64, h200-decode-variants-20261201-s4.json)."""
    r = q_abs.shape[1]
    o = dsa_jax.attend.attend(cfg, state, q_abs[:, :rows], sel[:, :rows], live)  # [B, k, Hl, C]
    o = jnp.transpose(o.astype(dtype), (2, 0, 1, 3))  # [Hl, B, k, C]
    rest = jnp.where(valid[None, :, rows:, None], jnp.nan, 0.0).astype(dtype)  # [1, B, R-k, 1]
    rest = jnp.broadcast_to(rest, (o.shape[0], o.shape[1], r - rows, o.shape[3]))
    return jnp.concatenate([o, rest], axis=2)  # [Hl, B, R, C]


def output_projection_head_major(weights, o):
    """`projection.output_projection` of `o [Hl, B, R, C]`: the same dots."""
    h, b, r, c = o.shape
    out = lax.dot_general(o.reshape(h, b * r, c).astype(weights.u_v.dtype), weights.u_v,
                          (((2,), (2,)), ((0,), (0,))), precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)  # [Hl, B*R, Dv]
    o = jnp.swapaxes(out, 0, 1).reshape(b, r, -1)  # [B, R, Hl*Dv]
    return projection.matmul(o, weights.o_proj)  # [B, R, D]


def attend_first_rows_pad_concat(cfg, state, q_abs, sel, valid, live, rows, dtype=jnp.float32):
    """`layer.attend_first_rows` before 20261201-s5: the padding concatenated after the attended
    rows (0, or NaN for a real row past the promise)."""
    r = q_abs.shape[1]
    o = dsa_jax.attend.attend(cfg, state, q_abs[:, :rows], sel[:, :rows], live)  # [B, k, Hl, C]
    o = o.astype(dtype)
    rest = jnp.where(valid[:, rows:, None, None], jnp.nan, 0.0).astype(dtype)  # [B, R-k, 1, 1]
    rest = jnp.broadcast_to(rest, (o.shape[0], r - rows, *o.shape[2:]))  # [B, R-k, Hl, C]
    return jnp.concatenate([o, rest], axis=1)


def attend_first_rows_pad_fill(cfg, state, q_abs, sel, valid, live, rows, dtype=jnp.float32):
    """`layer.attend_first_rows` of 20261201-s5 (the cut path): the merged f32 rows, then a
    fill of the whole block and an in-place update in jnp."""
    r = q_abs.shape[1]
    if resolve(cfg.implementation) == "xla":  # "xla" never cuts
        return dsa_jax.attend.attend(cfg, state, q_abs, sel, live).astype(dtype)
    if rows is None or rows >= r:
        return lax.optimization_barrier(
            dsa_jax.attend.attend(cfg, state, q_abs, sel, live).astype(dtype))
    o = dsa_jax.attend.attend(cfg, state, q_abs[:, :rows], sel[:, :rows], live)  # [B, k, Hl, C]
    past = valid & (jnp.arange(r) >= rows)  # [B, R]
    fill = jnp.where(past[:, :, None, None], jnp.nan, 0.0).astype(dtype)  # [B, R, 1, 1]
    block = jnp.broadcast_to(fill, (o.shape[0], r, *o.shape[2:]))  # [B, R, Hl, C]
    block = lax.dynamic_update_slice(block, o.astype(dtype), (0, 0, 0, 0))
    return lax.optimization_barrier(block)


PAIRS = {None: (layer.attend_first_rows, layer.output_projection),
         "pad_fill": (attend_first_rows_pad_fill, layer.output_projection),
         "head_major": (attend_first_rows_head_major, output_projection_head_major),
         "pad_concat": (attend_first_rows_pad_concat, layer.output_projection)}


def run(cfg, weights, b: int, ctx: int, name: str, smoke: bool,
        hlo_dir: str | None = None, top: int = 12, k: int = 1) -> dict:
    with glue_patch(VARIANTS[name][4]):  # traced (and lowered) inside the patch
        return _run(cfg, weights, b, ctx, name, smoke, hlo_dir, top, k)


def _run(cfg, weights, b: int, ctx: int, name: str, smoke: bool, hlo_dir: str | None,
         top: int, k: int = 1) -> dict:
    """One variant's step at b sequences: a decode (k = 1) or a k-row verify, on the rows
    `decode` / `decode_k` run (`layer.decode_rows`)."""
    cut, triton, options, pair, _ = VARIANTS[name]
    cfg = cfg.replace(**CFG_CHANGES.get(name, {}))
    layer.attend_first_rows, layer.output_projection = PAIRS[pair]
    # the variant's rule, explicit (the library's "auto" moved to a prompt's 2048+ rows)
    layer.top_pools = functools.partial(select.top_pools, tuning=pool_topk.PoolTopkTuning(
        backend="triton" if triton and b * k >= 16 else "pallas"))
    # A fresh function per variant: the top-k rule is read when the step is traced, and jax
    # reuses one function's trace across jit wrappers (the 20261201-s4 run wrapped layer.step
    # itself: "cut-only" then ran the Triton top-k of "now", "topk-only" the Pallas one).
    @functools.wraps(layer.step)  # its signature, for the static argument names
    def fresh(*args, **kwargs):
        return layer.step(*args, **kwargs)

    step = bitwise_jit(fresh, static_argnames=("cfg", "attend_rows"),
                       donate_argnames=("state",), compiler_options=options)
    runner = StepRunner(cfg, weights, b, k, layer.decode_rows(cfg, "decode" if k == 1 else
                                                             "verify"), ctx - 40, 4242 + b,
                        step=step)
    runner.kwargs = dict(attend_rows=k) if cut else {}
    jax.block_until_ready(runner())
    t = measure(runner, warmup=2, groups=3 if smoke else 10, inner=2 if smoke else 10,
                reset=runner.reset)
    prof = profile_step(runner, 2 if smoke else 8, top=top)
    if hlo_dir:  # the compiled program, to read its fusions
        args = (cfg, weights, runner.state, runner.xs[0], runner.n_new, None)
        text = step.lower(*args, **runner.kwargs).compile().as_text()
        with open(os.path.join(hlo_dir, f"{name}-b{b}.hlo.txt"), "w") as f:
            f.write(text)
    return {"variant": name, "batch": b, "k": k, "median_us": t["median_us"], "p10_us": t["p10_us"],
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
    ap.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--hlo-dir", help="write each variant's compiled HLO (first batch) here")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    ap.add_argument("--k", type=int, default=1, help="rows per sequence (1: decode; more: a "
                    "K-row verify)")
    a = ap.parse_args()
    cfg = (tiny() if a.smoke else glm53_flash()).replace(
        implementation="xla" if a.smoke else "pallas")
    weights = random_weights(cfg, random_hf_tensors(cfg, 0), 1)
    res = {"command": command("h200_decode_variants.py"), "date": utc_now(),
           "device": jax.devices()[0].device_kind, "results": [], "errors": []}
    for b in a.batches:
        for name in a.variants:
            try:
                row = run(cfg, weights, 2 if a.smoke else b, cfg.max_context, name, a.smoke,
                          a.hlo_dir if b == a.batches[0] else None, a.top, a.k)
            except Exception as e:  # recorded, the next variant runs
                row = {"variant": name, "batch": b, "error": f"{type(e).__name__}: {e}"[:500]}
                res["errors"].append(row["error"])
            res["results"].append(row)
            print({k: v for k, v in row.items() if k != "top"}, flush=True)
            write_json(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
