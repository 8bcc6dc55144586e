"""Gather-attend kernel variants on the H200: parity against the jnp twin, then timings.

Run on the device from a copy of the repository (see benchmarks/notes.md):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/h200_attend.py --out $OUT/attend.json

Every variant is checked first (fresh random inputs per case, unselected cache rows poisoned
with NaN, the kernel's output buffers likely poisoned through the allocator, the derived
elementwise bound of tests/test_attend_kernel.py), then timed as the bench times
`attend-kernel-*`: the jitted `sparse_attend_pallas` (kernel, slot arithmetic and split merge),
median of groups of back-to-back calls over 3 input sets, plus the device kernel time of the
attend kernel alone from a profiler trace. Variant groups run in child processes with a time
limit, so a hung kernel costs only its group (`--groups`: mosaic-smoke, mosaic-all (the default
and MOSAIC_VARIANTS on the same inputs, each checked then timed in turn, its output `==` the
default's unless its fp32 sums run in another order), mosaic (the same for QUICK on the GLM case
only, ~90 s; not yet run at 208/88), triton (run 1's Triton levers are in git history), and
prep: the one-launch input prep
`attend_prep.prep_pallas` beside the jnp prep, each variant checked then timed in turn, its
output `==` the default's on every check case and its prep outputs `==` the jnp twin's on rows
of extreme magnitude). The table is printed last. `--smoke` runs the machinery on a CPU in
seconds (Triton interpreted at tiny shapes, the prep kernel interpreted).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

from benchmarks import h200_attend_prep as attend_prep_diag

E32 = 2.0 ** -24
U = {"bfloat16": 2.0 ** -9, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
# Timed shapes: (name, B, R, H, W, ctx).
SHAPES = {
    "a": ("attend-kernel-64x1-h64-w2051", 64, 1, 64, 2051, 16384),
    "b": ("attend-kernel-128x2-h128-w2048", 128, 2, 128, 2048, 16384),
    "p": ("prefill-chunk-1x2048-h64-w2051", 1, 2048, 64, 2051, 16384),
    "s": ("smoke-2x1-h5-w70", 2, 1, 5, 70, 256),  # --smoke only (CPU)
}
FLOOR_US = {"a": 22.0, "b": 180.0}
# MgpuTuning fields of the prep group's variants beside the default (run 7 ran with the jnp
# prep as "mosaic-default" and the Triton prep, now the default, as "mosaic-prep-h64-w16").
PREP_VARIANTS = {
    "mosaic-prep-jnp": dict(prep="jnp"),
    "mosaic-prep-h32": dict(prep="triton", prep_heads=32, prep_warps=8),
    "mosaic-prep-h64-w16-sm1": dict(prep="triton", prep_heads=64, prep_warps=16,
                                    prep_per_sm=1),
}
TARGET_US = {"a": 55.0, "b": 450.0}
# MgpuTuning fields of the mosaic groups' variants beside the default (runs 8, 9: the producer
# converts, `mgpu_gather`; run 4's q_in_kernel variant is in git history). Run 8's ptxas: the
# producer-converted kernel at the default 232/40 split spills 256 bytes (a tile's 64 registers
# of rows: ptxas keeps the producer's setmaxnreg budget of 40), hence a split with more for the
# producer. Run 9's 216/80 hung (512 > the CTA's 3 * 168 registers; now refused): 208/88.
R88 = dict(consumer_regs=208, producer_regs=88)
MOSAIC_VARIANTS = {
    "mosaic-producer-r88": dict(convert="producer", **R88),
    "mosaic-producer-pingpong-r88": dict(convert="producer", full_logits=True, pingpong=True,
                                         **R88),
    "mosaic-producer": dict(convert="producer"),
    "mosaic-producer-full": dict(convert="producer", full_logits=True),
    "mosaic-producer-pingpong": dict(convert="producer", full_logits=True, pingpong=True),
    "mosaic-producer-ahead": dict(convert="producer", gather_ahead=True),
}
# `--group mosaic` (run 9, ~90 s in one process): the default and these, the GLM case each.
QUICK = ("mosaic-producer-r88", "mosaic-producer-pingpong-r88")
# Variants whose fp32 sums run in another order than the default's: checked against the
# bound, their bitwise equality to the default recorded but not required.
REORDERED = ("mosaic-producer-full", "mosaic-producer-pingpong", "mosaic-producer-pingpong-r88")
# `--group mosaic-all`: these on every case, the others on 3 (ONE_CHECK: 1).
FULL_CHECKS = ("mosaic-default", "mosaic-producer-r88", "mosaic-producer-pingpong-r88")
ONE_CHECK = ("mosaic-producer-ahead",)
P_VARIANTS = ("triton-default", "mosaic-default", "mosaic-producer-r88")  # also timed on "p"


def variants(group: str):
    """name -> (sparse_attend_pallas kwargs, operand dtype for the bound)."""
    from dsa_jax.pallas import sparse_attend as sa
    from dsa_jax.pallas import sparse_attend_mgpu as mg

    tri = sa.AttendTuning(backend="triton")
    if group == "triton":
        return {"triton-default": (dict(tuning=tri), "bfloat16")}
    if group == "smoke":  # CPU: the script's machinery, with the Triton kernel interpreted
        return {"triton-interpret": (dict(tuning=tri, interpret=True), "bfloat16"),
                "triton-interpret-again": (dict(tuning=tri, interpret=True), "bfloat16")}
    mos = {"mosaic-default": mg.MgpuTuning()}
    if group == "prep":
        mos.update({k: mg.MgpuTuning(**v) for k, v in PREP_VARIANTS.items()})
    if group in ("mosaic", "mosaic-all", "mosaic-smoke"):
        mos.update({k: mg.MgpuTuning(**v) for k, v in MOSAIC_VARIANTS.items()
                    if group != "mosaic" or k in QUICK})
    return {k: (dict(tuning=sa.AttendTuning(backend="mosaic", mosaic=t)), "float16")
            for k, t in mos.items()}


# ------------------------------------------------------------------------------ correctness

def check_inputs(seed, b, r, h, c, w, bs, mb, *, prefix=False, empty_rows=0):
    """Random q, fp8 cache (unselected rows NaN), permuted tables, selections with -1s."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    nb = b * mb + 3
    kv = 1 / 64
    q = rng.standard_normal((b, r, h, c)).astype(np.float32)
    lat = np.clip(rng.standard_normal((nb, bs, c)) / kv, -448, 448)
    tables = rng.permutation(nb)[: b * mb].reshape(b, mb).astype(np.int32)
    sel = np.stack([np.stack([rng.permutation(mb * bs)[:w] for _ in range(r)])
                    for _ in range(b)]).astype(np.int32)  # distinct tokens per row
    sel = np.where(rng.random(sel.shape) < 0.2, -1, sel)
    if prefix:  # a prefix of live slots then -1, ends on and off 64-slot tile boundaries
        ends = rng.choice([0, 1, 63, 64, 65, 128, w - 1, w], size=(b, r))
        sel = np.where(np.arange(w)[None, None] < ends[..., None], np.abs(sel), -1)
    for k in range(empty_rows):
        sel[k % b, (k // b) % r] = -1
    used = np.zeros(nb * bs, bool)
    bi = np.arange(b)[:, None, None]
    s = np.clip(sel, 0, None)
    used[(tables[bi, s // bs] * bs + s % bs)[sel >= 0]] = True
    used[0] = True  # the twin reads slot 0 for empty slots (and masks it)
    flat = lat.reshape(-1, c)
    flat[~used] = np.nan  # a NaN outside the selection must never reach an output
    lat8 = jnp.asarray(flat.reshape(nb, bs, c), jnp.float8_e4m3fn)
    return q, lat8, np.float32(kv), tables, sel


def bound(q, lat8, kv, tables, sel, scale, u, row_sub=None):
    """The elementwise bound of tests/test_attend_kernel.py, [B, R, 1, 1] (float64)."""
    b, r, h, c = q.shape
    nb, bs, _ = lat8.shape
    flat = np.asarray(lat8.astype(np.float32), np.float64).reshape(-1, c) * float(kv)
    s = np.clip(sel, 0, None)
    slots = tables[np.arange(b)[:, None, None], s // bs] * bs + s % bs
    rows = np.where((sel >= 0)[..., None], np.nan_to_num(flat[slots]), 0.0)  # [B, R, W, C]
    w = sel.shape[-1]
    aq = np.abs(q.astype(np.float64))
    l_j = scale * np.einsum("brhc,brwc->brhw", aq, np.abs(rows))
    d = (u + 2 * c * E32) * l_j.max(axis=(2, 3))  # [B, R]
    m = np.abs(rows).max(axis=(2, 3))
    extra = 0.0
    if row_sub is not None:  # f16 subnormals: q and p absolute rounding (see the test)
        d = d + scale * row_sub * np.abs(rows).sum(axis=3).max(axis=2)
        extra = w * 2.0 ** -25
    return 2.0 * ((np.expm1(2 * d) + u + extra + 4 * (w + 16) * E32) * m)[..., None, None]


def twin(args, scale):
    import jax

    from dsa_jax.pallas import sparse_attend as sa

    return np.asarray(jax.jit(functools.partial(sa.sparse_attend_xla, softmax_scale=scale))(
        *args), np.float64)


def poison_allocator(nbytes: int):
    """Fill and free NaN buffers so that the next allocations likely reuse poisoned memory."""
    import jax
    import jax.numpy as jnp

    bufs = [jnp.full((nbytes // 4 + 1,), jnp.nan, jnp.float32) for _ in range(3)]
    jax.block_until_ready(bufs)
    del bufs


def check_case(name, kw, op, case, seed, shared=None):
    """One variant on one case. shared (prep group): inputs, twin and bound computed once per
    case for every variant, and the default's output, which every other variant must equal."""
    import jax

    from dsa_jax.pallas import sparse_attend as sa
    from dsa_jax.pallas import sparse_attend_mgpu as mg

    b, r, h, c, w, bs, mb, extra, call_kw = case
    scale = 1 / 16
    if shared is None or "args" not in shared:
        args = check_inputs(seed, b, r, h, c, w, bs, mb, **extra)
        ref = twin(args, scale)
        row_sub = None
        if op == "float16":
            _, rscale = mg.scale_rows_f16(jax.numpy.asarray(args[0].reshape(b * r, h, c)))
            row_sub = (2.0 ** -25) * np.asarray(rscale, np.float64).reshape(b, r)
        bnd = bound(*args, scale, U[op], row_sub)
        if shared is not None:
            shared.update(args=args, ref=ref, bnd=bnd)
    else:
        args, ref, bnd = shared["args"], shared["ref"], shared["bnd"]
    fn = jax.jit(functools.partial(sa.sparse_attend_pallas, softmax_scale=scale, **kw,
                                   **call_kw))
    poison_allocator(4 * b * r * h * c * 16)
    out32 = np.asarray(fn(*args))
    out = out32.astype(np.float64)
    err = np.abs(out - ref)
    ratio = np.where(bnd > 0, err / np.where(bnd > 0, bnd, 1.0), np.where(err > 0, np.inf, 0.0))
    rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    empty = (args[4] < 0).all(-1)  # [B, R]
    res = {"variant": name, "case": case_label(case), "seed": seed,
           "nan": int(np.isnan(out).sum()), "max_err_over_bound": float(np.max(ratio)),
           "rel_err": rel, "empty_rows_exact_zero": bool((out[empty] == 0).all())}
    res["ok"] = (res["nan"] == 0 and res["max_err_over_bound"] <= 1.0 and rel < 1e-2
                 and res["empty_rows_exact_zero"])
    if shared is not None:
        if "default" not in shared:
            shared["default"] = out32
        else:  # the same kernel inputs (bitwise), so the same bits out
            res["equal_to_default"] = bool((out32.view(np.uint32)
                                            == shared["default"].view(np.uint32)).all())
            if name not in REORDERED:
                res["ok"] = res["ok"] and res["equal_to_default"]
    return res


def case_label(case):
    b, r, h, c, w, bs, mb, extra, call_kw = case
    s = f"B{b} R{r} H{h} C{c} W{w} bs{bs}"
    for k, v in {**extra, **call_kw}.items():
        s += f" {k}={v}"
    return s


CHECK_CASES = [  # (B, R, H, C, W, bs, blocks per seq, input kwargs, call kwargs)
    (3, 1, 64, 512, 2051, 64, 40, {}, {}),
    (2, 2, 128, 512, 2048, 64, 40, dict(prefix=True, empty_rows=1), {}),
    (2, 3, 5, 512, 70, 16, 9, dict(empty_rows=2), {}),
    (3, 1, 64, 512, 2051, 64, 40, {}, dict(num_splits=3)),
    (2, 1, 24, 384, 300, 32, 12, {}, {}),
]


# ------------------------------------------------------------------------------ timing

def measure(call, warmup=3, groups=10, inner=20):
    import jax

    for _ in range(warmup):
        jax.block_until_ready(call())
    per = []
    for _ in range(groups):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = call()
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t0) / inner * 1e6)
    per.sort()
    return {"median_us": statistics.median(per), "min_us": per[0], "max_us": per[-1]}


def kernel_times(call, calls=10):
    """Device time per call of each kernel name (profiler trace), largest first."""
    import jax

    jax.block_until_ready(call())
    d = tempfile.mkdtemp(prefix="attend-prof-")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        out = None
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
    path = [os.path.join(rt, f) for rt, _, fs in os.walk(d) for f in fs
            if f.startswith("perfetto_trace")][0]
    with gzip.open(path) as f:
        data = json.load(f)
    ev = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in ev
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in ev
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    dev = {p for p, n in procs.items() if "GPU" in n or "/device:" in n}
    kern: dict = {}
    for e in ev:
        if e.get("ph") == "X" and e.get("pid") in dev and "Stream" in threads.get(
                (e["pid"], e.get("tid")), ""):
            kern[e.get("name", "?")] = kern.get(e.get("name", "?"), 0.0) + float(e["dur"])
    rows = sorted(kern.items(), key=lambda kv: -kv[1])
    return {"total_us": sum(kern.values()) / calls,
            "kernels": [(n[:80], round(v / calls, 2)) for n, v in rows[:6]]}


def time_shape(key, kw):
    import jax
    import jax.numpy as jnp

    from dsa_jax.pallas import sparse_attend as sa

    label, b, r, h, w, ctx = SHAPES[key]
    st, sets = time_inputs(b, r, h, w, ctx)
    if not kw.get("diag"):
        fn = jax.jit(functools.partial(sa.sparse_attend_pallas, softmax_scale=1 / 16, **kw))
    if kw.get("diag") == "floor":  # one trivial fusion on the same arguments: dispatch cost
        fn = jax.jit(lambda q, lat, kv, tables, sel: q[:, :, :1, :1] * kv)
    elif kw.get("diag") == "kernel":  # the Mosaic kernel alone, its inputs made beforehand
        fn = attend_prep_diag.kernel_only(b, r, h, w, st[2])
    it = iter(range(1 << 30))

    def call():
        q, sel = sets[next(it) % len(sets)]
        return fn(q, st[0], st[1], st[2], sel)

    t0 = time.perf_counter()
    out = jax.block_until_ready(call())
    compile_s = time.perf_counter() - t0
    heavy = b * r * h > 100_000
    t = measure(call, groups=5 if heavy else 10, inner=5 if heavy else 20)
    t.update(kernel_times(call, 3 if heavy else 10), compile_s=compile_s,
             finite=bool(jnp.isfinite(jax.tree.leaves(out)[0]).all()))
    flops = 4 * b * r * h * w * 512
    t["TFLOPs"] = flops / t["median_us"] / 1e6
    return t


_TIME_CACHE: dict = {}


def time_inputs(b, r, h, w, ctx, n_sets=3):
    """Cache of b sequences x ctx tokens (fp8, permuted tables) and n_sets of (q, sel):
    distinct random pools of 4 tokens, then the newest tokens as the tail (as the bench)."""
    import jax
    import jax.numpy as jnp

    key = (b, r, h, w, ctx)
    if key in _TIME_CACHE:
        return _TIME_CACHE[key]
    bs, kp = 64, 4
    mb = ctx // bs
    k = jax.random.split(jax.random.key(b * 7 + r), 2)
    lat = jnp.clip(jax.random.normal(k[0], (b * mb, bs, 512), jnp.float32) * 64, -448,
                   448).astype(jnp.float8_e4m3fn)
    tables = jax.random.permutation(k[1], b * mb).reshape(b, mb).astype(jnp.int32)
    rng = np.random.default_rng(b + r)
    npool = min(w // kp, ctx // kp)
    tail = w - npool * kp
    sets = []
    for _ in range(n_sets):
        q = rng.standard_normal((b, r, h, 512), np.float32)
        u = rng.random((b * r, ctx // kp), np.float32)
        pools = np.argpartition(u, npool - 1, axis=1)[:, :npool]
        rng.permuted(pools, axis=1, out=pools)
        toks = (pools[..., None] * kp + np.arange(kp)).reshape(b, r, npool * kp)
        if tail:
            toks = np.concatenate([toks, np.broadcast_to(ctx - tail + np.arange(tail),
                                                         (b, r, tail))], -1)
        sets.append((jax.device_put(q), jax.device_put(toks.astype(np.int32))))
    _TIME_CACHE[key] = ((lat, jnp.float32(1 / 64), tables), sets)
    return _TIME_CACHE[key]


# ------------------------------------------------------------------------------ driver

def run_group(group: str, out_path: str, shapes: str):
    if group.startswith("mosaic"):  # ptxas' registers and spills of each Mosaic kernel, also
        os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")  # when run in this process
    import jax

    from dsa_jax.pallas import sparse_attend_mgpu as mg

    res = {"group": group, "jax": jax.__version__, "device": str(jax.devices()[0]),
           "core_count": getattr(jax.devices()[0], "core_count", None), "checks": [],
           "times": [], "errors": []}

    def dump():
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    vs = variants(group)
    if group == "mosaic-smoke":  # one small case first: a hung kernel costs little here
        shapes = ""
    # Every variant on the same inputs, its output `==` the default's (the same f16 operands
    # and fp32 sums in the same order), each checked then timed in turn.
    shared_groups = ("prep", "smoke", "mosaic", "mosaic-all", "mosaic-smoke")
    shared = {i: {} for i in range(len(CHECK_CASES))} if group in shared_groups else None
    variant_major = group in shared_groups

    def time_row(name, kw, key):
        row = {"variant": name, "shape": SHAPES[key][0]}
        try:
            row.update(time_shape(key, kw))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            res["errors"].append(traceback.format_exc()[-1500:])
        res["times"].append(row)
        print(json.dumps(row, default=str), flush=True)
        dump()

    diags = {"prep": ("floor", "kernel"), "smoke": ("floor",)}.get(group, ())
    for key in shapes if diags else "":  # the dispatch floor, the Mosaic kernel alone
        for diag in diags:
            time_row(f"diag-{diag}", dict(diag=diag), key)
    for name, (kw, op) in vs.items():
        cases = CHECK_CASES if group in ("mosaic-all", "prep") else CHECK_CASES[:1]
        if group == "mosaic-all" and name not in FULL_CHECKS:
            cases = CHECK_CASES[:1] if name in ONE_CHECK else CHECK_CASES[:3]
        if group in ("mosaic-smoke", "smoke"):
            cases = CHECK_CASES[2:3]
        for i, case in enumerate(cases):
            try:
                if shared is None:
                    row = check_case(name, kw, op, case, seed=1000 + 17 * i + len(name))
                else:  # the same inputs for every variant: their outputs compared bitwise
                    row = check_case(name, kw, op, case, seed=1000 + 17 * i, shared=shared[i])
            except Exception as e:
                row = {"variant": name, "case": case_label(case), "ok": False,
                       "error": f"{type(e).__name__}: {str(e)[:400]}"}
                res["errors"].append(traceback.format_exc()[-1500:])
            res["checks"].append(row)
            print(json.dumps(row), flush=True)
            dump()
        if (group == "prep" and kw["tuning"].mosaic.prep == "triton") or group == "smoke":
            try:
                rows = attend_prep_diag.prep_bitwise(
                    name, mg.MgpuTuning(prep="triton", prep_per_sm=1) if group == "smoke"
                    else kw["tuning"].mosaic, check_inputs, interpret=group == "smoke")
            except Exception as e:
                rows = [{"variant": name, "case": "prep-bitwise", "ok": False,
                         "error": f"{type(e).__name__}: {str(e)[:400]}"}]
                res["errors"].append(traceback.format_exc()[-1500:])
            for row in rows:
                res["checks"].append(row)
                print(json.dumps(row), flush=True)
            dump()
        if variant_major and not (group == "mosaic" and name == "mosaic-default"):
            for key in shapes:  # checked, then timed: a later variant that hangs costs itself
                if key == "p" and group.startswith("mosaic") and name not in P_VARIANTS:
                    continue
                time_row(name, kw, key)
    if group == "mosaic":  # the default timed last: runs 4-7 measured it already
        for key in shapes:
            time_row("mosaic-default", vs["mosaic-default"][0], key)
    for key in "" if variant_major else shapes:
        for name, (kw, _) in vs.items():
            if key == "p" and name not in P_VARIANTS:
                continue
            time_row(name, kw, key)
    dump()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--group", default=None, help="run one group in this process")
    ap.add_argument("--groups", default="mosaic-smoke,mosaic")
    ap.add_argument("--shapes", default="abp")
    ap.add_argument("--limit-s", default="80,260", help="time limit per group, in order")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, in this process")
    a = ap.parse_args()
    if a.smoke:
        run_group("smoke", a.out, "s")
        with open(a.out) as f:
            res = {"command": " ".join(sys.argv), "groups": {"smoke": json.load(f)}}
        print_table(res)
        bad = [c for c in res["groups"]["smoke"]["checks"] if not c.get("ok")]
        sys.exit(1 if bad or res["groups"]["smoke"]["errors"] else 0)
    if a.group:
        run_group(a.group, a.out, a.shapes)
        return
    t_start = time.time()
    res = {"command": " ".join(sys.argv), "groups": {}}
    outdir = tempfile.mkdtemp(prefix="attend-parts-")  # merged into --out: one file comes back
    limits = [int(x) for x in a.limit_s.split(",")]
    for gi, g in enumerate(a.groups.split(",")):
        part = os.path.join(outdir, f"part-{g}.json")
        log = os.path.join(outdir, f"log-{g}.txt")
        if g in ("mosaic", "mosaic-all") and res["groups"].get(  # a smoke run that failed
                "mosaic-smoke", {}).get("rc") not in (0, None):
            res["groups"][g] = {"skipped": "the smoke group did not finish"}
            continue
        env = dict(os.environ)
        if g.startswith("mosaic"):
            env["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # registers and spills of each Mosaic kernel
        t0 = time.time()
        with open(log, "w") as lf:
            try:
                p = subprocess.run([sys.executable, __file__, "--out", part, "--group", g,
                                    "--shapes", a.shapes], env=env, stdout=lf,
                                   stderr=subprocess.STDOUT,
                                   timeout=limits[min(gi, len(limits) - 1)])
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        try:
            with open(part) as f:
                res["groups"][g] = json.load(f)
        except Exception as e:
            res["groups"][g] = {"error": f"no results: {e}"}
        res["groups"][g]["rc"] = rc
        res["groups"][g]["wall_s"] = time.time() - t0
        with open(log) as f:
            lines = f.read().splitlines()
        res["groups"][g]["ptxas"] = [ln for ln in lines if "registers" in ln or "spill" in ln
                                     or "bytes stack" in ln][:40]
        res["groups"][g]["log_tail"] = lines[-30:]
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    res["wall_s"] = time.time() - t_start
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print_table(res)


def print_table(res):
    print("\n== checks (max err / derived bound; ok) ==")
    for g in res["groups"].values():
        for c in g.get("checks", []):
            print(f"{c['variant']:22s} {c['case'][:44]:44s} "
                  f"{c.get('max_err_over_bound', float('nan')):8.3g} ok={c.get('ok')} "
                  f"eq={c.get('equal_to_default', c.get('equal', '-'))} "
                  f"{c.get('error', '')[:60]}")
    print("\n== times (wall median us, largest kernel us, all kernels us, TFLOP/s) ==")
    for g in res["groups"].values():
        for t in g.get("times", []):
            ks = t.get("kernels") or [["", 0]]
            print(f"{t['variant']:22s} {t['shape'][:34]:34s} {t.get('median_us', 0):9.1f} "
                  f"{ks[0][1]:9.1f} {t.get('total_us', 0):9.1f} {t.get('TFLOPs', 0):6.1f} "
                  f"{t.get('error', '')[:50]}")
            print("    " + "; ".join(f"{n[:28]} {v}" for n, v in ks[:5]))
    for k, g in res["groups"].items():
        print(f"group {k}: rc={g.get('rc')} wall={g.get('wall_s', 0):.0f}s")


if __name__ == "__main__":
    main()
