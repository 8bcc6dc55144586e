"""Two H200s (`nvidia-h200-x2`): tensor and data parallelism, checked and timed in one call.

    PYTHONPATH=. python3 benchmarks/h200_parallel.py --out $OUT/h200-parallel.json
    PYTHONPATH=. python3 benchmarks/h200_parallel.py --smoke --out /tmp/p.json  # CPU, tiny
    ... --gpus 8  # nvidia-h200-x8 (issue 17): TP=8, DP=8, 2x4, 4x2; 256 sequences too

NCCL's NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and NVSHMEM_DISABLE_NVLS=1 are set
below before jax is imported (the lent machines' GPUs are shared, and a program that uses
multicast can put them out of service; the device notes, KINDS.md).

1. parity (GLM-5.3-Flash block, bf16 weights, fp8 cache, pallas): TP=2 (mesh 1x2) and DP=2
   (mesh 2x1) against one GPU on the same random state (with --gpus n: TP=n, DP=n, 2 x n/2,
   4 x n/4), for a prefill chunk, a K=3 verify and
   a decode: `sel` bitwise (and the share of rows that differ, if any), `y` against the bound
   of `dsa_jax.sharding.check` (worst error / bound); at TP=2 also decode_k == K decodes.
2. times, 16K context: decode B=64 at TP=1 (one GPU), TP=2, DP=2 (32 sequences per GPU),
   and decode B=1 at TP=1 and TP=2 (--gpus n: TP=n, DP=n; from n=4 also 256 sequences at
   TP=1 and DP=n). Each is T=16 decode steps in one jitted `lax.scan`
   (state carried and donated, lengths reset to 16K - T at each call): no host work between
   steps. Per step: the wall time, and from a profile the kernel time per GPU with the
   all-reduce's kernels apart.
3. the indexer's query GEMM (TP=1): fused with q_b into one GEMM (the old layout) against two
   GEMMs (the layout now: the indexer's shape is the same at every degree), and the two
   without the barrier that keeps XLA's dot merger from merging them again; plus whether
   the indexer columns and q_b's columns come out bitwise equal across these shapes.

JSON to --out (rewritten after each part); a short table is printed last. Exit status 1 if a
parity check failed. Parts not started within --budget-s are listed under "skipped" (run them
in a second call with --only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

# Targets (issues 16 and 17) as {point: (the one-GPU point it is compared with, max ratio of
# the per-step times)}; DP=8 at 256 sequences >= 6x one GPU's tokens/s is a ratio <= 1/6.
TARGETS = {2: {"b64_tp2": ("b64_tp1", 0.6), "b64_dp2": ("b64_tp1", 0.55),
               "b1_tp2": ("b1_tp1", 0.8)},
           8: {"b1_tp8": ("b1_tp1", 0.4), "b256_dp8": ("b256_tp1", 1 / 6)}}


def parity_meshes(n: int) -> list[tuple[int, int]]:
    """(dp, tp) meshes of n devices checked against one: TP=n, DP=n, and 2 x n/2, 4 x n/4."""
    mixed = [(a, n // a) for a in (2, 4) if 1 < a < n and n % a == 0]
    return [(1, n), (n, 1), *mixed]


def time_points(n: int, big: int) -> list[tuple[str, int, int, int]]:
    """(key, dp, tp, sequences): "b64" is the big batch (64; 4 in --smoke)."""
    pts = [("b64_tp1", 1, 1, big), (f"b64_tp{n}", 1, n, big), (f"b64_dp{n}", n, 1, big),
           ("b1_tp1", 1, 1, 1), (f"b1_tp{n}", 1, n, 1)]
    if n >= 4:
        pts += [("b256_tp1", 1, 1, 4 * big), (f"b256_dp{n}", n, 1, 4 * big)]
    return pts


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="h200-parallel.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true",
                   help="CPU with 2 host devices, tiny shapes, xla implementation (tests)")
    p.add_argument("--gpus", type=int, default=2,
                   help="devices to spread over (2 on nvidia-h200-x2; 4, 8 on larger kinds)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed loop")
    p.add_argument("--only", default="parity,times,lever", help="parts to run")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="start no part or timing point after this many seconds (the device "
                        "tool stops a command at 600 s; what ran is in the JSON)")
    return p.parse_args(argv)


def setup(smoke: bool, gpus: int) -> None:
    """Environment before jax is imported."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={gpus}".strip()


