"""H200: variants of the selection's kernels (pool scores, top-k) at the bench's selection
shapes and the batch-1 step's, checked and timed side by side (issue #14).

    PYTHONPATH=. python3 benchmarks/h200_selection.py --out $OUT/select
    PYTHONPATH=. python3 benchmarks/h200_selection.py --smoke --out /tmp/sel   # CPU, seconds

Cases (GLM-5.3-Flash indexer: Hi 32, Di 128, P 4096 at max_context 16K, k 512), inputs as
`benchmarks.workloads.selection_inputs` builds them for the `selection-b64` (64 sequences, one
row) and `selection-b64-r4` (rows padded to max_verify 4, only the first real) points, and the
batch-1 step's selection (one real row of 4). Per case:
  1. pool-score variants (`PoolScoresTuning`): every output checked against the float64
     definition within the derived bound of the tests (`testing.pool_scores_bound`, 3-pass
     tf32), -inf exactly where the definition has it, and `==` against the default kernel
     (expected where the dot and sum run in the same order);
  2. top-k variants (`PoolTopkTuning`) on the default kernel's scores and on a copy with ties:
     `==` against `lax.top_k`;
  3. the selection as the bench point times it (scores, top-k, expansion in one jit), with the
     defaults and with the fastest checked variants of (1) and (2), and with the expansion
     written by the top-k kernel (`select.select_slots`, `==` against the unfused pair).
Last, top-k and pool-score variants on a 9000-token prompt's rows (top-k `==` against the
sorted definition; scores on every 97th row within the bound).
Times: `wall_us` (median of back-to-back calls) and `kernel_us` (device kernel time per call
from a profiler trace), as `benchmarks.harness.sweep_times`. JSON: <out>/h200-selection.json.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_script import command, index_config, results_path, sweep_parser, utc_now
from benchmarks.harness import profile, sweep_row, sweep_times
from benchmarks.workloads import Cycle, prompt_selection_inputs, selection_inputs
from dsa_jax import layer, select
from dsa_jax import testing as T
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_topk as pt

# K: the Pallas top-k's variants (the library's "auto" runs the Triton one at a prompt's rows)
S, K = ps.PoolScoresTuning, functools.partial(pt.PoolTopkTuning, backend="pallas")

# The first run (benchmarks/results/h200-selection-run1.json, commit 8e3429f: 20 score variants)
# found keys x qi^T with 64-pool tiles, one tile per program, fastest at 64 sequences (74 vs 95
# us), and the branch-free loop over live tiles fastest for a prompt (1.7 vs 3.9 ms); wider
# tiles, 8 warps, 6-pass bf16 and pipelined loops at decode shapes were slower. This run
# measures the neighbours of those two.
# "default": the defaults before issue #14's selection work, pinned (the baseline of every case);
# every variant pins the fields whose defaults changed after round 2.
SCORE_VARIANTS = {
    "default": S(block_p=64, num_chunks=None, target_programs=None, tiles_per_program=1,
                 rows_per_program=None, pools_as_m=False, bounded_loop=False,
                 precision="tf32x3", num_warps=4),
    "now": S(),  # the defaults chosen from round 2 (not in the runs so far)
    "pm-bp64": S(pools_as_m=True, bounded_loop=False, tiles_per_program=1),
    # 2 tiles per program: qi loaded and split once for both
    "pm-bp64-c32": S(pools_as_m=True, bounded_loop=False, num_chunks=32),
    "pm-bounded-bp64-t1056": S(pools_as_m=True, bounded_loop=True, target_programs=1056),
    "rows1-pm-bp64": S(rows_per_program=1, pools_as_m=True, bounded_loop=False,
                       tiles_per_program=1),
    "rows1-pm-bp64-c32": S(rows_per_program=1, pools_as_m=True, bounded_loop=False,
                           num_chunks=32),
    "bounded-t528": S(pools_as_m=False, bounded_loop=True, target_programs=528),
    "pm-bounded-bp64-t528": S(pools_as_m=True, bounded_loop=True, target_programs=528),
}

# Earlier sweeps (h200-topk.json): 8 warps were slower than 4 for one row (35.9 vs 29.4 us),
# so the split variants run at 4 warps, with one at 8 for comparison. (The first run of this
# script lost its top-k rows to a lowering error, fixed since.)
TOPK_VARIANTS = {
    "default": K(chunk=4096, rank_block=32, radix_bits=2, rank_splits=1, short_rows=False,
                 fused_compare=False, num_warps=4),
    "now": K(),  # the defaults chosen from round 2 (not in the runs so far)
    "short": K(short_rows=True, rank_splits=1),
    "short-fused": K(short_rows=True, rank_splits=1, fused_compare=True),
    "short-split2-fused": K(short_rows=True, rank_splits=2, fused_compare=True),
    "short-split4-fused": K(short_rows=True, rank_splits=4, fused_compare=True),
    "short-split8-fused": K(short_rows=True, rank_splits=8, fused_compare=True),
    "short-split16-fused": K(short_rows=True, rank_splits=16, fused_compare=True),
    "short-w8-split8-fused": K(short_rows=True, num_warps=8, rank_splits=8,
                               fused_compare=True),
    "short-radix4-split8-fused": K(short_rows=True, radix_bits=4, rank_splits=8,
                                   fused_compare=True),
}

# (name, B, R): the bench's selection points, then the batch-1 step's selection.
CASES = [("selection-b64", 64, 1), ("decode-b1-r4", 1, 4), ("selection-b64-r4", 64, 4)]
SMOKE_CASES = [("smoke-b3-r1", 3, 1), ("smoke-b2-r4", 2, 4)]
# Pool-score variants run per case (None: all); the batch-1 scores take ~6 us of the step.
SCORE_SUBSETS = {
    "selection-b64": ["default", "now", "pm-bp64", "pm-bp64-c32", "pm-bounded-bp64-t1056"],
    "decode-b1-r4": ["default", "now", "pm-bp64"],
    "selection-b64-r4": ["default", "now", "pm-bp64", "rows1-pm-bp64", "rows1-pm-bp64-c32"],
}
TOPK_SUBSETS = {
    "selection-b64": ["default", "now", "short-fused", "short-split2-fused", "short-split4-fused",
                      "short-split8-fused", "short-radix4-split8-fused"],
    "decode-b1-r4": ["default", "now", "short-fused", "short-split4-fused", "short-split8-fused",
                     "short-split16-fused", "short-w8-split8-fused",
                     "short-radix4-split8-fused"],
    "selection-b64-r4": ["default", "now", "short", "short-split2-fused", "short-split4-fused"],
}


def _selection(cfg, qi, w, keys, pos, valid, *, s_tuning, t_tuning, interpret, fused=False):
    """The bench's `selection` point (benchmarks/measures.py) with explicit kernel tunings;
    `fused`: the top-k kernel writes the token slots (`select.select_slots`)."""
    n_cand = layer.candidate_pools(cfg, pos, valid)  # [B, R]
    scores = ps.pool_scores_pallas(qi, w, keys, n_cand, interpret=interpret,
                                   tuning=s_tuning)  # [B, R, P]
    if fused:
        impl = "pallas-interpret" if interpret else "pallas"
        return select.select_slots(cfg.replace(implementation=impl), scores, pos, valid,
                                   tuning=t_tuning)  # [B, R, W]
    k = min(cfg.select_k, scores.shape[-1])
    pools = pt.pool_topk_pallas(scores, k, interpret=interpret, tuning=t_tuning)  # [B, R, k]
    return select.expand_selection(cfg, pools, pos, valid)  # [B, R, W]


def _definition(qi, w, keys, n_cand):
    """float64 definition and derived bound (3-pass tf32), for the rows with a candidate only
    (the padded rows' scores must be all -inf)."""
    live = np.asarray(n_cand)[0] > 0  # [R]: the same rows are real in every sequence
    qi_l, w_l, nc_l = (np.asarray(a)[:, live] for a in (qi, w, n_cand))
    ref = T.pool_scores_definition(qi_l, w_l, keys, nc_l)
    bound = T.pool_scores_bound(qi_l, w_l, keys, T.TF32X3_ROUNDOFF)
    return live, ref, bound


def _check_scores(out, live, ref, bound) -> dict:
    out = np.asarray(out)
    got = out[:, live]
    fin = ~np.isneginf(ref)
    return {"dead_rows_neginf": bool(np.isneginf(out[:, ~live]).all()),
            "neginf_pattern_ok": bool(np.array_equal(np.isneginf(got), ~fin)),
            "no_neg_zero": bool(not (np.signbit(out) & (out == 0)).any()),
            "within_bound": bool((np.abs(got[fin] - ref[fin]) <= bound[fin]).all()),
            "max_err_over_bound": float(np.max(np.abs(got[fin] - ref[fin]) / bound[fin]))}


def _best(res, case, kind, ok_key):
    """The checked variant with the least kernel time (wall time off a GPU)."""
    rows = [r for r in res["results"] if r.get("case") == case and r.get("kind") == kind
            and r.get(ok_key) and r.get("variant") != "lax.top_k"]

    def time_of(r):
        return r["kernel_us"] if r.get("kernel_us") is not None else r.get("wall_us", 1e30)
    return min(rows, key=time_of)["variant"] if rows else "default"


def _late(res, name) -> bool:
    """Past the time budget: only the defaults (and lax.top_k) still run."""
    return time.monotonic() > res["deadline"] and name not in ("default", "lax.top_k")


def _run_case(res, path, cfg, case, b, r, smoke, score_variants, topk_variants):
    """Scores variants, top-k variants, then the selection with the fastest checked ones."""
    k = cfg.select_k
    keys, pos, valid, sets = selection_inputs(cfg, b, r, cfg.max_context, 300 + r)
    qi, w = sets[0]
    n_cand = layer.candidate_pools(cfg, pos, valid)  # [B, R]
    live, ref, bound = _definition(qi, w, keys, n_cand)
    base = {}
    heavy = False

    # 1. pool scores
    subset = SCORE_SUBSETS.get(case)
    for name, tun in score_variants.items():
        if ((subset is not None and name not in subset) or _late(res, name)
                or (r == 1 and name.startswith("rows1-"))):  # one row: already 1 per program
            continue
        row = {"case": case, "kind": "scores", "B": b, "R": r, "variant": name,
               "tuning": str(tun)}

        def work(row, tun=tun, name=name):
            fn = jax.jit(functools.partial(ps.pool_scores_pallas, interpret=smoke,
                                           tuning=tun))
            out = np.asarray(fn(qi, w, keys, n_cand))
            if name == "default":
                base["scores"] = out
            row.update(_check_scores(out, live, ref, bound))
            row["equal_to_default"] = bool(np.array_equal(out, base["scores"]))
            row["ok"] = all(row[c] for c in ("dead_rows_neginf", "neginf_pattern_ok",
                                             "no_neg_zero", "within_bound"))
            row.update(sweep_times(functools.partial(fn, qi, w, keys, n_cand), heavy))

        sweep_row(res, row, work, path)

    # 2. top-k, on the default kernel's scores and on a copy with ties
    scores = jnp.asarray(base["scores"])
    ties = jnp.asarray(np.where(np.isneginf(base["scores"]), -np.inf,
                                np.round(base["scores"] * 64) / 64).astype(np.float32))
    xla = jax.jit(pt.pool_topk_xla, static_argnums=1)
    ref_k, ref_k_ties = np.asarray(xla(scores, k)), np.asarray(xla(ties, k))
    subset = TOPK_SUBSETS.get(case)
    for name, tun in [("lax.top_k", None)] + list(topk_variants.items()):
        if (subset is not None and name not in subset) or _late(res, name):
            continue  # lax.top_k: 34.5 / 33.8 / 67.5 us in run 1
        row = {"case": case, "kind": "topk", "B": b, "R": r, "variant": name,
               "tuning": str(tun)}

        def work(row, tun=tun):
            if tun is None:
                fn = xla
            else:
                fn = jax.jit(functools.partial(pt.pool_topk_pallas, interpret=smoke,
                                               tuning=tun), static_argnums=1)
            row["equal"] = bool(np.array_equal(np.asarray(fn(scores, k)), ref_k))
            row["equal_ties"] = bool(np.array_equal(np.asarray(fn(ties, k)), ref_k_ties))
            row["ok"] = row["equal"] and row["equal_ties"]
            row.update(sweep_times(functools.partial(fn, scores, k), heavy))

        sweep_row(res, row, work, path)

    # 3. the selection as the bench point times it
    best_s = _best(res, case, "scores", "ok")
    best_t = _best(res, case, "topk", "ok")
    best_t = best_t if best_t in topk_variants else "default"
    combos = [("default", "default", False), (best_s, best_t, False), (best_s, best_t, True)]
    sel_base = {}
    for s_name, t_name, fused in combos:
        row = {"case": case, "kind": "selection", "B": b, "R": r,
               "variant": f"{s_name} + {t_name}" + (" + fused expansion" if fused else "")}

        def work(row, s_name=s_name, t_name=t_name, fused=fused):
            fn = jax.jit(functools.partial(
                _selection, cfg, s_tuning=score_variants[s_name],
                t_tuning=topk_variants[t_name], interpret=smoke, fused=fused))
            out = np.asarray(fn(qi, w, keys, pos, valid))
            sel_base.setdefault("sel", out)
            if fused:  # the same kernels with the expansion apart: `==`
                row["equal_to_unfused"] = bool(np.array_equal(out, sel_base[s_name, t_name]))
            else:
                sel_base[s_name, t_name] = out
            row["equal_to_default"] = bool(np.array_equal(out, sel_base["sel"]))
            row["rows_differing"] = int((out != sel_base["sel"]).any(-1).sum())
            call = Cycle(lambda q, ww: fn(q, ww, keys, pos, valid), sets)
            row.update(sweep_times(call, heavy))
            prof = profile(call, 20, top=6)
            row["top_kernels"] = prof.get("top_kernels")
            row["launches"] = prof.get("launches_per_step")

        sweep_row(res, row, work, path)


PREFILL_SCORES = ["bounded-t528", "pm-bounded-bp64-t528", "now"]  # default: 3887 us in run 1


def _run_prefill_scores(res, path, cfg, smoke, score_variants):
    """Pool scores of a 9000-token prompt from an empty context (row t has (t + 1) // KP
    candidates; the rows share their sequence's keys): the variants must not cost the
    prefill what they save the decode. Checked on every 97th row against the definition."""
    n = 9000 if not smoke else 50
    qi, w, keys, n_cand = prompt_selection_inputs(cfg, n)
    some = np.arange(0, n, 97)  # rows checked against the float64 definition
    sub = (np.asarray(qi)[:, some], np.asarray(w)[:, some], np.asarray(keys),
           np.asarray(n_cand)[:, some])
    ref = T.pool_scores_definition(*sub)
    bound = T.pool_scores_bound(*sub[:3], T.TF32X3_ROUNDOFF)
    fin = ~np.isneginf(ref)
    for name in PREFILL_SCORES:
        if name not in score_variants or _late(res, name):
            continue
        row = {"case": f"prefill-{n}", "kind": "scores", "B": 1, "R": n, "variant": name,
               "tuning": str(score_variants[name])}

        def work(row, tun=score_variants[name]):
            fn = jax.jit(functools.partial(ps.pool_scores_pallas, interpret=smoke,
                                           tuning=tun))
            got = np.asarray(fn(qi, w, keys, n_cand))[:, some]
            row["neginf_pattern_ok"] = bool(np.array_equal(np.isneginf(got), ~fin))
            row["within_bound"] = bool((np.abs(got[fin] - ref[fin]) <= bound[fin]).all())
            row["ok"] = row["neginf_pattern_ok"] and row["within_bound"]
            row.update(sweep_times(functools.partial(fn, qi, w, keys, n_cand), True))

        sweep_row(res, row, work, path)


PREFILL_TOPK = ["default", "short", "short-fused", "now"]  # lax.top_k: 2006 us in run 1


def _run_prefill_topk(res, path, cfg, smoke, topk_variants):
    """The top-k of a 9000-token prompt's rows (row t has (t + 1) // KP candidates): the
    variants must not cost the prefill what they save the decode."""
    n = 9000 if not smoke else 50
    p, k = cfg.num_pools, cfg.select_k
    live = (np.arange(n) + 1) // cfg.index_kpool  # [n]
    scores = T.topk_scores(9, n, p, live, ties=False)
    ref = T.topk_definition(scores, k)
    for name in PREFILL_TOPK:
        tun = topk_variants.get(name)
        if (tun is None and name != "lax.top_k") or _late(res, name):
            continue
        row = {"case": f"prefill-{n}", "kind": "topk", "B": 1, "R": n, "variant": name,
               "tuning": str(tun)}

        def work(row, tun=tun):
            fn = (jax.jit(pt.pool_topk_xla, static_argnums=1) if tun is None else
                  jax.jit(functools.partial(pt.pool_topk_pallas, interpret=smoke,
                                            tuning=tun), static_argnums=1))
            row["equal"] = row["ok"] = bool(np.array_equal(np.asarray(fn(scores, k)), ref))
            row.update(sweep_times(functools.partial(fn, scores, k), True, heavy_inner=2))

        sweep_row(res, row, work, path)


def main() -> int:
    args = sweep_parser("tiny shapes in interpret mode (CPU)", 85.0,
                        "after this many seconds only the default variants run").parse_args()
    path = results_path(args.out, "h200-selection.json")
    smoke = args.smoke
    cfg = index_config(smoke)
    res = {"command": command("h200_selection.py"), "date": utc_now(),
           "deadline": time.monotonic() + args.budget_s, "jax_version": jax.__version__,
           "device": jax.devices()[0].device_kind,
           "shape": {"Hi": cfg.index_n_heads, "Di": cfg.index_head_dim, "P": cfg.num_pools,
                     "k": cfg.select_k}, "results": [], "errors": []}
    score_variants = SCORE_VARIANTS if not smoke else {
        n: v for n, v in SCORE_VARIANTS.items()
        if n in ("default", "now", "bounded-t528", "pm-bp64", "pm-bounded-bp64-t528")}
    topk_variants = TOPK_VARIANTS if not smoke else {
        n: v for n, v in TOPK_VARIANTS.items()
        if n in ("default", "now", "short", "short-split4-fused", "short-fused")}
    cases = SMOKE_CASES if smoke else CASES
    for case, b, r in cases[:2]:
        _run_case(res, path, cfg, case, b, r, smoke, score_variants, topk_variants)
    _run_prefill_topk(res, path, cfg, smoke, topk_variants)
    _run_prefill_scores(res, path, cfg, smoke, score_variants)
    for case, b, r in cases[2:]:
        _run_case(res, path, cfg, case, b, r, smoke, score_variants, topk_variants)
    print(f"errors: {len(res['errors'])}; wrote {path}", flush=True)
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
