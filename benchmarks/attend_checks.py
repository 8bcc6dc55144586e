"""Pieces of benchmarks/h200_attend.py: its check cases and timed shapes, the random inputs of
each, the derived elementwise bound of tests/test_attend_kernel.py, one variant's check on one
case against the jnp twin, and the timing of one variant on one shape (wall-clock median and
the profiler's device kernel times). jax is imported inside the functions: the script sets
the Mosaic ptxas dump in its environment before jax loads.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from benchmarks import h200_attend_prep as attend_prep_diag

E32 = 2.0 ** -24
U = {"bfloat16": 2.0 ** -9, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
# Timed shapes: (name, B, R, H, W, ctx).
SHAPES = {
    "a": ("attend-kernel-64x1-h64-w2051", 64, 1, 64, 2051, 16384),
    "b": ("attend-kernel-128x2-h128-w2048", 128, 2, 128, 2048, 16384),
    "p": ("prefill-chunk-1x2048-h64-w2051", 1, 2048, 64, 2051, 16384),
    "d": ("decode-b1-1x1-h64-w2051", 1, 1, 64, 2051, 16384),  # decode-b1's attend
    "s": ("smoke-2x1-h5-w70", 2, 1, 5, 70, 256),  # --smoke only (CPU)
}


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


def bound(q, lat8, kv, tables, sel, scale, u, row_sub=None, half=False):
    """The elementwise bound of tests/test_attend_kernel.py, [B, R, 1, 1] (float64); half:
    with its f16 partials' term (`MgpuTuning.half_partials`)."""
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
    part_u, part_floor = (U["float16"], 2.0 ** -25 * float(kv)) if half else (0.0, 0.0)
    return 2.0 * ((np.expm1(2 * d) + u + extra + part_u + 4 * (w + 16) * E32) * m
                  + part_floor)[..., None, None]


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


def check_case(name, kw, op, case, seed, shared=None, reordered=()):
    """One variant on one case. shared (prep group): inputs, twin and bound computed once per
    case for every variant, and the default's output, which every other variant must equal
    bitwise unless named in `reordered` (its fp32 sums run in another order: the equality is
    recorded, not required)."""
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
    tuning = kw.get("tuning")
    if tuning is not None and tuning.mosaic.half_partials:  # its partials' rounding too
        _, rscale = mg.scale_rows_f16(jax.numpy.asarray(args[0].reshape(b * r, h, c)))
        bnd = bound(*args, scale, U[op], (2.0 ** -25) * np.asarray(rscale, np.float64).reshape(
            b, r), half=True)
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
            if name not in reordered:
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
    """`harness.measure`'s median, min and max microseconds (the fields this script writes)."""
    from benchmarks import harness

    t = harness.measure(call, warmup=warmup, groups=groups, inner=inner)
    return {k: t[k] for k in ("median_us", "min_us", "max_us")}


def kernel_times(call, calls=10):
    """Device time per call of each kernel name (profiler trace), largest first."""
    import jax

    from benchmarks import harness

    jax.block_until_ready(call())
    ev = harness.trace_events(call, calls)
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