def configs(smoke: bool, n: int):
    from dsa_jax.shapes import ODD, glm53_flash

    if smoke:
        cfg = ODD.replace(num_heads=4, cache_dtype="float8_e4m3fn", param_dtype="bfloat16",
                          index_cache_dtype="bfloat16", implementation="xla")
        return cfg, {"parity_b": max(2, n), "parity_ctx": 40, "parity_rows": 8, "big_b": 4}
    return (glm53_flash(implementation="pallas"),
            {"parity_b": max(4, n), "parity_ctx": 8192, "parity_rows": 32, "big_b": 64})


def _rows(rng, b, r, d):
    import jax.numpy as jnp

    return jnp.asarray(rng.standard_normal((b, r, d)).astype("float32")).astype(jnp.bfloat16)


def parity(cfg, hf, sizes, n, res) -> bool:
    import jax
    import numpy as np

    import dsa_jax
    from benchmarks.workloads import random_state
    from dsa_jax import sharding
    from dsa_jax.sharding import check

    b, ctx, rows = sizes["parity_b"], sizes["parity_ctx"], sizes["parity_rows"]
    rng = np.random.default_rng(5)
    x = _rows(rng, b, rows, cfg.hidden_size)
    xk = _rows(rng, b, 3, cfg.hidden_size)
    xd = _rows(rng, b, 1, cfg.hidden_size)[:, 0]
    host = jax.device_get(random_state(cfg, b, ctx, seed=1))
    tol = jax.jit(check.y_tolerance, static_argnums=0)
    w1 = dsa_jax.fold_weights(cfg, hf)
    s = jax.device_put(host, jax.devices()[0])
    ref = {}
    y, s, sel = dsa_jax.prefill(cfg, w1, s, x)
    ref["prefill"] = (y, sel, tol(cfg, w1, s, x, sel))
    y, s, sel = dsa_jax.decode_k(cfg, w1, s, xk)
    ref["decode_k"] = (y, sel, tol(cfg, w1, s, xk, sel))
    y, s, sel = dsa_jax.decode(cfg, w1, s, xd)
    ref["decode"] = (y, sel, tol(cfg, w1, s, xd[:, None], sel[:, None])[:, 0])
    del s
    ok = True
    for dp, tp in parity_meshes(n):
        name = f"tp{tp}" if dp == 1 else f"dp{dp}" if tp == 1 else f"dp{dp}xtp{tp}"
        c = cfg.replace(tp_degree=tp)
        m = sharding.mesh(dp, tp)
        w = sharding.shard_weights(c, hf, m)
        s = sharding.shard_state(c, m, host)
        got = {}
        y, s, sel = sharding.dp_tp_prefill(c, m, w, s, x)
        got["prefill"] = (y, sel)
        y, s, sel = sharding.dp_tp_decode_k(c, m, w, s, xk)
        got["decode_k"] = (y, sel)
        y, s, sel = sharding.dp_tp_decode(c, m, w, s, xd)
        got["decode"] = (y, sel)
        out = {}
        for step, (y, sel) in got.items():
            y1, sel1, t = (np.asarray(a) for a in ref[step])
            y, sel = np.asarray(y), np.asarray(sel)
            same_rows = (sel == sel1).all(axis=-1)
            err = np.abs(y.astype(np.float64) - y1)
            live = t > 0
            out[step] = {"sel_equal": bool(same_rows.all()),
                         "sel_rows_differing": float(1 - same_rows.mean()),
                         "y_within_bound": bool((err <= t).all()),
                         "y_worst_err_over_bound": float((err[live] / t[live]).max()),
                         "y_max_rel_err": float(err.max() / np.abs(y1).max())}
            ok &= out[step]["sel_equal"] and out[step]["y_within_bound"]
        if tp > 1:
            s = sharding.shard_state(c, m, host)
            yk, _, selk = sharding.dp_tp_decode_k(c, m, w, s, xk)
            s = sharding.shard_state(c, m, host)
            same = True
            for k in range(xk.shape[1]):
                y, s, sel = sharding.dp_tp_decode(c, m, w, s, xk[:, k])
                same &= bool(np.array_equal(np.asarray(y), np.asarray(yk[:, k])) and
                             np.array_equal(np.asarray(sel), np.asarray(selk[:, k])))
            out["decode_k_equals_decodes"] = same
            ok &= same
        res["parity"][name] = out
        del s, w
    return ok


