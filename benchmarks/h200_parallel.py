"""Two H200s (`nvidia-h200-x2`): tensor and data parallelism, checked and timed in one call.

    PYTHONPATH=. python3 benchmarks/h200_parallel.py --out $OUT/h200-parallel.json
    PYTHONPATH=. python3 benchmarks/h200_parallel.py --smoke --out /tmp/p.json  # CPU, tiny
    ... --gpus 8  # nvidia-h200-x8 (issue 17): TP=8, DP=8, 2x4, 4x2; 256 sequences too

NCCL's NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and NVSHMEM_DISABLE_NVLS=1 are set
below before jax is imported (the lent machines' GPUs are shared, and a program that uses
multicast can put them out of service; the device notes, KINDS.md).

1. parity (GLM-5.3-Flash block, bf16 weights, fp8 cache, pallas): TP=2 (mesh 1x2, the
   selection replicated as the default rule has it at 4 sequences, and split over the ranks)
   and DP=2 (mesh 2x1) against one GPU on the same random state (with --gpus n: TP=n, DP=n,
   2 x n/2, 4 x n/4), for a prefill chunk, a K=3 verify and a decode: `sel` bitwise (and the
   share of rows that differ, if any), `y` against the bound of `dsa_jax.sharding.check`
   (worst error / bound); at TP=n also decode_k == K decodes.
1b. sel_b64: `sel` of the timed B=64 loop at TP=n split (score kernel ranged and masked)
   against TP=1, bitwise; the score kernel over a rank's range of sequences against the
   whole batch's, `==` (`parallel_probes.score_range_bits`).
2. times, 16K context: decode B=64 at TP=1 (one GPU), B=32 at TP=1 (what a DP=2 device
   runs), TP=2 as the library runs it now (selection split over the ranks, the Mosaic attend
   at 32 heads padded to its 64-row tile), TP=2 with the selection replicated, TP=2 as
   before (replicated, Triton attend at 32 heads), DP=2; B=8 at TP=2 split and replicated
   (the split rule's threshold); B=64 at TP=2 split with the score kernel as before
   (`masked`: programs for the other rank's rows too); B=1 at TP=1, TP=2 and TP=2 as before
   (--gpus n: TP=n, DP=n; from n=4 also 256 sequences at TP=1 and DP=n). Each is T=16
   decode steps in one jitted `lax.scan` (state carried, donated, lengths reset to 16K - T):
   no host work between steps. Per step: the wall time, and from a profile the kernel time
   per GPU with the collectives' kernels apart (found through the compiled program's
   collective instructions: `parallel_probes.collective_names`).
3. attend32: the Mosaic attend at 32 heads against the jnp twin (derived f16 bound).
4. prefill_bits: which piece of a prefill depends on the batch or the program
   (`parallel_probes.prefill_bits`).

JSON to --out (rewritten after each part); a short table is printed last. Exit status 1 if a
parity check failed. Parts not started within --budget-s are listed under "skipped" (run them
in a second call with --only).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
import traceback

from benchmarks.device_script import command, utc_now, write_json

# Targets (issues 16 and 17) as {point: (the one-GPU point it is compared with, max ratio of
# the per-step times)}; DP=8 at 256 sequences >= 6x one GPU's tokens/s is a ratio <= 1/6.
TARGETS = {2: {"b64_tp2": ("b64_tp1", 0.6), "b64_dp2": ("b64_tp1", 0.55),
               "b1_tp2": ("b1_tp1", 0.8)},
           8: {"b1_tp8": ("b1_tp1", 0.4), "b256_dp8": ("b256_tp1", 1 / 6)}}


def parity_meshes(n: int) -> list[tuple[int, int]]:
    """(dp, tp) meshes of n devices checked against one: TP=n, DP=n, and 2 x n/2, 4 x n/4."""
    mixed = [(a, n // a) for a in (2, 4) if 1 < a < n and n % a == 0]
    return [(1, n), (n, 1), *mixed]


def time_points(n: int, big: int) -> list[tuple[str, int, int, int, bool | None, bool]]:
    """(key, dp, tp, sequences, split_selection, variant): variant "" (the library now),
    "before" (the attend rule as before) or "masked" (the split's score kernel as before).
    "b64" is the big batch (64; 4 in --smoke), "b32" half of it, "b8" 8 (2 in --smoke)."""
    small = 8 if big >= 64 else 2
    # The targets' points first: a run cut short by --budget-s keeps them.
    pts = [("b64_tp1", 1, 1, big, None, ""), (f"b64_tp{n}", 1, n, big, None, ""),
           (f"b64_dp{n}", n, 1, big, None, ""), ("b1_tp1", 1, 1, 1, None, ""),
           (f"b1_tp{n}", 1, n, 1, None, ""), ("b32_tp1", 1, 1, big // 2, None, ""),
           (f"b64_tp{n}_masked", 1, n, big, True, "masked"),
           (f"b64_tp{n}_replicated", 1, n, big, False, ""),
           (f"b64_tp{n}_before", 1, n, big, False, "before"),
           (f"b1_tp{n}_before", 1, n, 1, False, "before"),
           (f"b8_tp{n}_split", 1, n, small, True, ""),
           (f"b8_tp{n}_replicated", 1, n, small, False, "")]
    if n >= 4:
        pts += [("b256_tp1", 1, 1, 4 * big, None, ""),
                (f"b256_dp{n}", n, 1, 4 * big, None, "")]
    return pts


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="h200-parallel.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true",
                   help="CPU with 2 host devices, tiny shapes, xla implementation (tests)")
    p.add_argument("--gpus", type=int, default=2,
                   help="devices to spread over (2 on nvidia-h200-x2; 4, 8 on larger kinds)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed loop")
    p.add_argument("--only", default="parity,sel_b64,times,attend32,prefill_bits",
                   help="parts to run")
    p.add_argument("--points", default="",
                   help="comma-separated time point keys (and 'prefill_bits') to run, in this "
                        "order, instead of all of them (a second call for what a first one "
                        "skipped)")
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
    variants = [(dp, tp, None) for dp, tp in parity_meshes(n)]
    variants.insert(1, (1, n, True))  # TP=n with the selection split over the ranks
    for dp, tp, split in variants:
        name = f"tp{tp}" if dp == 1 else f"dp{dp}" if tp == 1 else f"dp{dp}xtp{tp}"
        c = cfg.replace(tp_degree=tp)
        name += "_split" if split else ""
        m = sharding.mesh(dp, tp)
        w = sharding.shard_weights(c, hf, m)
        s = sharding.shard_state(c, m, host)
        got = {}
        kw = dict(split_selection=split)
        y, s, sel = sharding.dp_tp_prefill(c, m, w, s, x, **kw)
        got["prefill"] = (y, sel)
        y, s, sel = sharding.dp_tp_decode_k(c, m, w, s, xk, **kw)
        got["decode_k"] = (y, sel)
        y, s, sel = sharding.dp_tp_decode(c, m, w, s, xd, **kw)
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
            yk, _, selk = sharding.dp_tp_decode_k(c, m, w, s, xk, **kw)
            s = sharding.shard_state(c, m, host)
            same = True
            for k in range(xk.shape[1]):
                y, s, sel = sharding.dp_tp_decode(c, m, w, s, xk[:, k], **kw)
                same &= bool(np.array_equal(np.asarray(y), np.asarray(yk[:, k])) and
                             np.array_equal(np.asarray(sel), np.asarray(selk[:, k])))
            out["decode_k_equals_decodes"] = same
            ok &= same
        out["split_selection"] = sharding.split_rule(c, b // dp, split)
        res["parity"][name] = out
        del s, w
    return ok


class Loop:
    """T decode steps in one jitted lax.scan, compiled ahead of time (its HLO text kept for
    the collectives' names); the state lives here between calls."""

    def __init__(self, cfg, m, weights, state, b, steps, l0, seed, split=None, masked=False,
                 keep_sel=False):
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
            step = functools.partial(sharding.sharded_step, cfg, m, n_new=1, out_rows=1,
                                     split_selection=split)
            if masked:  # the split selection before the ranged score kernel (issue 16)
                from benchmarks.parallel_probes import masked_step
                step = masked_step(cfg, m)

        def loop(w, s, xs):
            start = jnp.full_like(s.lengths, l0)
            s = s._replace(lengths=start, index_lengths=start)

            def body(s, x):
                y, s, sel = step(w, s, x)
                return s, ((y[:, 0], sel[:, 0]) if keep_sel else y[:, 0])
            return jax.lax.scan(body, s, xs)

        self.fn = jax.jit(loop, donate_argnums=1).lower(weights, state, xs).compile()
        self.hlo = self.fn.as_text()
        self.w, self.s, self.xs = weights, state, xs

    def __call__(self):
        self.s, ys = self.fn(self.w, self.s, self.xs)
        return ys

    def reset(self):
        pass


def time_point(cfg, hf, dp, tp, b, steps, smoke, split=None, variant="", hlo_path=None):
    """One timed point; `split`: split_selection; `variant`: "before" (the attend rule as
    before: `parallel_probes.attend_rule`), "masked" (the split selection before the ranged
    score kernel: `parallel_probes.masked_step`) or ""; `hlo_path`: write the compiled loop's
    HLO there."""
    import jax

    from benchmarks.harness import measure, profile_step
    from benchmarks.parallel_probes import attend_rule, collective_names, is_collective
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
    t0 = time.perf_counter()
    with attend_rule(variant == "before"):
        loop = Loop(c, m, w, state, b, steps, l0, seed=3, split=split,
                    masked=variant == "masked")
    jax.block_until_ready(loop())
    row = {"dp": dp, "tp": tp, "num_seqs": b, "context": l0, "steps_per_call": steps,
           "split_selection": None if m is None else sharding.split_rule(c, b // dp, split),
           "variant": variant or "now",
           "compile_and_first_call_s": time.perf_counter() - t0}
    names = collective_names(loop.hlo)
    row["collective_instructions"] = names
    if hlo_path:
        with gzip.open(hlo_path, "wt") as f:
            f.write(loop.hlo)
    t = measure(loop, warmup=1, groups=3 if smoke else 9, inner=1 if smoke else 3)
    row["wall_us_per_step"] = t["median_us"] / steps
    row["wall_us_per_step_p10_p90"] = [t["p10_us"] / steps, t["p90_us"] / steps]
    prof = profile_step(loop, 2 if smoke else 4, top=80)
    if "kernel_us_per_step" in prof:
        gpus = dp * tp
        coll = [k for k in prof["top_kernels"] if is_collective(k["name"], names)]
        row["kernel_us_per_step_per_gpu"] = prof["kernel_us_per_step"] / steps / gpus
        row["collective_us_per_step_per_gpu"] = sum(k["us_per_step"] for k in coll) / steps / gpus
        row["collective_kernels"] = {k["name"][:100]: k["us_per_step"] / steps / gpus
                                     for k in coll}
        row["busy_us_per_step"] = prof["kernel_busy_us_per_step"] / steps
        row["top_kernels"] = [{"name": k["name"][:100], "us_per_step_per_gpu":
                               k["us_per_step"] / steps / gpus} for k in prof["top_kernels"][:12]]
    else:
        row["profile"] = prof.get("error")
    del loop, state, w
    return row


def sel_big(cfg, hf, n, b, steps, res) -> bool:
    """Part 1b (module docstring): True if every comparison is equal."""
    import jax
    import numpy as np

    from benchmarks.parallel_probes import score_range_bits
    from benchmarks.workloads import random_state
    from dsa_jax import sharding
    from dsa_jax.weights import fold_weights

    l0 = cfg.max_context - steps
    got = {}
    for name, tp, masked in (("tp1", 1, False), (f"tp{n}_split", n, False),
                             (f"tp{n}_split_masked", n, True)):
        c = cfg.replace(tp_degree=tp)
        state = random_state(c, b, l0, seed=2)
        if tp == 1:
            m, w = None, jax.device_put(fold_weights(c, hf), jax.devices()[0])
        else:
            m = sharding.mesh(1, tp)
            w = sharding.shard_weights(c, hf, m)
            state = sharding.shard_state(c, m, state)
        loop = Loop(c, m, w, state, b, steps, l0, seed=3, split=True if tp > 1 else None,
                    masked=masked, keep_sel=True)
        y, sel = loop()
        got[name] = (np.asarray(y, np.float64), np.asarray(sel))  # [T, B, D], [T, B, W]
        del loop, state, w
    out = {"num_seqs": b, "steps": steps}
    ok = True
    pairs = [(f"tp{n}_split", "tp1"), (f"tp{n}_split_masked", "tp1"),
             (f"tp{n}_split", f"tp{n}_split_masked")]
    for a, ref in pairs:
        (ya, sa), (yr, sr) = got[a], got[ref]
        same = (sa == sr).all(axis=-1)  # [T, B]
        out[f"{a}_vs_{ref}"] = {"sel_equal": bool(same.all()),
                                "sel_rows_differing": float(1 - same.mean()),
                                "y_max_rel_err": float(np.abs(ya - yr).max() / np.abs(yr).max())}
        ok &= bool(same.all())
    bits = score_range_bits(cfg, b, (cfg.max_verify, 32))
    if cfg.implementation == "xla":  # --smoke: the kernel too, in interpret mode
        bits.update({f"interpret/{k}": v for k, v in score_range_bits(
            cfg.replace(implementation="pallas-interpret"), b, (cfg.max_verify, 12)).items()})
    out["score_range_rows_differing"] = bits
    ok &= not any(bits.values())
    out["ok"] = ok
    res["sel_b64"] = out
    return ok


def table(res) -> str:
    t, targets = res.get("times", {}), res.get("targets", {})

    def us(k):
        return t.get(k, {}).get("wall_us_per_step")

    lines = ["| decode, 16K | us/step | vs TP=1 | target | collectives us/step/GPU |",
             "|---|---|---|---|---|"]
    for key, row in t.items():
        base = "b1_tp1" if key.startswith("b1_") else key.split("_")[0] + "_tp1"
        mine, one = us(key), us(base)
        ratio = f"{mine / one:.2f}x" if mine and one and key != base else "-"
        goal = targets.get(key)
        ar = row.get("collective_us_per_step_per_gpu")
        lines.append(f"| {key} (dp {row['dp']} x tp {row['tp']}, {row['num_seqs']} seqs) | "
                     f"{'-' if mine is None else f'{mine:.1f}'} | {ratio} | "
                     f"{'-' if goal is None else f'<= {goal[1]:.2f}x'} | "
                     f"{'-' if ar is None else f'{ar:.1f}'} |")
    for name, v in res.get("sel_b64", {}).items():
        if isinstance(v, dict) and "sel_equal" in v:
            lines.append(f"sel B=64 loop {name}: {'==' if v['sel_equal'] else '!='} "
                         f"(rows differing {v['sel_rows_differing']:.3g})")
    if "sel_b64" in res:
        lines.append(f"score kernel ranges vs whole batch, rows differing: "
                     f"{res['sel_b64']['score_range_rows_differing']}")
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
    res = {"command": command("h200_parallel.py", argv), "date": utc_now(),
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
        write_json(res, args.out)

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
    sel_ok = True
    if "sel_b64" in parts:
        def run_sel():
            nonlocal sel_ok
            sel_ok = sel_big(cfg, hf, n, sizes["big_b"], args.steps, res)
        guarded("sel_b64", run_sel)
    attend_ok = True
    if "attend32" in parts and not args.smoke:  # the Mosaic kernel runs on a Hopper GPU only
        def run_attend32():
            nonlocal attend_ok
            from benchmarks.parallel_probes import attend32
            attend_ok = attend32(res)
        guarded("attend32", run_attend32)
    tasks = []
    if "times" in parts:
        folder = os.path.dirname(os.path.abspath(args.out))
        for key, dp, tp, b, split, variant in time_points(n, sizes["big_b"]):
            hlo = (os.path.join(folder, f"hlo-{key}.txt.gz")
                   if key in ("b64_tp1", f"b64_tp{n}", f"b64_dp{n}", f"b1_tp{n}") else None)

            def run_time(key=key, dp=dp, tp=tp, b=b, split=split, variant=variant, hlo=hlo):
                res["times"][key] = time_point(cfg, hf, dp, tp, b, args.steps, args.smoke,
                                               split=split, variant=variant, hlo_path=hlo)
            tasks.append((f"times {key}", run_time))
    if "prefill_bits" in parts:
        def run_bits():
            from benchmarks.parallel_probes import prefill_bits
            prefill_bits(cfg, hf, sizes["parity_b"], sizes["parity_ctx"], sizes["parity_rows"],
                         res)
        # After the points the targets and the levers need, before the threshold's points.
        tasks.insert(min(len(tasks), 8), ("prefill_bits", run_bits))
    if args.points:  # these tasks only, in this order
        by_name = {name.removeprefix("times "): (name, fn) for name, fn in tasks}
        unknown = [k for k in args.points.split(",") if k not in by_name]
        if unknown:
            raise SystemExit(f"--points {unknown} are not among {sorted(by_name)}")
        tasks = [by_name[k] for k in args.points.split(",")]
    for name, fn in tasks:
        guarded(name, fn)
    res["parity_ok"] = ok and not any(e.startswith("parity") for e in res["errors"])
    res["attend32_ok"] = attend_ok and not any(e.startswith("attend32") for e in res["errors"])
    res["sel_b64_ok"] = sel_ok and not any(e.startswith("sel_b64") for e in res["errors"])
    save()
    print(table(res))
    print(json.dumps({k: res.get(k) for k in ("prefill_bits", "errors", "skipped")}, indent=1,
                     default=str)[:6000])
    return 0 if res["parity_ok"] and res["attend32_ok"] and res["sel_b64_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
