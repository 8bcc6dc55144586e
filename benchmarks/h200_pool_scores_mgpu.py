"""H200: the Mosaic GPU pool-scores kernel (`pallas/pool_scores_mgpu.py`) beside the Triton one
(`pallas/pool_scores.py`), checked and timed (issue #14).

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. python3 benchmarks/h200_pool_scores_mgpu.py --out $OUT/x
    PYTHONPATH=. python3 benchmarks/h200_pool_scores_mgpu.py --smoke --out /tmp/psm   # CPU

Cases (GLM-5.3-Flash indexer: Hi 32, Di 128, P 4096 at 16K), inputs as
`benchmarks.workloads.selection_inputs` builds them: `b64` (64 sequences x 1 row), `b64-r4`
(64 x 4 rows, the last 3 padding, as the padded decode runs it), `b1-r4` (1 x 4, one real),
and a 9000-row prompt from an empty context (row t has (t + 1) // 4 candidates).
Per variant: every output against the float64 definition within the derived tf32x3 bound
(`testing.pool_scores_bound`), -inf exactly past the candidates, no -0.0; the largest
|mosaic - triton| over the bound; then `wall_us` and `kernel_us` (profiler trace).
Batch independence (SPEC: a row's scores are the same bits whatever it is batched with), `==`:
rows of b64 scored alone (batch 1) against the batch; b64's rows as the first of 4 rows per
sequence (b64-r4's layout, the other 3 random live rows) against b64; chunk counts 1 / 3 /
default against each other; prompt rows scored alone against the prompt batch.
With `--smoke` (CPU) the Mosaic kernel cannot run: its variants are lowered for cuda only and
the Triton ones run in interpret mode at tiny shapes. JSON: <out>/h200-pool-scores-mgpu.json.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_script import (
    command,
    index_config,
    results_path,
    sweep_parser,
    utc_now,
    write_json,
)
from benchmarks.harness import sweep_row, sweep_times
from benchmarks.workloads import prompt_selection_inputs, selection_inputs
from dsa_jax import layer
from dsa_jax import testing as T
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_scores_mgpu as pm

HUNG = 3  # exit status after a row outlived --row-timeout-s (a kernel that never finished)


def _row(res, row, work, path, scale=1.0):
    """`harness.sweep_row`, skipping a row a resumed run has already recorded, and with a
    watchdog: a row still running after res["row_timeout_s"] (a kernel waiting forever on a
    barrier) is recorded as hung with what it had so far, and the process exits with HUNG, so
    that a rerun with --resume goes on past it. scale: of the timeout, for a row of many
    compiles."""
    key = (row.get("case"), row.get("variant"), row.get("kind"))
    if key in res["done"] or row.get("variant") in res["hung"]:
        return
    print(f"start {key}", flush=True)

    def hung():
        row["error"] = f"hung: still running after {scale * res['row_timeout_s']} s"
        res["results"].append(row)
        res["errors"].append(f"hung: {key}")
        with open(path, "w") as f:
            json.dump({k: v for k, v in res.items() if k not in ("done", "hung")}, f, indent=1,
                  default=str)
        print(json.dumps(row, default=str), flush=True)
        os._exit(HUNG)

    timer = threading.Timer(scale * res["row_timeout_s"], hung)
    timer.start()
    try:
        done, hung_ = res.pop("done"), res.pop("hung")
        try:
            sweep_row(res, row, work, path)
        finally:
            res["done"], res["hung"] = done, hung_
    finally:
        timer.cancel()

S, M = ps.PoolScoresTuning, pm.MgpuScoresTuning
F32, BF16 = jnp.float32, jnp.bfloat16

# Round 1 (h200-pool-scores-mgpu-20261201-r1.json): tf32x3 default 53.8 us at b64 (Triton
# 69.8), 4 stages + fuse_qlo + raw keys as hi 40.6; raw keys as hi gave the same bits (the
# tensor core ignores an fp32 word's low 13 bits); 2 rows per CTA bit-equal to 1 and the fastest
# prompt (1233 vs 1993 us). Round 2 (-r2.json, budget 50 s: no Mosaic prompt rows): the bf16x6
# path, persistent CTAs, the fast tf32 combos. "mosaic" is the default (`fit`'s schedule).
_NF = dict(write_hi=False, fuse_qlo=True)
VARIANTS = {
    "triton": S(),  # today's default
    "triton-rows1": S(rows_per_program=1),  # r4: one row per program (86.8 us, notes)
    "mosaic": S(backend="mosaic"),
    "mosaic-nohi-fuse-s4": S(backend="mosaic", mosaic=M(stages=4, **_NF)),
    "mosaic-fuse-s4": S(backend="mosaic", mosaic=M(fuse_qlo=True, stages=4)),
    "mosaic-nohi-s4": S(backend="mosaic", mosaic=M(write_hi=False, stages=4)),
    "mosaic-nohi-fuse-rows2": S(backend="mosaic", mosaic=M(rows=2, **_NF)),
    "mosaic-nohi-fuse-pers": S(backend="mosaic", mosaic=M(persistent=True, **_NF)),
    "mosaic-bf16": S(backend="mosaic", mosaic=M(precision="bf16x6")),
    "mosaic-bf16-s4": S(backend="mosaic", mosaic=M(precision="bf16x6", stages=4)),
    "mosaic-bf16-1c-s4": S(backend="mosaic", mosaic=M(precision="bf16x6", consumers=1,
                                                      stages=4)),
    "mosaic-bf16-rows2": S(backend="mosaic", mosaic=M(precision="bf16x6", rows=2)),
    "mosaic-bf16-pers": S(backend="mosaic", mosaic=M(precision="bf16x6", persistent=True)),
    "mosaic-bf16-pers-s4": S(backend="mosaic", mosaic=M(precision="bf16x6", persistent=True,
                                                        stages=4)),
    "mosaic-bf16-pers-rows2": S(backend="mosaic", mosaic=M(precision="bf16x6",
                                                           persistent=True, rows=2)),
    # Tenth session: bf16 pool keys (a bf16 index cache stores them so), "bf16x3".
    "bf16keys": S(backend="mosaic"),
    "bf16keys-s2": S(backend="mosaic", mosaic=M(stages=2)),
    "bf16keys-s8": S(backend="mosaic", mosaic=M(stages=8)),
    "bf16keys-1c-s4": S(backend="mosaic", mosaic=M(consumers=1, stages=4)),
    "bf16keys-bp128": S(backend="mosaic", mosaic=M(block_p=128, stages=4)),
    "bf16keys-rows2": S(backend="mosaic", mosaic=M(rows=2)),
    "bf16keys-pers": S(backend="mosaic", mosaic=M(persistent=True)),
    "bf16keys-triton": S(backend="triton"),
}
# The key dtype each variant reads (the inputs' keys, bf16 values under GLM-5.3's bf16 index
# cache, are cast to it: the same values, fp32 ones read at twice the bytes).
KEY_DTYPE = {v: BF16 if v.startswith("bf16keys") else F32 for v in VARIANTS}
CORE = ("triton", "mosaic-nohi-fuse-s4", "mosaic-bf16", "bf16keys")  # whatever the budget
SUBSETS = {
    "b64": ["triton", "mosaic-nohi-fuse-s4", "mosaic-bf16", "mosaic", "mosaic-fuse-s4",
            "mosaic-nohi-s4", "mosaic-bf16-s4", "mosaic-bf16-1c-s4", "mosaic-nohi-fuse-pers",
            "mosaic-bf16-pers-s4", "bf16keys", "bf16keys-s2", "bf16keys-s8", "bf16keys-1c-s4",
            "bf16keys-bp128", "bf16keys-pers", "bf16keys-triton"],
    "b64-r4": ["triton", "mosaic-nohi-fuse-s4", "mosaic-bf16", "mosaic", "mosaic-bf16-s4",
               "bf16keys", "bf16keys-s8"],
    "b1-r4": ["triton", "mosaic-nohi-fuse-s4", "mosaic-bf16", "bf16keys", "bf16keys-1c-s4"],
    "prefill": ["triton", "mosaic-nohi-fuse-rows2", "mosaic-bf16-rows2", "mosaic-bf16-pers",
                "mosaic-bf16-pers-rows2", "mosaic-nohi-fuse-pers", "bf16keys", "bf16keys-pers",
                "bf16keys-triton"],
}


def _fn(tun, smoke):
    if smoke and tun.backend == "mosaic":
        return None
    return jax.jit(functools.partial(ps.pool_scores_pallas, interpret=smoke, tuning=tun))


def _lowers(tun, args) -> bool:
    fn = functools.partial(ps.pool_scores_pallas, tuning=tun)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("custom_call @mosaic_gpu") == 1


def _checks(out, ref, bound, rows=None) -> dict:
    out = np.asarray(out) if rows is None else np.asarray(out)[:, rows]
    fin = ~np.isneginf(ref)
    err = np.abs(out[fin] - ref[fin]) / bound[fin]
    return {"neginf_pattern_ok": bool(np.array_equal(np.isneginf(out), ~fin)),
            "no_neg_zero": bool(not (np.signbit(out) & (out == 0)).any()),
            "within_bound": bool((err <= 1).all()),
            "max_err_over_bound": float(err.max()) if err.size else 0.0}


def _run_case(res, path, name, args, smoke, check_rows=None, heavy=False, only=None):
    """The variants of SUBSETS[name] (those in `only` if given) on args = (qi, w, keys,
    n_cand); past the time budget only CORE."""
    qi, w, keys, n_cand = args
    sub = [np.asarray(a) for a in args]
    if check_rows is not None:
        sub = [sub[0][:, check_rows], sub[1][:, check_rows], sub[2], sub[3][:, check_rows]]
    refs = {}

    def ref_bound(dt):  # the definition and bound of the keys as the variant reads them
        if dt not in refs:
            kd = np.asarray(jnp.asarray(sub[2]).astype(dt))
            refs[dt] = (T.pool_scores_definition(sub[0], sub[1], kd, sub[3]),
                        T.pool_scores_bound(sub[0], sub[1], kd, T.TF32X3_ROUNDOFF))
        return refs[dt]

    ref, bound = ref_bound(F32)
    outs = {}
    if "triton" not in (only or ["triton"]):  # the reference of max_diff_to_triton
        outs["triton"] = np.asarray(_fn(VARIANTS["triton"], smoke)(qi, w, keys, n_cand))
    for vname in SUBSETS[name]:
        if only is not None and vname not in only:
            continue
        if time.monotonic() > res["deadline"] and vname not in CORE:
            continue
        tun = VARIANTS[vname]
        row = {"case": name, "variant": vname, "shape": [int(s) for s in qi.shape],
               "P": int(keys.shape[1]),
               "tuning": str(tun.mosaic if tun.backend == "mosaic" else tun)}

        def work(row, tun=tun, vname=vname):
            fn = _fn(tun, smoke)
            kv = keys.astype(KEY_DTYPE[vname])
            row["key_dtype"] = jnp.dtype(kv.dtype).name
            if fn is None:
                row["lowers_for_cuda"] = _lowers(tun, (qi, w, kv, n_cand))
                row["ok"] = row["lowers_for_cuda"]
                return
            out = np.asarray(fn(qi, w, kv, n_cand))
            outs[vname] = out
            ref, bound = ref_bound(KEY_DTYPE[vname])
            row.update(_checks(out, ref, bound, check_rows))
            row["ok"] = all(row[c] for c in ("neginf_pattern_ok", "no_neg_zero",
                                             "within_bound"))
            if "triton" in outs and vname != "triton":
                a, b = outs["triton"], out
                if check_rows is not None:
                    a, b = a[:, check_rows], b[:, check_rows]
                fin = ~np.isneginf(ref)
                row["max_diff_to_triton_over_bound"] = float(
                    (np.abs(a[fin] - b[fin]) / bound[fin]).max()) if fin.any() else 0.0
                row["equal_to_triton"] = bool(np.array_equal(outs["triton"], out))
            row.update(sweep_times(functools.partial(fn, qi, w, kv, n_cand), heavy))

        _row(res, row, work, path)
    return outs


def _independence(res, path, args, smoke, prompt, base="mosaic"):
    """`==` for the kernel `VARIANTS[base]`: a row's scores alone and batched, 1 vs 4 rows per
    sequence, and under other schedules of the same arithmetic (chunk counts, stages, one
    consumer, persistent CTAs, 2 rows per CTA; for tf32x3 the hi parts written or not). Each
    check is recorded apart, so one that fails to compile leaves the others."""
    if smoke:
        return
    qi, w, keys, n_cand = args
    tun = VARIANTS[base]
    keys = keys.astype(KEY_DTYPE[base])
    fn = _fn(tun, smoke)
    rng = np.random.default_rng(5)
    row = {"case": "b64+prefill", "variant": base, "kind": "batch_independence",
           "check_errors": {}}
    b = qi.shape[0]
    pq, pw, pk, pn = prompt
    pk = pk.astype(KEY_DTYPE[base])
    some = [5, 4097, 8999]
    got = {}

    def same(a, b_):
        return bool(np.array_equal(np.asarray(a), np.asarray(b_)))

    def cached(key, make):
        if key not in got:
            got[key] = np.asarray(make())
        return got[key]

    def full():
        return cached("full", lambda: fn(qi, w, keys, n_cand))  # [B, 1, P]

    def pfull(t=tun):
        return cached(str(t), lambda: _fn(t, smoke)(pq, pw, pk, pn))

    def r4():
        q4 = jnp.concatenate([qi, jnp.asarray(rng.standard_normal((b, 3) + qi.shape[2:],
                                                                  np.float32))], axis=1)
        w4 = jnp.concatenate([w, jnp.asarray(
            rng.standard_normal((b, 3, qi.shape[2]), np.float32) * 0.02)], axis=1)
        nc4 = jnp.concatenate([n_cand, jnp.full((b, 3), keys.shape[1] // 2, jnp.int32)], 1)
        return same(np.asarray(fn(q4, w4, keys, nc4))[:, :1], full())

    def with_(**kw):
        return dataclasses.replace(tun, mosaic=dataclasses.replace(tun.mosaic, **kw))

    checks = {
        "alone_equal_batched": lambda: all(
            same(np.asarray(fn(qi[i:i + 1], w[i:i + 1], keys[i:i + 1], n_cand[i:i + 1]))[0],
                 full()[i]) for i in (0, 17, 63)),
        "r4_row0_equal_r1": r4,
        "prompt_rows_alone_equal": lambda: same(
            fn(pq[:, some], pw[:, some], pk, pn[:, some]), pfull()[:, some]),
        "prompt_row_single_equal": lambda: same(
            fn(pq[:, 4097:4098], pw[:, 4097:4098], pk, pn[:, 4097:4098]),
            pfull()[:, 4097:4098]),
    }
    for c in (1, 3, 7):
        checks[f"chunks{c}_equal"] = functools.partial(
            lambda c: same(_fn(with_(chunks=c), smoke)(qi, w, keys, n_cand), full()), c)
    # the same arithmetic in other schedules: must give the same bits (write_hi: where the
    # tensor core ignores an fp32 word's low 13 bits, as round 1 found)
    same_sums = {"stages2": dict(stages=2), "one_consumer": dict(consumers=1, stages=2),
                 "persistent": dict(persistent=True, stages=2)}
    if tun.mosaic.precision in ("tf32x3", None) and KEY_DTYPE[base] == F32:
        same_sums["write_hi"] = dict(write_hi=True)
    for v, kw in same_sums.items():
        checks[f"{v}_equal"] = functools.partial(
            lambda kw: same(_fn(with_(**kw), smoke)(qi, w, keys, n_cand), full()), kw)
    checks["rows2_equal"] = lambda: same(pfull(with_(rows=2, stages=2)), pfull())
    checks["prompt_persistent_equal"] = lambda: same(
        pfull(with_(persistent=True, stages=2)), pfull())

    def work(row):
        for key, check in checks.items():
            try:
                row[key] = bool(check())
            except Exception as e:  # recorded; the other checks go on
                row["check_errors"][key] = f"{type(e).__name__}: {str(e)[:300]}"
        row["ok"] = not row["check_errors"] and all(
            v for k, v in row.items() if k.endswith(("_equal", "_batched", "_r1")))

    _row(res, row, work, path, scale=3.0)


def main() -> int:
    ap = sweep_parser("tiny shapes; Mosaic only lowered (CPU)", 100.0,
                      "after this many seconds only the CORE variants run")
    ap.add_argument("--row-timeout-s", type=float, default=30.0,
                    help="a row running longer is recorded as hung and the run exits (3)")
    ap.add_argument("--independence", nargs="*", default=["mosaic-nohi-fuse-s4", "mosaic-bf16",
                                                          "bf16keys"],
                    help="variants whose batch independence is checked")
    ap.add_argument("--subsets", nargs="*", default=None,
                    help="variants to run in every case (default: SUBSETS)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of an earlier run's JSON and skip them")
    args = ap.parse_args()
    path = results_path(args.out, "h200-pool-scores-mgpu.json")
    if args.subsets is not None:
        for name in SUBSETS:
            SUBSETS[name] = list(args.subsets)
    smoke = args.smoke
    cfg = index_config(smoke)
    res = {"command": command("h200_pool_scores_mgpu.py"), "date": utc_now(),
           "deadline": time.monotonic() + args.budget_s, "jax_version": jax.__version__,
           "device": jax.devices()[0].device_kind,
           "shape": {"Hi": cfg.index_n_heads, "Di": cfg.index_head_dim, "P": cfg.num_pools},
           "results": [], "errors": [], "row_timeout_s": args.row_timeout_s}
    if args.resume and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        res["results"], res["errors"] = old["results"], old["errors"]
        res["resumed"] = old.get("resumed", 0) + 1
    res["done"] = {(r.get("case"), r.get("variant"), r.get("kind"))
                   for r in res["results"]}
    # a variant that hung once is not run again (each rerun would hang on it)
    res["hung"] = {r.get("variant") for r in res["results"]
                   if str(r.get("error", "")).startswith("hung")}
    cases = [("b64", 64, 1), ("b64-r4", 64, 4), ("b1-r4", 1, 4)] if not smoke else [
        ("b64", 3, 1), ("b64-r4", 2, 4), ("b1-r4", 1, 4)]
    # the prompt: rows share one sequence's keys; checked on every 97th row
    n = 9000 if not smoke else 50
    prompt = prompt_selection_inputs(cfg, n)
    for i, (name, b, r) in enumerate(cases):
        keys, pos, valid, sets = selection_inputs(cfg, b, r, cfg.max_context, 300 + r)
        qi, w = sets[0]
        n_cand = layer.candidate_pools(cfg, pos, valid)  # [B, R]
        the = (qi, w, keys, n_cand)
        if i == 0:  # the core variants and the SPEC's property first, in the time budget
            _run_case(res, path, name, the, smoke, only=CORE)
            for base in args.independence:
                _independence(res, path, the, smoke, prompt, base)
            _run_case(res, path, name, the, smoke,
                      only=[v for v in SUBSETS[name] if v not in CORE])
        else:
            _run_case(res, path, name, the, smoke)
    _run_case(res, path, "prefill", prompt, smoke, check_rows=np.arange(0, n, 97), heavy=True)
    res.pop("done")
    res.pop("hung")
    write_json(res, path)
    print(f"errors: {len(res['errors'])}; wrote {path}", flush=True)
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
