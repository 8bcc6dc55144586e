"""H200: the raw Triton top-k (pallas/pool_topk_triton.py, through jax-triton) against the
Pallas top-k (pallas/pool_topk.py) and lax.top_k, checked with `==` and timed (issue #14).

    pip install --no-deps benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl -q
    PYTHONPATH=. python3 benchmarks/h200_topk_triton.py --out $OUT/topk
    PYTHONPATH=. python3 benchmarks/h200_topk_triton.py --smoke --out /tmp/topk   # CPU, seconds

Installs nothing itself (the command above puts jax-triton in first). Parts, in order:
  1. k 512 of P 4096 (GLM-5.3-Flash at 16K), the cases the layer feeds the top-k: 64 decode
     rows (`selection-b64`'s scores, from the default pool-scores kernel), the padded decode
     (256 rows, 192 all -inf), batch 1 (4 rows, 1 live), a 9000-row prompt (row t has
     (t + 1) // 4 finite scores: its first 2048 rows have fewer than k). Every variant `==`
     lax.top_k on the scores and on a tied copy, then timed (`wall_us`: median of back-to-back
     calls; `kernel_us`: device kernel time per call from a profiler trace).
  2. the selection as the `selection-b64` / `selection-b64-r4` bench points time it (pool
     scores, top-k, expansion in one jit) with each top-k: `==` across the top-ks, timed.
  3. odd shapes (P, k not powers of two, k == P, k == 1, ties, -0.0, all -inf, all equal):
     `==` lax.top_k and the sorted definition (`testing.topk_definition`).
  4. the remaining variants at GLM shapes, while the time budget lasts.
`--smoke` (CPU): tiny shapes, the Pallas kernel in interpret mode; the raw Triton rows are
recorded as skipped (jax-triton lowers for GPUs only). JSON: <out>/h200-topk-triton.json.
"""

from __future__ import annotations

import functools
import time
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_script import command, index_config, results_path, sweep_parser, utc_now
from benchmarks.harness import profile, sweep_row, sweep_times
from benchmarks.workloads import Cycle, selection_inputs
from dsa_jax import indexer, layer, select
from dsa_jax import testing as T
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_topk as pt
from dsa_jax.pallas.pool_topk_triton import (
    MissingDependencyError,
    TritonTopkTuning,
    load_jax_triton,
)

K = pt.PoolTopkTuning


def _triton(**kw) -> pt.PoolTopkTuning:
    return K(backend="triton", triton=TritonTopkTuning(**kw))


# name -> tuning (None: lax.top_k). "pallas": today's default kernel.
VARIANTS = {
    "lax.top_k": None,
    "pallas": K(backend="pallas"),
    "triton-radix8-w8": _triton(method="radix", digit_bits=8, num_warps=8),
    "triton-radix8-w16": _triton(method="radix", digit_bits=8, num_warps=16),
    "triton-sample8-w8": _triton(method="sample", digit_bits=8, num_warps=8),
    "triton-sample8-w16": _triton(method="sample", digit_bits=8, num_warps=16),
    "triton-radix4-w8": _triton(method="radix", digit_bits=4, num_warps=8),
    "triton-topk-w8": _triton(method="topk", num_warps=8),
    "triton-radix8-w4": _triton(method="radix", digit_bits=8, num_warps=4),
    "triton-radix8-w8-noshort": _triton(method="radix", digit_bits=8, num_warps=8,
                                        short_rows=False),
    "triton-sample4-w8": _triton(method="sample", digit_bits=4, num_warps=8),
    "triton-radix4-w16": _triton(method="radix", digit_bits=4, num_warps=16),
    "triton-topk-w4": _triton(method="topk", num_warps=4),
    "triton-sort-w8": _triton(method="sort", num_warps=8),
    # Twenty-second session: the prefix branches (`TritonTopkTuning.prefix`, on by default
    # for the radix variants above; "sample" takes none) off, and 4 warps for the prompt's
    # quarter and half rows.
    "triton-radix4-w8-noprefix": _triton(method="radix", digit_bits=4, num_warps=8,
                                         prefix=False),
    "triton-radix4-w4": _triton(method="radix", digit_bits=4, num_warps=4),
}
# Round 1 measured lax.top_k and the Pallas kernel (h200-topk-triton-20261201-round1.json);
# the final run re-times the Pallas kernel beside the Triton variants.
FIRST = ["pallas", "triton-sample8-w8", "triton-radix8-w8"]
SELECTION = ["pallas"]  # + the fastest checked Triton variant of the case
SECOND = ["triton-sample8-w16", "triton-radix8-w16", "triton-topk-w8", "triton-radix4-w8",
          "triton-sample4-w8"]
