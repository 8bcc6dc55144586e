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
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks import attend_diag
from benchmarks import h200_attend_prep as attend_prep_diag
from benchmarks.attend_checks import (
    CHECK_CASES,
    SHAPES,
    case_label,
    check_case,
    check_inputs,
    time_shape,
)
from benchmarks.attend_diag import DIAGNOSTICS

# MgpuTuning fields of the prep group's variants beside the default (run 7 ran with the jnp
# prep as "mosaic-default" and the Triton prep, now the default, as "mosaic-prep-h64-w16").
PREP_VARIANTS = {
    "mosaic-prep-jnp": dict(prep="jnp"),
    "mosaic-prep-h32": dict(prep="triton", prep_heads=32, prep_warps=8),
    "mosaic-prep-h64-w16-sm1": dict(prep="triton", prep_heads=64, prep_warps=16,
                                    prep_per_sm=1),
}
# MgpuTuning fields of the mosaic groups' variants beside the default (runs 8, 9: the producer
# converts, `mgpu_gather`; run 4's q_in_kernel variant is in git history). Run 8's ptxas: the
# producer-converted kernel at the default 232/40 split spills 256 bytes (a tile's 64 registers
# of rows: ptxas keeps the producer's setmaxnreg budget of 40), hence a split with more for the
# producer. Run 9's 216/80 hung (512 > the CTA's 3 * 168 registers; now refused): 208/88.
R88 = dict(consumer_regs=208, producer_regs=88)
# The library's tuning (`AttendTuning().mosaic`; a test holds them equal).
LIB = dict(design="flashmla", direct_out=True, scale_heads=16, bound_scales=True,
           half_partials=True)
MOSAIC_VARIANTS = {
    "mosaic-producer-r88": dict(convert="producer", **R88),
    "mosaic-producer-pingpong-r88": dict(convert="producer", full_logits=True, pingpong=True,
                                         **R88),
    "mosaic-producer": dict(convert="producer"),
    "mosaic-producer-full": dict(convert="producer", full_logits=True),
    "mosaic-producer-pingpong": dict(convert="producer", full_logits=True, pingpong=True),
    "mosaic-producer-ahead": dict(convert="producer", gather_ahead=True),
    # Eleventh session: FlashMLA's split (one warpgroup QK + softmax, the others convert);
    # call 1 ran "mosaic-flashmla" as "-noslots" is now (slots read from global per tile).
    "mosaic-flashmla": dict(design="flashmla"),
    "mosaic-flashmla-noslots": dict(design="flashmla", stage_slots=False),
    "mosaic-flashmla-c2": dict(design="flashmla", converters=2),
    # Thirteenth session: one q scale per group of 16 or 32 heads, the prep one program per
    # (row, group); other last bits than the base's allowed (equal on every case in s14 call 1).
    "mosaic-flashmla-sh16": dict(design="flashmla", scale_heads=16),
    "mosaic-flashmla-sh32": dict(design="flashmla", scale_heads=32),
    # The library's default since the fourteenth session (AttendTuning.mosaic).
    "mosaic-lib": LIB,
    # Nineteenth session: one row's 33 tiles over 11 splits of 3 (the default's 16 splits of 3
    # tiles, 15 of them padding), 17 of 2 or 33 of 1 (max_splits; decode-b1's attend, "d").
    "mosaic-lib-ms11": {**LIB, "max_splits": 11},
    "mosaic-lib-ms17": {**LIB, "max_splits": 17},
    "mosaic-lib-ms33": {**LIB, "max_splits": 33},
    # Twenty-first session: the library's prep before it (each row's slots by its group-0
    # program). The split merge's columns (8 past 16 splits; 16 and 64 at 8 warps) and warps
    # (2, 8) were measured at decode-b1's 33 splits and 64x1's 2, none faster than 32 columns
    # at 4 warps (h200-attend-20261203-s21-call{2,3}.json; the options are in git history).
    "mosaic-lib-slots0": {**LIB, "prep_slots_apart": False},
    # Twenty-sixth session: the library's before half_partials (f32 partials, scaled by the
    # kernel); "mosaic-lib-half", the f16 partials measured beside it in s26 call 2, is now
    # "mosaic-lib".
    "mosaic-lib-f32": {**LIB, "half_partials": False},
    # Twenty-second session: the prep at 4 and 8 warps ("mosaic-lib-pw4", "-pw8": the
    # library's with prep_warps=4 / 8) were slower than its 16 at 64x1 and decode-b1
    # (h200-attend-20261204-s22-call1.json) and removed.
    # "mosaic-flashmla-pvb" (pv_behind: the softmax beside the previous tile's P @ V, in three
    # forms, each bitwise the base) was measured slower in the thirteenth session and removed
    # (git history: the commit after this session's call 4).
    # The twelfth session's merge blocks ("mosaic-flashmla-m1024" .. "-m16384w8": the split
    # merge's elements per program and warps) were measured and removed (git history: 338c717).
    # The twelfth session's "mosaic-flashmla-qk" (qk_ahead: the next tile's logits issued
    # beside P @ V) and "-qk-eg" (early_gather) were measured and removed (git history: fcba627).
    # Call 3 timed an L2 prefetch of the rows (prefetch=1: 64x1 60.6 vs 46.2 us; in git
    # history, removed).
}
# `--group mosaic` (run 9, ~90 s in one process): the default and these, the GLM case each.
QUICK = ("mosaic-producer-r88", "mosaic-producer-pingpong-r88")
# Variants whose fp32 sums run in another order than the default's: checked against the
# bound, their bitwise equality to the default recorded but not required.
REORDERED = ("mosaic-producer-full", "mosaic-producer-pingpong", "mosaic-producer-pingpong-r88",
             "mosaic-flashmla", "mosaic-flashmla-noslots", "mosaic-flashmla-c2")
