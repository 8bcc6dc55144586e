"""H200: the row-invariant GEMM kernel (pallas/matmul.py) against XLA's GEMMs at the block's
weight shapes (GLM-5.3-Flash, TP 1) and row counts 1, 4, 64, 256: its error against the fp32
product of the same bf16 operands (bound: fp32 accumulation over K of products of magnitude
|v| |w|), whether a row's bits are the same at every M (the kernel's promise: rows of the
M-row product `==` the first rows of the 256-row product), and kernel times side by side.

    PYTHONPATH=. python3 benchmarks/h200_gemm.py --out $OUT
    PYTHONPATH=. python3 benchmarks/h200_gemm.py --smoke --out /tmp/gemm   # CPU, interpret

JSON: <out>/h200-gemm.json; one row of `results` per (GEMM, variant, M).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_script import command, results_path, sweep_parser, utc_now, write_json
from benchmarks.harness import sweep_row, sweep_times
from dsa_jax.pallas import matmul as mm
from dsa_jax.shapes import glm53_flash

ROWS = (1, 4, 64, 256)  # --rows picks some; 256 is always run first (the bits' reference)
COLD_BYTES = 256 * 2 ** 20  # weight copies cycled through with --cold


def gemms(cfg, heads_scale: int = 1) -> dict:
    """name -> (per-head contracting axis or None, weight shape)."""
    r, c, hi, di = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    hl, dn, dv, d = cfg.local_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.hidden_size
    return {"x_proj": (None, (r + c + 2 * di + hi, d)), "x_proj_shared": (None, (r + c, d)),
            "q_proj": (None, (hl * dn, r)), "qi_proj": (None, (hi * di, r)),
            "o_proj": (None, (d, hl * dv)), "u_k": (1, (hl, dn, c)), "u_v": (2, (hl, dv, c))}


# variant -> overrides of the default tiles (a variant keeps them for every M); "splits_x"
# multiplies the default's K split.
VARIANTS = {"default": {}, "bn128": {"block_n": 128}, "bk128": {"block_k": 128},
            "stages4": {"num_stages": 4}, "splits_x2": {"splits_x": 2},
            "warps8": {"num_warps": 8},
            "bk128_x2": {"block_k": 128, "splits_x": 2},
            "bk128_s4": {"block_k": 128, "num_stages": 4},
            "bk128_s5": {"block_k": 128, "num_stages": 5},
            "bk256": {"block_k": 256},
            "bk256_w8": {"block_k": 256, "num_warps": 8},
            "bk128_w8_s4": {"block_k": 128, "num_warps": 8, "num_stages": 4},
            "bn32_bk128_x2": {"block_n": 32, "block_k": 128, "splits_x": 2},
            "bn32_bk256": {"block_n": 32, "block_k": 256},
            "bn128_bk128_x2": {"block_n": 128, "block_k": 128, "splits_x": 2},
            "bk128_evict": {"block_k": 128, "evict_weights": True},
            "bk128_x2_evict": {"block_k": 128, "splits_x": 2, "evict_weights": True},
            # another row tile: do a row's bits depend on it? (row0_sha1 across variants)
            "bm128": {"block_m": 128}, "bm16": {"block_m": 16},
            # Nineteenth session: one K part ("splits": absolute; no split-sum launch after
            # the GEMM) with narrow column tiles for enough programs, and deeper K chunks.
            "s1": {"splits": 1}, "s1_bn32": {"splits": 1, "block_n": 32},
            "s1_bn32_bk256": {"splits": 1, "block_n": 32, "block_k": 256},
            "s1_bn32_bk256_st5": {"splits": 1, "block_n": 32, "block_k": 256, "num_stages": 5},
            "s1_bn16_bk256": {"splits": 1, "block_n": 16, "block_k": 256},
            "s1_bn16_bk512_st4": {"splits": 1, "block_n": 16, "block_k": 512, "num_stages": 4},
            "s1_bn64_bk256": {"splits": 1, "block_n": 64, "block_k": 256},
            "s1_bn128_bk128": {"splits": 1, "block_n": 128, "block_k": 128},
            "s1_bn128_bk256_w8": {"splits": 1, "block_n": 128, "block_k": 256, "num_warps": 8},
            "bk256_st4": {"block_k": 256, "num_stages": 4},
            "bn32_bk256_st5": {"block_n": 32, "block_k": 256, "num_stages": 5}}
# The nineteenth session's sweep (M = 1 and 64): the default and these.
S19 = ("default", "s1", "s1_bn32", "s1_bn32_bk256", "s1_bn32_bk256_st5", "s1_bn16_bk256",
       "s1_bn16_bk512_st4", "s1_bn64_bk256", "s1_bn128_bk128", "s1_bn128_bk256_w8",
       "bk256_st4", "bn32_bk256_st5")


def _tuning(contract, shape, variant, m):
    """The variant's tiles for m rows: the kernel's default for m rows (`default_tuning`) with
    the variant's overrides; None where its K chunks do not tile K."""
    heads = shape[0] if contract else 1
    n = (shape[2] if contract == 1 else shape[1]) if contract else shape[0]
    k = shape[contract] if contract else shape[1]
    t = mm.default_tuning(n, k, heads, m)
    ov = dict(VARIANTS[variant])
    splits = ov.pop("splits", t.splits) * ov.pop("splits_x", 1)
    t = dataclasses.replace(t, splits=splits, **ov)
    stage = t.block_k * (t.block_m * (4 if m <= mm.CONVERT_IN_KERNEL_ROWS else 2)
                         + t.block_n * 2)
    fit = 227 * 1024 // stage  # pipeline stages in a block's shared memory (bits: any)
    if fit < 1:
        return None
    t = dataclasses.replace(t, num_stages=min(t.num_stages, fit))
    return None if k % (t.splits * t.block_k) else t