PREFILL = ["triton-sample8-w8", "triton-radix8-w8", "pallas"]
# --prefill-only: the prompt's rows alone: the "auto" default for a prompt (radix4-w8, with
# the prefix branches) first, then without them, then other warps (the sixteenth session's
# digits and warps sweep: h200-topk-triton-20261202-s16-call3.json)
PREFILL_SWEEP = ["triton-radix4-w8", "triton-radix4-w8-noprefix", "triton-radix4-w4",
                 "triton-radix4-w16", "pallas"]
LATER = ["triton-radix8-w4", "triton-radix8-w8-noshort", "triton-radix4-w16",
         "triton-topk-w4", "triton-sort-w8"]
ODD_VARIANTS = ["triton-sample8-w8", "triton-radix8-w8", "triton-topk-w8", "triton-radix4-w8",
                "triton-sort-w8", "triton-radix8-w8-noshort"]


def _versions() -> dict:
    out = {}
    for dist in ("jax", "jaxlib", "triton", "jax-triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _jax_triton_status(smoke) -> str:
    if smoke:
        return "not loaded (smoke)"
    try:
        load_jax_triton()
        return "loaded"
    except MissingDependencyError as e:
        return str(e)


def _topk_fn(tuning, interpret):
    if tuning is None:
        return jax.jit(pt.pool_topk_xla, static_argnums=1)
    return jax.jit(functools.partial(pt.pool_topk_pallas, interpret=interpret, tuning=tuning),
                   static_argnums=1)


def _skip(name, smoke) -> bool:
    return smoke and name.startswith("triton")


def _late(res) -> bool:
    return time.monotonic() > res["deadline"]


def _glm_case(cfg, name, smoke):
    """(scores [N, P], heavy): the top-k inputs of the bench's selection points (the default
    pool-scores kernel's output), the batch-1 step and a prompt."""
    p, kp = cfg.num_pools, cfg.index_kpool
    if name.startswith("selection"):
        b, r = (3 if smoke else 64), (4 if name.endswith("r4") else 1)
        keys, pos, valid, sets = selection_inputs(cfg, b, r, cfg.max_context, 300 + r)
        qi, w = sets[0]
        scores = ps.pool_scores_pallas(qi, w, keys, layer.candidate_pools(cfg, pos, valid),
                                       interpret=smoke)  # [B, R, P]
        return scores.reshape(b * r, p), False
    if name == "decode-b1-r4":
        return T.topk_scores(5, 4, p, [p, 0, 0, 0], ties=False), False
    n = int(name.split("-")[1])  # prefill-N
    return T.topk_scores(9, n, p, (np.arange(n) + 1) // kp, ties=False), True


def _ties(scores):
    """Scores rounded to 1/64: many equal values (and -0.0 from small negatives)."""
    s = np.asarray(scores)
    return jnp.asarray(np.where(np.isneginf(s), -np.inf, np.round(s * 64) / 64)
                       .astype(np.float32))


def _run_topk(res, path, case, scores, heavy, names, k, smoke):
    ties = _ties(scores)
    xla = _topk_fn(None, smoke)
    ref, ref_ties = np.asarray(xla(scores, k)), np.asarray(xla(ties, k))
    some = slice(None, None, 1 if scores.shape[0] <= 1024 else 17)  # the host sort is slow
    res.setdefault("xla_equals_definition", {})[case] = bool(
        np.array_equal(ref[some], T.topk_definition(scores[some], k))
        and np.array_equal(ref_ties[some], T.topk_definition(ties[some], k)))
    for name in names:
        if _late(res):
            return
        row = {"part": "topk", "case": case, "rows": int(scores.shape[0]),
               "t_s": round(time.monotonic() - res["t0"], 2),
               "P": int(scores.shape[1]), "k": k, "variant": name,
               "tuning": str(VARIANTS[name])}
        if _skip(name, smoke):
            row["skipped"] = "smoke: jax-triton lowers for GPUs only"
            sweep_row(res, row, lambda row: None, path)
            continue

        def work(row, name=name):
            fn = _topk_fn(VARIANTS[name], smoke)
            t0 = time.perf_counter()
            out = np.asarray(fn(scores, k))
            row["first_call_s"] = time.perf_counter() - t0  # compile + run
            row["equal"] = bool(np.array_equal(out, ref))
            row["equal_ties"] = bool(np.array_equal(np.asarray(fn(ties, k)), ref_ties))
            row["ok"] = row["equal"] and row["equal_ties"]
            row.update(sweep_times(functools.partial(fn, scores, k), heavy, heavy_inner=2))

        sweep_row(res, row, work, path)


def _best_triton(res, case) -> str | None:
    rows = [r for r in res["results"] if r.get("part") == "topk" and r.get("case") == case
            and r.get("ok") and r["variant"].startswith("triton")]

    def t(r):
        return r["kernel_us"] if r.get("kernel_us") is not None else r.get("wall_us", 1e30)
    return min(rows, key=t)["variant"] if rows else None


def _selection(cfg, tuning, qi, w, keys, pos, valid):
    """measures._selection with an explicit top-k: None is lax.top_k."""
    scores = indexer.pool_scores(cfg, qi, w, keys, layer.candidate_pools(cfg, pos, valid))
    if tuning is None:
        pools = pt.pool_topk_xla(scores, min(cfg.select_k, scores.shape[-1]))
    else:
        pools = select.top_pools(cfg, scores, tuning)
    return select.expand_selection(cfg, pools, pos, valid)  # [B, R, W]


def _run_selection(res, path, cfg, case, b, r, smoke, names):
    keys, pos, valid, sets = selection_inputs(cfg, b, r, cfg.max_context, 300 + r)
    best = _best_triton(res, case)
    names = list(names) + ([best] if best else ["triton-sample8-w8"])
    base = {}
    for name in names:
        if _late(res):
            return
        row = {"part": "selection", "case": case, "B": b, "R": r, "variant": name,
               "t_s": round(time.monotonic() - res["t0"], 2)}
        if _skip(name, smoke):
            row["skipped"] = "smoke: jax-triton lowers for GPUs only"
            sweep_row(res, row, lambda row: None, path)
            continue

        def work(row, name=name):
            fn = jax.jit(functools.partial(_selection, cfg, VARIANTS[name]))
            out = np.asarray(fn(*sets[0], keys, pos, valid))
            base.setdefault("sel", out)
            row["equal_to_pallas"] = bool(np.array_equal(out, base["sel"]))
            call = Cycle(lambda q, ww: fn(q, ww, keys, pos, valid), sets)
            row.update(sweep_times(call, False))
            prof = profile(call, 20, top=6)
            row["top_kernels"] = prof.get("top_kernels")
            row["launches"] = prof.get("launches_per_step")

        sweep_row(res, row, work, path)


def _odd_cases():
    """(name, scores [N, P], k): shapes and values the GLM cases do not reach."""
    z = np.where(np.arange(96) % 2 == 0, 0.0, -0.0).astype(np.float32)  # [96] +0.0 / -0.0
    z[::7] = 1.5
    z[5::11] = -np.inf
    return [
        ("p300-k37", T.topk_scores(1, 3, 300, [300, 150, 37], ties=False), 37),
        ("p300-k37-ties", T.topk_scores(2, 3, 300, [300, 150, 37], ties=True), 37),
        ("p1000-k200-short", T.topk_scores(3, 3, 1000, [1000, 511, 3], ties=True), 200),
        ("p64-k64", T.topk_scores(4, 2, 64, [64, 33], ties=True), 64),
        ("p70-k1", T.topk_scores(5, 2, 70, [70, 0], ties=False), 1),
        ("p1-k1", T.topk_scores(6, 2, 1, [1, 0], ties=False), 1),
        ("signed-zeros-p96-k40", jnp.asarray(np.stack([z, z[::-1].copy()])), 40),
        ("all-equal-and-all-neginf-p4096-k512",
         jnp.asarray(np.stack([np.full(4096, 0.25, np.float32),
                               np.full(4096, -np.inf, np.float32)])), 512),
    ]


def _run_odd(res, path, names, smoke):
    for case, scores, k in _odd_cases():
        if _late(res):
            return
        ref = np.asarray(_topk_fn(None, smoke)(scores, k))
        defn = T.topk_definition(scores, k)
        res.setdefault("xla_equals_definition", {})[case] = bool(np.array_equal(ref, defn))
        for name in names:
            if _late(res):
                return
            row = {"part": "odd", "case": case, "P": int(scores.shape[-1]), "k": k,
                   "variant": name, "t_s": round(time.monotonic() - res["t0"], 2)}
            if _skip(name, smoke):
                row["skipped"] = "smoke: jax-triton lowers for GPUs only"
                sweep_row(res, row, lambda row: None, path)
                continue

            def work(row, name=name, scores=scores, k=k, ref=ref, defn=defn):
                out = np.asarray(_topk_fn(VARIANTS[name], smoke)(scores, k))
                row["equal"] = bool(np.array_equal(out, ref))
                row["equal_definition"] = bool(np.array_equal(out, defn))
                row["ok"] = row["equal"] and row["equal_definition"]

            sweep_row(res, row, work, path)


def main() -> int:
    ap = sweep_parser("tiny shapes, interpret mode (CPU)", 110.0,
                      "no new row starts after this many seconds")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only the 9000-row prompt, PREFILL_SWEEP's variants")
    args = ap.parse_args()
    path = results_path(args.out, "h200-topk-triton.json")
    smoke = args.smoke
    cfg = index_config(smoke)
    cfg = cfg.replace(implementation="pallas-interpret" if smoke else "pallas")
    res = {"command": command("h200_topk_triton.py"), "date": utc_now(),
           "t0": time.monotonic(), "deadline": time.monotonic() + args.budget_s,
           "versions": _versions(), "jax_triton": _jax_triton_status(smoke),
           "device": jax.devices()[0].device_kind,
           "shape": {"P": cfg.num_pools, "k": cfg.select_k}, "results": [], "errors": []}
    k = cfg.select_k
    cases = {}

    def topk(case, names):
        if _late(res):
            return
        if case not in cases:
            cases[case] = _glm_case(cfg, case, smoke)
        scores, heavy = cases[case]
        _run_topk(res, path, case, scores, heavy, names, k, smoke)

    if args.prefill_only:
        topk("prefill-40" if smoke else "prefill-9000", PREFILL_SWEEP)
        print(f"errors: {len(res['errors'])}; wrote {path}", flush=True)
        return 0
    # In order of what matters, each row skipped past the deadline (--budget-s).
    for case in ("selection-b64", "selection-b64-r4", "decode-b1-r4"):
        topk(case, FIRST)
    for case, b, r in [("selection-b64", 64, 1), ("selection-b64-r4", 64, 4)]:
        if not _late(res):
            _run_selection(res, path, cfg, case, 3 if smoke else b, r, smoke, SELECTION)
    _run_odd(res, path, ODD_VARIANTS[:1], smoke)
    for case in ("selection-b64", "decode-b1-r4"):
        topk(case, SECOND)
    topk("prefill-40" if smoke else "prefill-9000", PREFILL)
    _run_odd(res, path, ODD_VARIANTS[1:], smoke)
    for case in ("selection-b64-r4", "selection-b64", "decode-b1-r4"):
        topk(case, LATER)
    print(f"errors: {len(res['errors'])}; wrote {path}", flush=True)
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
