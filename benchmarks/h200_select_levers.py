"""H200: the selection point's levers (issue #14), checked and timed side by side in one
process.

    PYTHONPATH=. python3 benchmarks/h200_select_levers.py --out $OUT/h200-select-levers.json
    PYTHONPATH=. python3 benchmarks/h200_select_levers.py --topk s27 --out ...  # s27's call
    PYTHONPATH=. python3 benchmarks/h200_select_levers.py --smoke --out /tmp/sl.json  # CPU

Inputs as the bench's `selection-b64` and `selection-b64-r4` points build them
(`workloads.selection_inputs`, GLM-5.3-Flash's indexer, a bf16 index cache; `b1-r4`: one
sequence of 4 rows, as a decode-b1 step pads them). Levers:
- `split_q` (s27): a decode row's qi split into its three bf16 parts by the Mosaic scores
  kernel in shared memory (32 heads computed as 64, `pool_scores_mgpu.kernel_heads`) instead
  of an XLA fusion before it; the scores `==` the jnp split's (every pool, every row);
- `fused` (s27): the point's selection through `select.select_slots` (the top-k kernel writes
  the token slots) instead of `expand_selection(top_pools(...))`; the slots `==`;
- the Pallas top-k's variants on the fused selection, the slots `==` the first variant's:
  `--topk s27` its launch parameters (8 warps, 1 or 4 programs per row, 3-bit digits);
  `--topk s28` (the default) the winners ranked by compares (`rank="compare"`, the default
  until s28), sorted at two programs per row, and the sample method (`select="sample"`) at
  the default programs per row and at one.
Each variant's `wall_us` (back-to-back calls, the bench's Cycle over three query sets) and
`kernel_us` / launches / kernel list from a profiler trace; rounds interleaved (the host
drifts).
"""

from __future__ import annotations

import functools
import sys

import jax
import numpy as np

from benchmarks.device_script import header, json_parser, write_json
from benchmarks.harness import measure, profile
from benchmarks.workloads import Cycle, selection_inputs
from dsa_jax import indexer, layer, select
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_scores_mgpu as pm
from dsa_jax.pallas import pool_topk as pt
from dsa_jax.shapes import glm53_flash

SPLIT = {"split-jnp": pm.MgpuScoresTuning(split_q=False), "split-kernel": pm.MgpuScoresTuning()}
K = functools.partial(pt.PoolTopkTuning, backend="pallas")
# s27: launch parameters; s28: the winners sorted (`rank="sort"`) and the raw Triton kernel's
# sample method in Pallas (`select="sample"`)
TOPK_SETS = {
    "s27": {"w8": K(num_warps=8), "rs1": K(rank_splits=1), "rs4": K(rank_splits=4),
            "rb3": K(radix_bits=3)},
    # (call 1 ran when the default was rank "compare" with `default_rank_splits`: its "sort"
    # variant had those splits; the default is now "sort" at one program per row)
    "s28": {"compare": K(rank="compare"), "sort-rs2": K(rank="sort", rank_splits=2),
            "sample": K(select="sample", rank="sort"),
            "sample-rs1": K(select="sample", rank="sort", rank_splits=1)}}


def selection(cfg, mosaic, fused, qi, w, keys, pos, valid, topk=None):
    tuning = ps.PoolScoresTuning(mosaic=mosaic) if mosaic is not None else None
    n_cand = layer.candidate_pools(cfg, pos, valid)
    if tuning is None:
        scores = indexer.pool_scores(cfg, qi, w, keys, n_cand)
    else:
        scores = ps.pool_scores_pallas(qi, w, keys, n_cand, tuning=tuning)
    if fused:
        return select.select_slots(cfg, scores, pos, valid, tuning=topk)
    return select.expand_selection(cfg, select.top_pools(cfg, scores), pos, valid)