# Variants that round q at other scales than every base: exempt with any base.
RESCALED = ("mosaic-flashmla-sh16", "mosaic-flashmla-sh32", "mosaic-lib")
# Variants that split a row's slots over other counts than the base (the merge sums in
# another order): exempt with any base.
RESPLIT = ("mosaic-lib-ms11", "mosaic-lib-ms17", "mosaic-lib-ms33",
           "mosaic-lib-f32")  # and the f16 partials: other roundings than the base's
# `--group mosaic-all`: these on every case, the others on 3 (ONE_CHECK: 1).
FULL_CHECKS = ("mosaic-default", "mosaic-producer-r88", "mosaic-producer-pingpong-r88",
               "mosaic-flashmla", "mosaic-flashmla-noslots", "mosaic-flashmla-c2",
               "mosaic-flashmla-sh16", "mosaic-flashmla-sh32", "mosaic-lib",
               "mosaic-lib-f32")
ONE_CHECK = ("mosaic-producer-ahead",)
P_VARIANTS = ("triton-default", "mosaic-default", "mosaic-producer-r88", "mosaic-flashmla",
              "mosaic-flashmla-noslots", "mosaic-flashmla-c2", "mosaic-flashmla-sh16",
              "mosaic-flashmla-sh32")  # also timed on "p"


