"""The suite: runs the points of each group (benchmarks/points.py) with their measuring
functions (benchmarks/measures.py, the serving loop's in benchmarks/loop.py), the levers, the
breakdown and the Hugging Face baseline, and writes one JSON per run (schema in
benchmarks/schema.py), rewritten after every point so a run cut short keeps what it measured.

Roofline for every point: the fewest bytes the step must move (weights read once, the caches it
must read and write, its inputs and outputs) over the measured copy bandwidth (a large
device-to-device copy, read + write bytes), and its FLOPs over the measured bf16 matmul rate;
the larger is the floor. Both ceilings are measured in the same run.

Tensor parallelism: at TP 8 the suite benchmarks ONE rank's work on one GPU (8 local heads of
q_b / kv_b / o_proj; the indexer and the latent projection replicated); no collective is timed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import jax
from tqdm import tqdm

from . import breakdown, fp8_weights, hf_baseline, levers, loop, measures
from .harness import CompileLog, DeviceLost, check_device, err_text, log, measure_ceilings
from .peers import group as peers
from .points import Plan, Point, plan_points
from .schema import SCHEMA_VERSION, fmt_us, ratio, write_json
from .workloads import random_hf_tensors, random_weights

# Per-implementation figures copied to the point from its main implementation's timing.
LIFTED = ("kernel_us", "call_floor_us", "device_step_us", "compiles", "GBps", "TFLOPs",
          "frac_of_bandwidth", "frac_of_matmul_rate", "frac_of_flashmla") + loop.LIFTED
MEASURES = {**measures.MEASURES, **loop.MEASURES}
TIMING_METHOD = (
    "JAX: warm-up calls, then groups of `inner` back-to-back calls with jax.block_until_ready "
    "around each group; median over groups of group time / inner. The layer step is "
    "jax.jit(dsa_jax.layer.step) with the state donated (no host checks), rows padded to "
    "cfg.max_verify as decode/decode_k pad them; before each group the state's lengths are set "
    "back so every call runs at the stated context. The attend and selection points, timed "
    "as lone calls, also record call_floor_us: a one-fusion program with the call's exact "
    "arguments and outputs timed the same way, the least the host lets any implementation "
    "of that call take. Torch: CUDA events around each call, median.")
TP_NOTE = ("At TP 8 the suite benchmarks ONE rank's work on one GPU: 8 local heads of "
           "q_b/kv_b/o_proj, the indexer and latent projection replicated; no collective.")
FLOOR_RULE = ("floor = max(fewest bytes / measured copy bandwidth (read+write), FLOPs / "
              "measured bf16 matmul rate)")


def main_impl(timings: dict) -> str | None:
    """The implementation a point reports: pallas when it ran, else xla, else any other."""
    order = ["pallas", "xla"] + sorted(set(timings) - {"pallas", "xla"})
    return next((i for i in order if (timings.get(i) or {}).get("median_us") is not None),
                None)


class Suite:
    def __init__(self, args, cfg, plan: Plan, out_path: str, command: str):
        self.args, self.cfg, self.plan, self.out_path = args, cfg, plan, out_path
        self.impls = [s for s in args.impls.split(",") if s]
        self.points: list[Point] = plan_points(cfg, plan)
        self.t0 = time.time()
        self.compiles = CompileLog()
        self.ceil = None
        self.result: dict = {"schema_version": SCHEMA_VERSION, "command": command,
                             "argv": list(args.argv), "smoke": bool(args.smoke),
                             "points": [], "errors": [], "levers": {}, "baselines": {},
                             "skipped": []}
        self.records: dict = {}  # point name -> its JSON record
        self.hf: dict = {}  # ctx or kind -> {"eager": timing, "sdpa": timing}
        self._hf_tensors = None
        self._weights: dict = {}  # tp -> folded weights
        self.compile_record: dict = {}  # (cfg, B) -> the first call of every timed step
        self.loop_weights = None  # the serving loop's model weights (benchmarks/loop.py)

    # ----------------------------------------------------------------- bookkeeping
    def elapsed(self) -> float:
        return time.time() - self.t0

    def over_budget(self, group: str) -> bool:
        if self.args.budget_s and self.elapsed() > self.args.budget_s:
            self.result["skipped"].append({"group": group, "reason": f"time budget "
                                           f"{self.args.budget_s}s spent at "
                                           f"{self.elapsed():.0f}s"})
            log(f"[bench] skipping {group}: budget spent")
            return True
        return False

    def late(self) -> bool:
        """Inside a group: past the budget by a quarter (stop optional variants)."""
        return bool(self.args.budget_s) and self.elapsed() > 1.25 * self.args.budget_s

    def save(self) -> None:
        self.result["elapsed_s"] = self.elapsed()
        write_json(self.out_path, self.result)

    def tqdm(self, items, desc: str):
        return tqdm(items, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                    disable=self.args.no_progress)

    def guarded(self, label: str, fn: Callable[[], dict]) -> dict:
        """`fn()`, or its failure as `{"error": ..., "median_us": None}`; a failure after which
        the device no longer runs a trivial op raises DeviceLost (the run stops)."""
        try:
            return fn()
        except Exception as e:
            log(f"[bench] {label} failed: {type(e).__name__}: {str(e)[:300]}")
            check_device(e)
            return {"error": err_text(e), "median_us": None}

    def hf_tensors(self) -> dict:
        if self._hf_tensors is None:
            self._hf_tensors = random_hf_tensors(self.cfg, self.args.seed)
        return self._hf_tensors

    def weights_for(self, tp: int):
        if tp not in self._weights:
            self._weights[tp] = random_weights(self.cfg, self.hf_tensors(), tp)
        return self._weights[tp]

    # ----------------------------------------------------------------- points
    def ceilings(self) -> None:
        small = self.args.smoke or jax.default_backend() == "cpu"
        self.ceil, record = measure_ceilings(small=small, groups=self.plan.groups,
                                             with_torch=not small and not self.args.no_hf)
        self.result["ceilings"] = record
        log(f"[bench] ceilings: copy {self.ceil.copy_GBps:.0f} GB/s (read+write), bf16 matmul "
            f"{self.ceil.matmul_TFLOPs:.0f} TFLOP/s")
        self.save()

    def record(self, point: Point, measured: dict) -> dict:
        """A point's JSON from its measurement (schema 1)."""
        timings = measured.get("timings") or {}
        cost = measured.get("cost")
        main = main_impl(timings)
        median = timings[main]["median_us"] if main else None
        floor = self.ceil.floor(*cost) if cost is not None else None
        xla_us = (timings.get("xla") or {}).get("median_us")
        hf_us = self.hf_best(point.hf)
        rec = {"name": point.name, "group": point.group, "target": point.target, "impl": main,
               "median_us": median, "floor_us": floor["floor_us"] if floor else None,
               "time_over_floor": ratio(median, floor["floor_us"]) if floor else None,
               "roofline": floor, "xla_us": xla_us, "ratio_vs_xla": ratio(median, xla_us),
               "hf_key": point.hf, "hf_us": hf_us, "ratio_vs_hf": ratio(median, hf_us),
               "impls": timings, **point.params, **(measured.get("fields") or {})}
        for key in LIFTED:
            if main and key in timings[main]:
                rec[key] = timings[main][key]
        if point.relative_to:
            base = ((self.records.get(point.relative_to) or {}).get("impls") or {}).get(main)
            rec["k1_step_us"] = (base or {}).get("median_us")
            rec["ratio_vs_k1"] = ratio(median, rec["k1_step_us"])
        rec["met"] = False if timings and median is None else point.met(rec)
        return rec

    def add(self, point: Point) -> dict:
        measured = MEASURES[point.kind](self, point)
        rec = self.record(point, measured)
        self.records[point.name] = rec
        self.result["points"].append(rec)
        self.save()
        return rec

    def run_group(self, group: str) -> None:
        if group == "hf":
            self.group_hf()
        elif group == "levers":
            levers.run(self)
        elif group == "breakdown":
            breakdown.run(self)
        elif group == "peers":
            peers.run(self)
        elif group == "fp8":
            fp8_weights.run(self)
        else:
            for point in self.points:
                if point.group == group:
                    self.add(point)

    # ----------------------------------------------------------------- Hugging Face
    def group_hf(self) -> None:
        if self.args.no_hf:
            self.result["baselines"]["hf"] = {"skipped": "--no-hf"}
            return
        try:
            res = hf_baseline.hf_decode_times(self.cfg, self.hf_tensors(), self.plan,
                                              self.args.seed, self.tqdm)
        except Exception as e:
            log(f"[bench] HF baseline failed: {type(e).__name__}: {str(e)[:300]}")
            self.result["baselines"]["hf"] = {"error": err_text(e)}
            self.save()
            return
        self.result["baselines"]["hf"] = res
        for ctx, r in res.get("contexts", {}).items():
            self.hf[int(ctx)] = r
        for kind in ("verify", "batch", "prefill"):
            for r in (res.get(kind) or {}).values():
                self.hf[kind] = r
        self.save()

    def hf_best(self, key):
        """The faster of HF eager and sdpa: a decode at context `key` (int), or "verify",
        "batch", "prefill" (the other points' counterparts); None when not measured."""
        r = self.hf.get(key) if key is not None else None
        vals = [v["median_us"] for v in (r or {}).values() if isinstance(v, dict)
                and v.get("median_us") is not None]
        return min(vals) if vals else None

    def attach_hf(self) -> None:
        """Fill each point's HF time from the HF group (which runs last: see `run`)."""
        for point in self.result["points"]:
            if point.get("hf_key") is not None:
                point["hf_us"] = self.hf_best(point["hf_key"])
                point["ratio_vs_hf"] = ratio(point["median_us"], point["hf_us"])
        self.save()

    # ----------------------------------------------------------------- the run
    def run(self, groups: list[str]) -> int:
        """Ceilings, then each group in `groups` (HF last: torch's allocations slowed the JAX
        steps timed after it). Exit status as `python -m benchmarks --help` documents."""
        try:
            self.ceilings()
        except Exception as e:
            self.result["errors"].append({"group": "ceilings", "error": err_text(e)})
            self.save()
            print(f"bench: the ceilings could not be measured: {e}", file=sys.stderr)
            return 1
        for g in [g for g in groups if g != "hf"] + [g for g in groups if g == "hf"]:
            if g not in ("memory", "hf") and self.over_budget(g):
                continue
            t0 = time.time()
            try:
                self.run_group(g)
            except DeviceLost as e:
                log(f"[bench] device lost in group {g}: {e}")
                self.result["errors"].append({"group": g, "error": err_text(e),
                                              "device_lost": True})
                self.result.setdefault("group_seconds", {})[g] = time.time() - t0
                self.save()
                print(format_table(self.result))
                print(f"bench: the device was lost in group {g}; partial results in "
                      f"{self.out_path}", file=sys.stderr)
                return 3
            except Exception as e:  # a whole group failing is recorded; the run continues
                log(f"[bench] group {g} failed: {type(e).__name__}: {str(e)[:300]}")
                self.result["errors"].append({"group": g, "error": err_text(e)})
            self.result.setdefault("group_seconds", {})[g] = time.time() - t0
            self.save()
        self.attach_hf()
        print(format_table(self.result))
        print(f"ceilings: copy {self.ceil.copy_GBps:.0f} GB/s, bf16 matmul "
              f"{self.ceil.matmul_TFLOPs:.0f} TFLOP/s; {self.elapsed():.0f} s; "
              f"wrote {self.out_path}")
        return 0


def format_table(result: dict) -> str:
    """The run's points as a plain-text table (the console summary)."""
    rows = [("point", "impl", "time", "floor", "t/floor", "met", "XLA", "vs XLA", "HF",
             "vs HF")]
    for p in result.get("points", []):
        if "value_MiB" in p:
            rows.append((p["name"], "-", f"{p['value_MiB']:.1f} MiB", "-", "-", str(p["met"]),
                         "-", "-", "-", "-"))
            continue
        f, rx, rh = p.get("time_over_floor"), p.get("ratio_vs_xla"), p.get("ratio_vs_hf")
        rows.append((p["name"], str(p.get("impl") or "-"),
                     fmt_us(p.get("median_us")), fmt_us(p.get("floor_us")),
                     f"{f:.2f}" if f else "-", str(p.get("met")), fmt_us(p.get("xla_us")),
                     f"{rx:.2f}" if rx else "-", fmt_us(p.get("hf_us")),
                     f"{rh:.4f}" if rh else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                     for r in rows)