def _inputs(contract, shape, m, key):
    kv, kw = jax.random.split(key)
    if contract:
        heads, k = shape[0], shape[contract]
        v = jax.random.normal(kv, (m, heads, k), jnp.float32)
    else:
        v = jax.random.normal(kv, (m, shape[1]), jnp.float32)
    w = (jax.random.normal(kw, shape, jnp.float32) * 0.05).astype(jnp.bfloat16)
    return v, w


def main(argv=None) -> None:
    ap = sweep_parser("CPU, small shapes, interpret mode", 200.0, "stop starting rows after this")
    ap.add_argument("--gemms", nargs="*", default=None)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS),
                    help='names of VARIANTS, or "s19" for the nineteenth session\'s set')
    ap.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    ap.add_argument("--cold", action="store_true",
                    help="time each call on another copy of the weight (copies of >= 256 MB "
                         "in all, past the 50 MB L2), as a step reads its weights")
    args = ap.parse_args(argv)
    if args.variants == ["s19"]:
        args.variants = list(S19)
    t_end = time.perf_counter() + args.budget_s
    interpret = args.smoke
    cfg = glm53_flash() if not args.smoke else glm53_flash(
        q_lora_rank=64, kv_lora_rank=64, index_n_heads=4, index_head_dim=16, num_heads=4,
        qk_nope_head_dim=32, v_head_dim=32, hidden_size=128)
    path = results_path(args.out, "h200-gemm.json")
    res = {"command": command("h200_gemm.py", argv), "date": utc_now(),
           "jax_version": jax.__version__, "device": str(jax.devices()[0].device_kind),
           "results": [], "errors": []}
    names = args.gemms or list(gemms(cfg))
    for gi, name in enumerate(names):
        contract, shape = gemms(cfg)[name]
        v_all, w = _inputs(contract, shape, max(ROWS), jax.random.PRNGKey(gi))
        if contract:
            ref_fn = jax.jit(lambda v, w, c=contract: mm.per_head_xla(v, w, c))
            k = shape[contract]
        else:
            ref_fn = jax.jit(mm.matmul_xla)
            k = shape[1]
        # fp32 product of the same bf16 operands; bound: K * eps32 * sum |v||w| per output.
        v16 = v_all.astype(jnp.bfloat16).astype(jnp.float32)
        w32 = w.astype(jnp.float32)
        exact = (mm.per_head_xla(v16, w32, contract) if contract else mm.matmul_xla(v16, w32))
        mag = (mm.per_head_xla(jnp.abs(v16), jnp.abs(w32), contract) if contract
               else mm.matmul_xla(jnp.abs(v16), jnp.abs(w32)))
        bound = np.asarray(k * np.finfo(np.float32).eps * mag)
        exact = np.asarray(exact)
        for variant in ["xla"] + args.variants:
            def gemm(v, w, variant=variant, contract=contract, shape=shape, ref_fn=ref_fn):
                if variant == "xla":
                    return ref_fn(v, w)
                t = _tuning(contract, shape, variant, v.shape[0])
                if contract:
                    return mm.per_head_pallas(v, w, contract, tuning=t, interpret=interpret)
                return mm.matmul_pallas(v, w, tuning=t, interpret=interpret)

            if variant != "xla" and any(_tuning(contract, shape, variant, m) is None
                                        for m in args.rows):
                continue
            fn = jax.jit(gemm)
            full = np.asarray(fn(v_all, w))
            for m in args.rows:
                if time.perf_counter() > t_end:
                    res["errors"].append({"section": f"{name}/{variant}/{m}", "error": "budget"})
                    continue
                t = None if variant == "xla" else _tuning(contract, shape, variant, m)
                row = {"gemm": name, "shape": list(shape), "variant": variant, "m": m,
                       "tuning": None if t is None else dataclasses.asdict(t)}

                def work(row, fn=fn, m=m, full=full, v_all=v_all, w=w, exact=exact,
                         bound=bound, shape=shape):
                    v = v_all[:m]
                    out = np.asarray(fn(v, w))
                    err = np.abs(out - exact[:m])
                    row["max_err_over_bound"] = float(np.max(err / np.maximum(bound[:m], 1e-30)))
                    row["rows_equal_256"] = bool(np.array_equal(out, full[:m]))
                    row["row0_sha1"] = hashlib.sha1(out[:1].tobytes()).hexdigest()[:12]
                    n_copy = min(64, -(-COLD_BYTES // w.nbytes)) if args.cold else 0
                    copies = [w] + [jnp.copy(w) for _ in range(n_copy)]
                    it = itertools.cycle(copies)
                    row.update(sweep_times(lambda: fn(v, next(it)), heavy=False),
                               cold_copies=n_copy or None)
                    wbytes = int(np.prod(shape)) * 2
                    if row.get("kernel_us"):
                        row["weight_tb_s"] = wbytes / row["kernel_us"] / 1e6
                sweep_row(res, row, work, path)
        write_json(res, path)
    write_json(res, path)


if __name__ == "__main__":
    main()