class Loop:
    """T decode steps in one jitted lax.scan; the state lives here between calls."""

    def __init__(self, cfg, m, weights, state, b, steps, l0, seed):
        import functools

        import jax
        import jax.numpy as jnp
        import numpy as np

        from dsa_jax import layer, sharding

        rng = np.random.default_rng(seed)
        xs = np.zeros((steps, b, cfg.max_verify, cfg.hidden_size), np.float32)
        xs[:, :, 0] = rng.standard_normal((steps, b, cfg.hidden_size))  # padding rows stay 0
        xs = jnp.asarray(xs).astype(jnp.bfloat16)
        if m is None:
            def step(w, s, x):
                y, s, sel = layer.step(cfg, w, s, x, jnp.ones((b,), jnp.int32))
                return y[:, :1], s, sel
        else:
            xs = jax.device_put(xs, jax.sharding.NamedSharding(
                m, jax.sharding.PartitionSpec(None, sharding.DP)))
            step = functools.partial(sharding.sharded_step, cfg, m, n_new=1, out_rows=1)

        def loop(w, s, xs):
            start = jnp.full_like(s.lengths, l0)
            s = s._replace(lengths=start, index_lengths=start)

            def body(s, x):
                y, s, _ = step(w, s, x)
                return s, y[:, 0]
            return jax.lax.scan(body, s, xs)

        self.fn = jax.jit(loop, donate_argnums=1)
        self.w, self.s, self.xs = weights, state, xs

    def __call__(self):
        self.s, ys = self.fn(self.w, self.s, self.xs)
        return ys

    def reset(self):
        pass


def time_point(cfg, hf, dp, tp, b, steps, smoke):
    import jax

    from benchmarks.harness import measure, profile_step
    from benchmarks.workloads import random_state
    from dsa_jax import sharding
    from dsa_jax.weights import fold_weights

    c = cfg.replace(tp_degree=tp)
    l0 = cfg.max_context - steps
    state = random_state(c, b, l0, seed=2)
    if dp * tp == 1:
        m, w = None, jax.device_put(fold_weights(c, hf), jax.devices()[0])
    else:
        m = sharding.mesh(dp, tp)
        w = sharding.shard_weights(c, hf, m)
        state = sharding.shard_state(c, m, state)
    loop = Loop(c, m, w, state, b, steps, l0, seed=3)
    t0 = time.perf_counter()
    jax.block_until_ready(loop())
    row = {"dp": dp, "tp": tp, "num_seqs": b, "context": l0, "steps_per_call": steps,
           "compile_and_first_call_s": time.perf_counter() - t0}
    t = measure(loop, warmup=1, groups=3 if smoke else 9, inner=1 if smoke else 3)
    row["wall_us_per_step"] = t["median_us"] / steps
    row["wall_us_per_step_p10_p90"] = [t["p10_us"] / steps, t["p90_us"] / steps]
    prof = profile_step(loop, 2 if smoke else 4, top=80)
    if "kernel_us_per_step" in prof:
        gpus = dp * tp
        coll = [k for k in prof["top_kernels"]
                if any(s in k["name"].lower() for s in ("nccl", "allreduce", "all_reduce"))]
        row["kernel_us_per_step_per_gpu"] = prof["kernel_us_per_step"] / steps / gpus
        row["allreduce_us_per_step_per_gpu"] = sum(k["us_per_step"] for k in coll) / steps / gpus
        row["allreduce_kernels"] = [k["name"][:100] for k in coll]
        row["busy_us_per_step"] = prof["kernel_busy_us_per_step"] / steps
        row["top_kernels"] = [{"name": k["name"][:100], "us_per_step_per_gpu":
                               k["us_per_step"] / steps / gpus} for k in prof["top_kernels"][:12]]
    else:
        row["profile"] = prof.get("error")
    del loop, state, w
    return row