def main(argv: list[str] | None = None) -> int:
    ap = json_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--topk", choices=sorted(TOPK_SETS), default="s28",
                    help="the top-k variants timed beside the fused selection")
    ap.add_argument("--cases", default="b64,b64-r4",
                    help="of b1-r4 (one sequence of 4 rows, 3 padded), b64, b64-r4")
    ap.add_argument("--splits", default="split-jnp,split-kernel",
                    help="the scores' qi split variants (each unfused and fused)")
    args = ap.parse_args(argv)
    cfg = glm53_flash()
    if args.smoke:
        cfg = cfg.replace(max_context=448, index_n_heads=3, index_head_dim=12, index_topk=80,
                          implementation="xla")
    res = {**header("h200_select_levers.py", argv), "checks": {}, "rounds": []}
    ctx = cfg.max_context
    all_cases = {"b1-r4": (1, 4), "b64": (64, 1), "b64-r4": (64, 4)}
    cases = {c: all_cases[c] for c in args.cases.split(",")}
    splits = {n: SPLIT[n] for n in args.splits.split(",") if n}
    calls = {}
    for case, (b, r) in cases.items():
        keys, pos, valid, sets = selection_inputs(cfg, b, r, ctx, 300 + r)
        variants = {}
        for split in (splits if not args.smoke else {"xla": None}):
            for fused in ((False, True) if len(splits) > 1 else (True,)):
                fn = jax.jit(functools.partial(selection, cfg, SPLIT.get(split), fused))
                variants[f"{split}{'-fused' if fused else ''}"] = Cycle(
                    lambda qi, w, fn=fn, keys=keys, pos=pos, valid=valid: fn(
                        qi, w, keys, pos, valid), sets)
        for name, topk in ({} if args.smoke else TOPK_SETS[args.topk]).items():
            fn = jax.jit(functools.partial(selection, cfg, SPLIT["split-kernel"], True,
                                           topk=topk))
            variants[f"split-kernel-fused-{name}"] = Cycle(
                lambda qi, w, fn=fn, keys=keys, pos=pos, valid=valid: fn(
                    qi, w, keys, pos, valid), sets)
        ref = None
        for name, call in variants.items():  # every variant's slots == the first's
            got = [np.asarray(call()) for _ in sets]
            ref = got if ref is None else ref
            res["checks"][f"{case}/{name} == first"] = all(
                np.array_equal(a, g) for a, g in zip(ref, got, strict=True))
        if not args.smoke and len(splits) > 1:  # the scores, kernel split vs jnp split
            qi, w = sets[0]
            n_cand = layer.candidate_pools(cfg, pos, valid)
            s0, s1 = (np.asarray(jax.jit(functools.partial(
                ps.pool_scores_pallas, tuning=ps.PoolScoresTuning(mosaic=t)))(
                qi, w, keys, n_cand)) for t in SPLIT.values())
            res["checks"][f"{case}/scores split-kernel == split-jnp"] = bool(
                np.array_equal(s0, s1))
        calls.update({f"{case}/{n}": c for n, c in variants.items()})
        write_json(res, args.out)
    for i in range(args.rounds):
        row = {"round": i}
        for name, call in calls.items():
            t = measure(call, warmup=2, groups=15, inner=10)
            prof = profile(call, 20, top=8)
            row[name] = {"wall_us": t["median_us"], "kernel_us": prof.get("kernel_us_per_step"),
                         "launches": prof.get("launches_per_step"),
                         "kernels": [(k["name"][:40], round(k["us_per_step"], 2))
                                     for k in prof.get("top_kernels", [])]}
        res["rounds"].append(row)
        write_json(res, args.out)
    print(f"checks: {res['checks']}")
    for name in calls:
        walls = [r[name]["wall_us"] for r in res["rounds"]]
        kern = [r[name]["kernel_us"] for r in res["rounds"]]
        print(f"{name:28s} wall {np.median(walls):7.1f} us  kernels "
              f"{np.median([k or 0 for k in kern]):6.2f} us  {res['rounds'][-1][name]['kernels']}")
    return 0 if all(res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