def variants(group: str, only: tuple[str, ...] = (), base: str = "mosaic-default"):
    """name -> (sparse_attend_pallas kwargs, operand dtype for the bound); `only`: the
    default and these of the group's variants (all when empty). base: the mosaic groups'
    first variant, whose output the others must equal bitwise (unless REORDERED with the
    default base, or RESCALED)."""
    from dsa_jax.pallas import sparse_attend as sa
    from dsa_jax.pallas import sparse_attend_mgpu as mg

    tri = sa.AttendTuning(backend="triton")
    if group == "triton":
        return {"triton-default": (dict(tuning=tri), "bfloat16")}
    if group == "smoke":  # CPU: the script's machinery, with the Triton kernel interpreted
        return {"triton-interpret": (dict(tuning=tri, interpret=True), "bfloat16"),
                "triton-interpret-again": (dict(tuning=tri, interpret=True), "bfloat16")}
    # "mosaic-default" is MgpuTuning(): the exchange design, the library's until the eleventh
    # session (AttendTuning.mosaic is "mosaic-flashmla" since).
    mos = {"mosaic-default": mg.MgpuTuning()}
    if base != "mosaic-default":  # e.g. the library's default, to compare its variants with
        mos = {base: mg.MgpuTuning(**MOSAIC_VARIANTS[base])}
    if group == "prep":
        mos.update({k: mg.MgpuTuning(**v) for k, v in PREP_VARIANTS.items()})
    if group in ("mosaic", "mosaic-all", "mosaic-smoke"):
        mos.update({k: mg.MgpuTuning(**v) for k, v in MOSAIC_VARIANTS.items()
                    if (group != "mosaic" or k in QUICK) and (not only or k in only)
                    and k != base})
    # attend_diag's timing-only converters, on the base's tuning (asked for by name only)
    if group == "mosaic-all":
        mos.update({k: mos[next(iter(mos))] for k in DIAGNOSTICS if k in only})
    # mosaic_prompt=None: each variant's tiles on every shape, the prompt chunk "p" included
    # (the library runs mosaic-producer-r88's tiles there by default since 20261201-s5).
    return {k: (dict(tuning=sa.AttendTuning(backend="mosaic", mosaic=t, mosaic_prompt=None)),
                "float16") for k, t in mos.items()}


# ------------------------------------------------------------------------------ driver

def run_group(group: str, out_path: str, shapes: str, only: tuple[str, ...] = (),
              base: str = "mosaic-default"):
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

    vs = variants(group, only, base)
    reordered = (() if base != "mosaic-default" else REORDERED) + RESCALED + RESPLIT
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
        diag = name in DIAGNOSTICS  # timing only: a patched converter, wrong outputs
        with attend_diag.patched(name) if diag else contextlib.nullcontext():
            cases = CHECK_CASES if group in ("mosaic-all", "prep") else CHECK_CASES[:1]
            if group == "mosaic-all" and name not in FULL_CHECKS:
                cases = CHECK_CASES[:1] if name in ONE_CHECK else CHECK_CASES[:3]
            if group in ("mosaic-smoke", "smoke"):
                cases = CHECK_CASES[2:3]
            if diag:  # wrong by design: one case, to record it (and compile before timing)
                cases = CHECK_CASES[2:3]
            for i, case in enumerate(cases):
                try:
                    if shared is None:
                        row = check_case(name, kw, op, case, seed=1000 + 17 * i + len(name))
                    else:  # the same inputs for every variant: their outputs compared bitwise
                        row = check_case(name, kw, op, case, seed=1000 + 17 * i, shared=shared[i],
                                         reordered=reordered)
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
            if variant_major and not (group == "mosaic" and name == base):
                for key in shapes:  # checked, then timed: a later variant that hangs costs itself
                    if (key == "p" and group.startswith("mosaic") and name not in P_VARIANTS
                        and not diag):
                        continue
                    time_row(name, kw, key)
    if group == "mosaic":  # the default timed last: runs 4-7 measured it already
        for key in shapes:
            time_row(base, vs[base][0], key)
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
    ap.add_argument("--variants", default="", help="comma list: only these of the mosaic "
                    "groups' variants beside the default (run 10: the pingpong ones hung)")
    ap.add_argument("--base", default="mosaic-default", help="the mosaic groups' first "
                    "variant, which the others must equal bitwise unless REORDERED (with "
                    "another base only RESCALED is exempt)")
    a = ap.parse_args()
    if a.smoke:
        run_group("smoke", a.out, "s")
        with open(a.out) as f:
            res = {"command": " ".join(sys.argv), "groups": {"smoke": json.load(f)}}
        print_table(res)
        bad = [c for c in res["groups"]["smoke"]["checks"] if not c.get("ok")]
        sys.exit(1 if bad or res["groups"]["smoke"]["errors"] else 0)
    only = tuple(v for v in a.variants.split(",") if v)
    if a.group:
        run_group(a.group, a.out, a.shapes, only, a.base)
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
                                    "--shapes", a.shapes, "--variants", a.variants,
                                    "--base", a.base],
                                   env=env, stdout=lf,
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
