"""H200: a prompt's absorbed query as the Mosaic attend takes it (`MgpuTuning.bound_scales`),
made by the Pallas kernel `scaled_q_abs_pallas` (q read once, the f16 result and its scale
written) beside XLA's forms, at prefill-9000's rows (9000 x 64 heads, GLM-5.3-Flash's Dn and C):

* `per_head_xla`: the f32 q_abs the default path writes (the prep then reads it back);
* `scaled_q_abs_xla`: the definition (the power of two on the GEMM's input, an f16 result);
* the kernel at several tilings, from f32 q and from q already in bf16;
* with the q_b GEMM in front (x @ q_proj^T), q handed over in f32 or converted to bf16 first.

    PYTHONPATH=. python3 benchmarks/h200_scaled_q.py --out $OUT/h200-scaled-q.json
    PYTHONPATH=. python3 benchmarks/h200_scaled_q.py --smoke --out /tmp/s.json  # CPU: interpret

Every kernel variant is checked against the definition first: 2^-k equal, and each f16 value
within one f16 spacing plus the K-term fp32 summation bound (2 K 2^-24 sum |q 2^k| |u|).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_script import header, json_parser, write_json
from benchmarks.harness import sweep_times
from dsa_jax.pallas import matmul
from dsa_jax.pallas import scaled_q_abs as sqa
from dsa_jax.shapes import glm53_flash, tiny

M128 = dict(block_m=128, block_n=256)  # the tiles of f32 rows (sqa.F32_TILES)
TILINGS = {  # name -> ScaledQAbsTuning fields (the first: the library's default); the others
    # of h200-scaled-q-20261202-s15-call{2,3}.json were slower
    "default": dict(),
    "m128-n256-w8-s3": dict(squares_apart=False, **M128),
    "apart m128-n256-w8-s3": dict(squares_apart=True, **M128),
    "apart m64-n256-w4-s3": dict(squares_apart=True, block_m=64, block_n=256, num_warps=4),
}
# --bf16-sweep: the apart form (the default for bf16 rows) at other tiles, bf16 rows only
# (h200-scaled-q-20261202-s16-call1.json: m128-n256-w8-s3 708.7 us, m64-n256-w4-s3 984.3;
# s16-call3: m64-n512-w8-s3, since the default for bf16 rows, 642.6)
BF16_TILINGS = {
    "apart m64-n512-w8-s3": dict(),
    "apart m128-n256-w8-s3": dict(**M128),
    "apart m128-n256-w8-s4": dict(num_stages=4, **M128),
    "apart m128-n256-k128-w8-s2": dict(block_k=128, num_stages=2, **M128),
    "apart m128-n256-k32-w8-s4": dict(block_k=32, num_stages=4, **M128),
    "apart m64-n512-w8-s2": dict(num_stages=2),
    "apart m64-n512-w16-s3": dict(num_warps=16),
    "apart m128-n512-w16-s2": dict(block_m=128, num_warps=16, num_stages=2),
    "apart m256-n256-w16-s2": dict(block_m=256, block_n=256, num_warps=16, num_stages=2),
}
# --amax: the power of two from the result's own amax (scale="amax": no squares loop) beside
# the default (bound, apart), bf16 rows; each checked against its own scale's definition.
AMAX_TILINGS = {
    "apart m64-n512-w8-s3 (default)": dict(),
    "amax m64-n512-w8-s3": dict(scale="amax"),
    "amax m64-n512-w8-s4": dict(scale="amax", num_stages=4),
    "amax m64-n512-k128-w8-s2": dict(scale="amax", block_k=128, num_stages=2),
    "amax m64-n512-k32-w8-s4": dict(scale="amax", block_k=32, num_stages=4),
    "amax m64-n512-w16-s3": dict(scale="amax", num_warps=16),
    "amax m128-n512-w16-s2": dict(scale="amax", block_m=128, num_warps=16, num_stages=2),
}


def check(got, want, q, u, scale: str = "bound") -> dict:
    """The kernel's (q16, down) against the definition's of its `scale`: "bound": down equal
    and q16 within the bound; "amax": down equal but where the two f32 amaxes straddle a
    power of two (one binade apart: `moved`, counted), each value unscaled within one f16
    spacing at each side's scale plus the sums' bound (tests/test_scaled_q_abs.py's rule)."""
    (g16, gd), (w16, wd) = got, want
    qs = jnp.abs(q.astype(u.dtype).astype(jnp.float32))
    s = jax.lax.dot_general(qs, jnp.abs(u.astype(jnp.float32)), (((2,), (1,)), ((1,), (0,))),
                            precision=jax.lax.Precision.HIGHEST)  # [H, M, C] unscaled
    s = np.asarray(jnp.swapaxes(s, 0, 1))
    g, w = (np.asarray(x.astype(jnp.float32)) for x in (g16, w16))
    gd, wd = np.asarray(gd)[..., None], np.asarray(wd)[..., None]  # [M, H, 1]
    spacing = lambda x: np.spacing(np.abs(x).astype(np.float16)).astype(np.float32)  # noqa
    tol = spacing(w) * wd + spacing(g) * gd + 2 * q.shape[-1] * 2.0 ** -24 * s
    err = np.abs(g * gd - w * wd)
    moved = gd != wd
    ratio_ok = bool(np.isin((gd / wd)[moved], (0.5, 2.0)).all())
    return {"down_equal": bool(not moved.any()) if scale == "bound" else ratio_ok,
            "moved": int(moved.sum()),
            "within": bool((err <= tol).all()), "max_err": float(err.max()),
            "mismatches": int((g != w).sum()), "finite": bool(np.isfinite(g).all()),
            # amax: a value just below 2^14 may round up to it (as the decode prep's)
            "below_2_14": bool((np.abs(g) < 2.0 ** 14).all() if scale == "bound" else
                               (np.abs(g) <= 2.0 ** 14).all())}


def main(argv: list[str] | None = None) -> int:
    ap = json_parser(__doc__)
    ap.add_argument("--bf16-sweep", action="store_true",
                    help="only BF16_TILINGS on bf16 rows (no q_b GEMM rows)")
    ap.add_argument("--amax", action="store_true",
                    help="only AMAX_TILINGS on bf16 rows (no q_b GEMM rows)")
    args = ap.parse_args(argv)
    cfg = tiny() if args.smoke else glm53_flash()
    m = 40 if args.smoke else 9000
    h, dn, c, r = cfg.local_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    rng = np.random.default_rng(5)
    u = jnp.asarray(rng.standard_normal((h, dn, c)) * dn ** -0.5, jnp.bfloat16)
    w_q = jnp.asarray(rng.standard_normal((h * dn, r)) * r ** -0.5, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, r)), jnp.bfloat16)  # the q_a norm's output
    q = matmul.matmul_xla(x, w_q).reshape(m, h, dn)  # [M, H, Dn] f32
    interp = args.smoke
    res = {**header("h200_scaled_q.py", argv), "rows": [], "errors": [], "m": m}
    want = jax.jit(sqa.scaled_q_abs_xla)(q, u)

    def row(name, fn, *operands, checked=None, scale="bound"):
        call = functools.partial(fn, *operands)
        out = call()
        entry = {"variant": name}
        if checked is not None:
            ref = want if scale == "bound" else want_amax
            entry.update(check(out, ref, q, u, scale))
        entry.update(sweep_times(call, heavy=True, heavy_inner=3))
        res["rows"].append(entry)
        print(entry, flush=True)
        write_json(res, args.out)
        return entry

    row("per_head_xla (f32 q_abs)", jax.jit(lambda q, u: matmul.per_head_xla(q, u, 1)), q, u)
    row("scaled_q_abs_xla", jax.jit(sqa.scaled_q_abs_xla), q, u)
    ok = True
    qb = q.astype(jnp.bfloat16)
    want_amax = jax.jit(functools.partial(sqa.scaled_q_abs_xla, scale="amax"))(q, u)
    if args.bf16_sweep or args.amax:
        tilings = AMAX_TILINGS if args.amax else BF16_TILINGS
        for name, fields in tilings.items():
            fn = jax.jit(functools.partial(sqa.scaled_q_abs_pallas, interpret=interp,
                                           tuning=sqa.ScaledQAbsTuning(**fields)))
            try:
                e = row(f"kernel {name}, q bf16", fn, qb, u, checked=True,
                        scale=fields.get("scale", "bound"))
            except Exception as err:  # noqa: BLE001 (a tiling the compiler refuses: recorded)
                res["errors"].append(f"{name} q bf16: {str(err)[:300]}")
                print("error", name, str(err)[:200], flush=True)
                continue
            ok &= e["down_equal"] and e["within"]
            if args.smoke and not args.amax:
                break
        res["all_checked"] = bool(ok)
        res["tunings"] = {k: dataclasses.asdict(sqa.ScaledQAbsTuning(**v)) for k, v in
                          tilings.items()}
        write_json(res, args.out)
        return 0 if ok else 1
    for name, fields in TILINGS.items():
        t = sqa.ScaledQAbsTuning(**fields)
        fn = jax.jit(functools.partial(sqa.scaled_q_abs_pallas, tuning=t, interpret=interp))
        for dt, qq in (("f32", q), ("bf16", qb)):
            try:
                e = row(f"kernel {name}, q {dt}", fn, qq, u, checked=True)
            except Exception as err:  # noqa: BLE001 (a tiling the compiler refuses: recorded)
                res["errors"].append(f"{name} q {dt}: {str(err)[:300]}")
                print("error", name, dt, str(err)[:200], flush=True)
                continue
            ok &= e["down_equal"] and e["within"]
        if args.smoke:
            break

    def with_qb(x, w_q, u, bf16):  # the q_b GEMM in front, q handed over in f32 or bf16
        qq = matmul.matmul_xla(x, w_q).reshape(m, h, dn)
        return sqa.scaled_q_abs_pallas(qq.astype(jnp.bfloat16) if bf16 else qq, u,
                                       interpret=interp)

    for bf16 in (False, True):
        row(f"q_b GEMM + kernel, q {'bf16' if bf16 else 'f32'}",
            jax.jit(functools.partial(with_qb, bf16=bf16)), x, w_q, u)

    def qb_bf16(x, w_q):  # the q_b GEMM writing bf16 itself (fp32 accumulation, one rounding)
        return jnp.einsum("mi,oi->mo", x, w_q, preferred_element_type=jnp.bfloat16)

    def with_qb_out(x, w_q, u):  # the kernel reading the bf16 q as it is (squares_apart)
        return sqa.scaled_q_abs_pallas(qb_bf16(x, w_q).reshape(m, h, dn), u, interpret=interp,
                                       squares_apart=True)

    row("q_b GEMM (bf16 out) + kernel (apart)", jax.jit(with_qb_out), x, w_q, u)
    row("q_b GEMM alone (f32 q)", jax.jit(lambda x, w: matmul.matmul_xla(x, w)), x, w_q)
    row("q_b GEMM alone (bf16 out)", jax.jit(qb_bf16), x, w_q)
    ref = jax.jit(lambda x, w: matmul.matmul_xla(x, w).astype(jnp.bfloat16))(x, w_q)
    res["qb_bf16_out_equals_rounded_f32"] = bool(np.array_equal(
        np.asarray(jax.jit(qb_bf16)(x, w_q)).view(np.uint16), np.asarray(ref).view(np.uint16)))
    print("qb_bf16_out_equals_rounded_f32", res["qb_bf16_out_equals_rounded_f32"], flush=True)
    res["all_checked"] = bool(ok)  # every variant that compiled
    res["tunings"] = {k: dataclasses.asdict(sqa.ScaledQAbsTuning(**v)) for k, v in
                      TILINGS.items()}
    write_json(res, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