def lever(cfg, hf, res, smoke):
    """The indexer's query GEMM fused with q_b, or its own GEMM (with and without the
    barrier)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from benchmarks.harness import sweep_times
    from dsa_jax.weights import fold_weights

    def mm(v, w):
        return jnp.einsum("...i,oi->...o", v.astype(w.dtype), w,
                          preferred_element_type=jnp.float32)

    w = fold_weights(cfg, hf)
    nq = w.q_proj.shape[0]
    fused_w = jnp.concatenate([w.q_proj, w.qi_proj])
    forms = {
        "fused": jax.jit(lambda v, a, f: (lambda o: (o[..., :nq], o[..., nq:]))(mm(v, f))),
        "separate": jax.jit(lambda v, a, f: (mm(v, a[0]), mm(lax.optimization_barrier(v),
                                                                a[1]))),
        "separate_no_barrier": jax.jit(lambda v, a, f: (mm(v, a[0]), mm(v, a[1]))),
    }
    half = fold_weights(cfg.replace(tp_degree=2), hf).q_proj  # rank 0's q_b rows
    out = {}
    for b in (1, 8 if smoke else 64):
        rng = np.random.default_rng(b)
        v = jnp.asarray(rng.standard_normal((b, cfg.max_verify, cfg.q_lora_rank)), jnp.float32)
        row = {}
        vals = {}
        for name, fn in forms.items():
            call = (lambda fn=fn, v=v: fn(v, (w.q_proj, w.qi_proj), fused_w))
            vals[name] = jax.device_get(call())
            row[name] = sweep_times(call, heavy=False)
        q_half = np.asarray(jax.jit(mm)(v, half))
        row["indexer_bits_fused_eq_separate"] = bool(np.array_equal(vals["fused"][1],
                                                                    vals["separate"][1]))
        row["q_b_bits_tp2_eq_tp1"] = bool(np.array_equal(q_half, vals["separate"][0][
            ..., :half.shape[0]]))
        out[f"b{b}"] = row
    res["lever_indexer_query_gemm"] = out


def table(res) -> str:
    t, targets = res.get("times", {}), res.get("targets", {})

    def us(k):
        return t.get(k, {}).get("wall_us_per_step")

    lines = ["| decode, 16K | us/step | vs TP=1 | target | all-reduce us/step/GPU |",
             "|---|---|---|---|---|"]
    for key, row in t.items():
        base = "b1_tp1" if key.startswith("b1_") else key.split("_")[0] + "_tp1"
        mine, one = us(key), us(base)
        ratio = f"{mine / one:.2f}x" if mine and one and key != base else "-"
        goal = targets.get(key)
        ar = row.get("allreduce_us_per_step_per_gpu")
        lines.append(f"| {key} (dp {row['dp']} x tp {row['tp']}, {row['num_seqs']} seqs) | "
                     f"{'-' if mine is None else f'{mine:.1f}'} | {ratio} | "
                     f"{'-' if goal is None else f'<= {goal[1]:.2f}x'} | "
                     f"{'-' if ar is None else f'{ar:.1f}'} |")
    for name, p in res.get("parity", {}).items():
        cells = [f"{step}: sel {'==' if v['sel_equal'] else '!='} "
                 f"y/bound {v['y_worst_err_over_bound']:.2g}"
                 for step, v in p.items() if isinstance(v, dict)]
        lines.append(f"parity {name} vs one device: " + "; ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    setup(args.smoke, args.gpus)
    import jax

    from benchmarks.workloads import random_hf_tensors

    n = args.gpus
    cfg, sizes = configs(args.smoke, n)
    res = {"command": "PYTHONPATH=. python3 benchmarks/h200_parallel.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "jax_version": jax.__version__, "devices": [d.device_kind for d in jax.devices()],
           "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS",
                                                  "XLA_FLAGS")},
           "config": {k: getattr(cfg, k) for k in ("num_heads", "max_context", "cache_dtype",
                                                   "param_dtype", "implementation")},
           "gpus": n, "targets": TARGETS.get(n, {}), "parity": {}, "times": {}, "errors": []}
    if jax.device_count() < n:
        raise SystemExit(f"--gpus {n} needs {n} devices; jax sees {jax.device_count()}")
    hf = random_hf_tensors(cfg, seed=0)
    parts = args.only.split(",")
    ok = True

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    start = time.perf_counter()

    def guarded(name, fn):
        t0 = time.perf_counter()
        if t0 - start > args.budget_s:
            res.setdefault("skipped", []).append(name)
            print(f"{name}: skipped (past --budget-s {args.budget_s:.0f} s)", flush=True)
            return
        try:
            fn()
        except Exception as e:
            res["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:400]}\n"
                                 f"{traceback.format_exc()[-1500:]}")
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()

    if "parity" in parts:
        def run_parity():
            nonlocal ok
            ok = parity(cfg, hf, sizes, n, res)
        guarded("parity", run_parity)
    if "times" in parts:
        for key, dp, tp, b in time_points(n, sizes["big_b"]):
            def run_time(key=key, dp=dp, tp=tp, b=b):
                res["times"][key] = time_point(cfg, hf, dp, tp, b, args.steps, args.smoke)
            guarded(f"times {key}", run_time)
    if "lever" in parts:
        guarded("lever", lambda: lever(cfg, hf, res, args.smoke))
    res["parity_ok"] = ok and not any(e.startswith("parity") for e in res["errors"])
    save()
    print(table(res))
    return 0 if res["parity_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
