"""H200: the Pallas top-k's radix select with and without its early exit
(`PoolTopkTuning.early_exit`), side by side on the scores the layer feeds it (issue #14).

    PYTHONPATH=. python3 benchmarks/h200_topk_exit.py --out $OUT
    PYTHONPATH=. python3 benchmarks/h200_topk_exit.py --smoke --out /tmp/tke   # CPU

Scores: GLM-5.3-Flash pool scores (`pool_scores_xla` of `workloads.selection_inputs`, bf16
keys) at 16K, as `layer.select_pools` takes them: 1 row (a decode, the selection cut to its
row), 4 rows (one real, three padded: -inf), 64 rows (64 sequences' decode rows), 256 rows
(64 sequences x 4, three padded each), and a 9000-row prompt (row t: (t + 1) // 4 live
pools). Each variant `==` `lax.top_k`; `wall_us` and `kernel_us` (profiler trace). JSON:
<out>/h200-topk-exit.json.
"""

from __future__ import annotations

import functools

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
from benchmarks.workloads import selection_inputs
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_topk as pt

VARIANTS = {"exit": dict(early_exit=True), "no-exit": dict(early_exit=False),
            "exit-r3": dict(early_exit=True, radix_bits=3),
            "exit-r4": dict(early_exit=True, radix_bits=4),
            # the ranking's share at 64 rows (call 3: the exit saved 6% there, 20% at one row)
            "exit-s1": dict(rank_splits=1), "exit-s4": dict(rank_splits=4),
            "exit-rb64": dict(rank_block=64), "exit-rb16": dict(rank_block=16),
            "exit-fused": dict(fused_compare=True), "exit-w8": dict(num_warps=8),
            "exit-s4-rb16": dict(rank_splits=4, rank_block=16),
            "exit-s1-rb64": dict(rank_splits=1, rank_block=64)}


def _scores(cfg, rows: int, live: list[int], seed: int) -> jax.Array:
    """[rows, P] f32: pool scores of random GLM indexer queries over random bf16 keys, -inf
    past each row's `live` candidates."""
    keys, _, _, sets = selection_inputs(cfg, 1, rows, cfg.max_context, seed, n_sets=1)
    qi, w = sets[0]
    n_cand = jnp.asarray(np.asarray(live, np.int32)[None, :])
    return ps.pool_scores_xla(qi, w, keys, n_cand)[0]  # [rows, P]


def main() -> int:
    ap = sweep_parser("tiny shapes, interpret mode (CPU)", 100.0, "unused")
    ap.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--variants", nargs="*", default=["exit", "no-exit", "exit-r3", "exit-r4"],
                    choices=sorted(VARIANTS))
    args = ap.parse_args()
    path = results_path(args.out, "h200-topk-exit.json")
    cfg = index_config(args.smoke)
    p, k = cfg.num_pools, cfg.select_k
    res = {"command": command("h200_topk_exit.py"), "date": utc_now(),
           "jax_version": jax.__version__, "device": jax.devices()[0].device_kind,
           "P": p, "k": k, "results": [], "errors": []}
    n_prompt = 9000 if not args.smoke else 40
    cases = [("b1", [p]), ("b1-r4", [p, 0, 0, 0]), ("b64", [p] * 64),
             ("b64-r4", [p, 0, 0, 0] * 64),
             ("prefill", list((np.arange(n_prompt) + 1) // cfg.index_kpool))]
    for ci, (name, live) in enumerate(cases):
        if args.cases is not None and name not in args.cases:
            continue
        s = _scores(cfg, len(live), live, 40 + ci)
        want = np.asarray(pt.pool_topk_xla(s, k))
        for vname in args.variants:
            kw = VARIANTS[vname]
            row = {"case": name, "variant": vname, "rows": len(live), **kw}

            def work(row, kw=kw, s=s, want=want, heavy=name == "prefill"):
                fn = jax.jit(functools.partial(pt.pool_topk_pallas, k=k, interpret=args.smoke,
                                               backend="pallas", **kw))
                row["equal_to_lax_top_k"] = bool(np.array_equal(np.asarray(fn(s)), want))
                row["ok"] = row["equal_to_lax_top_k"]
                row.update(sweep_times(functools.partial(fn, s), heavy))

            sweep_row(res, row, work, path)
    write_json(res, path)
    print(f"errors: {len(res['errors'])}; wrote {path}", flush=True)
    return 0 if not res["errors"] and all(r.get("ok") for r in res["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
