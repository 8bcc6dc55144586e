"""H200: a prompt's U_v product (the attended latents [M, H, C] bf16 times each head's U_v
[H, Dv, C], rounded to bf16 for o_proj) by XLA's GEMM (what the layer runs today) and by the
per-head Pallas kernel (`pallas/matmul.py`, bf16 written in the kernel) under several tiles,
at prefill-9000's rows. Each variant is checked against the fp32 product of the same operands
(bound: K * eps32 * sum |v||w| for the accumulation, plus bf16's half ulp for the rounding)
before it is timed.

    PYTHONPATH=. python3 benchmarks/h200_prompt_uv.py --out $OUT
    PYTHONPATH=. python3 benchmarks/h200_prompt_uv.py --smoke --out /tmp/uv   # CPU, interpret

JSON: <out>/h200-prompt-uv.json; one row of `results` per variant.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_script import command, results_path, sweep_parser, utc_now, write_json
from benchmarks.harness import sweep_row, sweep_times
from dsa_jax.pallas import matmul as mm
from dsa_jax.shapes import glm53_flash

# variant -> overrides of `matmul.default_tuning`'s tiles for these rows
VARIANTS = {"default": {},
            "bn256": {"block_n": 256},
            "bm64_bn256": {"block_m": 64, "block_n": 256},
            "bm64_bn256_w4": {"block_m": 64, "block_n": 256, "num_warps": 4},
            "bk128": {"block_k": 128},
            "s4": {"num_stages": 4},
            "bm256": {"block_m": 256},
            "bm64_w4": {"block_m": 64, "num_warps": 4},
            "bm128_bn64": {"block_n": 64},
            "bk32_s5": {"block_k": 32, "num_stages": 5}}


def main(argv=None) -> None:
    ap = sweep_parser("CPU, small shapes, interpret mode", 150.0, "stop starting variants after")
    ap.add_argument("--rows", type=int, default=9000)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args(argv)
    t_end = time.perf_counter() + args.budget_s
    cfg = glm53_flash()
    heads, dv, c = cfg.num_heads, cfg.v_head_dim, cfg.kv_lora_rank
    m = args.rows
    if args.smoke:
        heads, dv, c, m = 4, 32, 64, 70
    kv, kw = jax.random.split(jax.random.PRNGKey(0))
    v = jax.random.normal(kv, (m, heads, c), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (heads, dv, c), jnp.float32) * 0.05).astype(jnp.bfloat16)
    exact = mm.per_head_xla(v.astype(jnp.float32), w.astype(jnp.float32), 2)
    mag = mm.per_head_xla(jnp.abs(v).astype(jnp.float32), jnp.abs(w).astype(jnp.float32), 2)
    bound = np.asarray(c * np.finfo(np.float32).eps * mag
                       + 2.0 ** -8 * jnp.abs(exact))  # + bf16's half ulp (relative 2^-8)
    exact = np.asarray(exact)
    path = results_path(args.out, "h200-prompt-uv.json")
    res = {"command": command("h200_prompt_uv.py", argv), "date": utc_now(),
           "jax_version": jax.__version__, "device": str(jax.devices()[0].device_kind),
           "shape": {"rows": m, "heads": heads, "dv": dv, "c": c},
           "results": [], "errors": []}
    base = mm.default_tuning(dv, c, heads, m)
    for variant in ["xla"] + args.variants:
        if time.perf_counter() > t_end:
            res["errors"].append({"section": variant, "error": "budget"})
            continue
        t = None if variant == "xla" else dataclasses.replace(base, **VARIANTS[variant])
        if variant == "xla":
            fn = jax.jit(lambda v, w: mm.per_head_xla(v, w, 2, out_dtype=jnp.bfloat16))
        else:
            fn = jax.jit(lambda v, w, t=t: mm.per_head_pallas(
                v, w, 2, out_dtype=jnp.bfloat16, tuning=t, interpret=args.smoke))
        row = {"variant": variant, "tuning": None if t is None else dataclasses.asdict(t)}

        def work(row, fn=fn):
            out = np.asarray(fn(v, w).astype(jnp.float32))
            err = np.abs(out - exact)
            row["max_err_over_bound"] = float(np.max(err / np.maximum(bound, 1e-30)))
            row["within_bound"] = bool((err <= bound).all())
            row.update(sweep_times(lambda: fn(v, w), heavy=False))
            nbytes = (v.size + w.size + m * heads * dv) * 2
            if row.get("kernel_us"):
                row["tb_s"] = nbytes / row["kernel_us"] / 1e6
        sweep_row(res, row, work, path)
    write_json(res, path)


if __name__ == "__main__":
    main()
