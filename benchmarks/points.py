"""The benchmark points as data: each a name, the group that runs it, how it is measured, its
shape parameters and its target, with a pure `met(result) -> bool`.

`plan_points(cfg, plan)` lists them for one plan: the full one (GLM-5.3-Flash shapes on an
H200, the targets of issues #14 and #12) or the smoke one (the tiny config on a CPU, the same
rules). Every point has a measuring function (`kind`: benchmarks/measures.py's and
benchmarks/loop.py's `MEASURES`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

GROUPS = ("decode", "hf", "kernels", "selection", "prefill", "scaling", "tp8", "memory",
          "levers", "breakdown", "loop", "peers", "fp8")
SPEC_DRAFTS = 3  # draft tokens verified per step (the speculation point)
SPEC_ACCEPTANCE = 0.7  # the share of drafts the speculation point's scripted drafter gets right
MiB = 2 ** 20


# The plan: every shape the suite runs --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    ctx: int  # context of the decode points
    big_batch: int  # "64 sequences"
    prefill_tokens: int
    scaling_ctx: tuple[int, ...]
    kernel_a: tuple[int, int, int, int]  # (B, R, H, W) gather-attend, "64 rows, 64 heads, 2051"
    kernel_b: tuple[int, int, int, int]  # "128 rows x 2 query rows, 128 heads, 2,048 slots"
    hf_ctx: tuple[int, ...]
    tp: tuple[int, ...]
    warmup: int
    groups: int
    inner: int
    long_groups: int  # prefill / HF at long contexts, the serving loop's dispatches
    loop_layers: int  # layers of the serving loop's model (scanned in one program)
    loop_tokens: int  # decode steps per host dispatch (the loop and engine points)
    engine_prompt: int  # prompt tokens of each of the engine point's sequences


def full_plan(cfg) -> Plan:
    return Plan(ctx=cfg.max_context, big_batch=64, prefill_tokens=9000,
                scaling_ctx=(1024, 4096, 16384, 65536, 131072),
                kernel_a=(64, 1, cfg.num_heads, cfg.sel_width), kernel_b=(128, 2, 128, 2048),
                hf_ctx=(1024, 4096, 16384, 65536, 131072), tp=(1, 8), warmup=3, groups=15,
                inner=10, long_groups=7, loop_layers=8, loop_tokens=32, engine_prompt=2048)


def smoke_plan(cfg) -> Plan:
    m = cfg.max_context
    # prefill_tokens = max_verify: the smoke prefill reuses the decode step's program.
    return Plan(ctx=m, big_batch=2, prefill_tokens=cfg.max_verify,
                scaling_ctx=(m // 4, m // 2, m),
                kernel_a=(4, 1, cfg.num_heads, cfg.sel_width), kernel_b=(2, 2, 16, cfg.index_topk),
                hf_ctx=(m,), tp=(1, 8), warmup=1, groups=3, inner=2, long_groups=2,
                loop_layers=2, loop_tokens=4, engine_prompt=12)


def quick(plan: Plan) -> Plan:
    """The full shapes with the fewest repetitions (a dry run of the shapes, e.g. on a CPU)."""
    return dataclasses.replace(plan, warmup=1, groups=2, inner=1, long_groups=1,
                               hf_ctx=plan.hf_ctx[:1])


# Targets: pure rules over a point's result ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AtMost:
    """Met when `result[field] <= limit` (times `result[of]` when `of` is named); a missing
    value is not met. `words`: the target as the JSON states it."""
    field: str
    limit: float
    words: str
    of: str | None = None

    @property
    def needs(self) -> tuple[str, ...]:
        """The result fields the rule reads (a result without them cannot be judged)."""
        return (self.field,) if self.of is None else (self.field, self.of)

    def __call__(self, result: Mapping[str, Any]) -> bool:
        value = result.get(self.field)
        base = 1.0 if self.of is None else result.get(self.of)
        return value is not None and base is not None and value <= self.limit * base


@dataclasses.dataclass(frozen=True)
class Equals:
    """Met when `result[field] == value`."""
    field: str
    value: Any
    words: str

    @property
    def needs(self) -> tuple[str, ...]:
        return (self.field,)

    def __call__(self, result: Mapping[str, Any]) -> bool:
        return result.get(self.field) == self.value


@dataclasses.dataclass(frozen=True)
class Reported:
    """A point with no bound: met when `result[field]` was measured."""
    field: str = "median_us"
    words: str = "reported"

    needs = ()

    def __call__(self, result: Mapping[str, Any]) -> bool:
        return result.get(self.field) is not None


def _num(v: float) -> str:
    return f"{v:g}"


def time_at_most(us: float, suffix: str = "") -> AtMost:
    shown = f"{_num(us / 1000)} ms" if us >= 1000 else f"{_num(us)} us"
    return AtMost("median_us", us, f"<= {shown}{suffix}")


def kernel_time_at_most(us: float) -> AtMost:
    return AtMost("kernel_us", us, f"device kernel time <= {_num(us)} us")


def times(of: str, x: float, what: str, field: str = "median_us") -> AtMost:
    return AtMost(field, x, f"<= {_num(x)} x {what}", of=of)


def bytes_at_most(n: int) -> AtMost:
    return AtMost("value_bytes", n, f"<= {_num(n / MiB)} MiB")


# Points --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    group: str  # the suite group (GROUPS) that runs it
    kind: str  # its measuring function (`MEASURES` of benchmarks/measures.py, loop.py)
    what: str  # the measured work, in words
    rule: AtMost | Equals | Reported
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # written to the JSON
    hf: int | str | None = None  # the Hugging Face counterpart (a decode context or a kind)
    relative_to: str | None = None  # the K=1 point a verify is compared with
    kernel_time: bool = False  # also trace the device kernel time

    @property
    def target(self) -> str:
        return f"{self.what}: {self.rule.words}"

    def met(self, result: Mapping[str, Any]) -> bool:
        return bool(self.rule(result))


def _step_points(cfg, plan: Plan, tp: int) -> list[Point]:
    ctx, big = plan.ctx, plan.big_batch
    group = "decode" if tp == 1 else f"tp{tp}"
    c = cfg.replace(tp_degree=tp)
    note = ("" if tp == 1 else f"; TP {tp}: one rank's work on one GPU ({c.local_heads} local "
            f"heads; indexer and latent projection replicated)")
    k1 = f"decode-b1-k1-tp{tp}"
    shape = {"ctx": ctx, "tp": tp}
    pts = [
        Point(k1, group, "step", f"decode step, 1 sequence, K=1, context {ctx}{note}",
              kernel_time_at_most(100.0) if tp == 1 else times("floor_us", 1.35, "floor"),
              {"batch": 1, "k": 1, **shape}, hf=ctx if tp == 1 else None, kernel_time=tp == 1),
        Point(f"verify-b1-k3-tp{tp}", group, "step",
              f"verify step, 1 sequence, K=3, context {ctx}{note}",
              times("k1_step_us", 1.3, "the K=1 step"), {"batch": 1, "k": 3, **shape},
              hf="verify" if tp == 1 else None, relative_to=k1, kernel_time=tp == 1),
        Point(f"decode-b{big}-k1-tp{tp}", group, "step",
              f"decode step, {big} sequences, K=1, context {ctx}{note}",
              time_at_most(250.0) if tp == 1 else times("floor_us", 1.5, "floor"),
              {"batch": big, "k": 1, **shape}, hf="batch" if tp == 1 else None,
              kernel_time=tp == 1),
    ]
    if tp == 1:
        pts.append(Point(
            "public-decode-b1", group, "public_decode",
            f"the README's dsa_jax.decode call, 1 sequence, context {ctx}, synced after "
            f"every call", times("device_step_us", 2.0, "the device step (its kernel time)"),
            {"batch": 1, "k": 1, **shape}))
    return pts


def _kernel_points(cfg, plan: Plan) -> list[Point]:
    (ba, ra, ha, wa), (bb, rb, hb, wb) = plan.kernel_a, plan.kernel_b
    shape = {"C": cfg.kv_lora_rank, "ctx": plan.ctx}
    return [
        Point(f"attend-kernel-{ba}x{ra}-h{ha}-w{wa}", "kernels", "attend",
              f"gather-attend kernel alone, {ba * ra} rows, {ha} heads, {wa} slots, "
              f"{cfg.cache_dtype}", time_at_most(55.0),
              {"shape": {"B": ba, "R": ra, "H": ha, "W": wa, **shape}}),
        Point(f"attend-kernel-{bb}x{rb}-h{hb}-w{wb}", "kernels", "attend",
              f"gather-attend kernel, {bb} rows x {rb} query rows, {hb} heads, {wb} slots "
              f"(FlashMLA's headline shape; TFLOP/s reported beside its published 410)",
              time_at_most(450.0), {"shape": {"B": bb, "R": rb, "H": hb, "W": wb, **shape}},
              ),
    ]


def _selection_points(cfg, plan: Plan) -> list[Point]:
    b, r, ctx = plan.big_batch, cfg.max_verify, plan.ctx
    return [
        Point(f"selection-b{b}", "selection", "selection",
              f"selection (pool scores, top-k, expansion), {b} sequences, 1 row each, "
              f"context {ctx}", time_at_most(40.0), {"batch": b, "rows": 1, "ctx": ctx}),
        Point(f"selection-b{b}-r{r}", "selection", "selection",
              f"the same selection over {r} rows per sequence, all but the first padding (as "
              f"the padded decode step ran it before it selected its real row only)",
              time_at_most(60.0),
              {"batch": b, "rows": r, "ctx": ctx}),
    ]


def _scaling_points(cfg, plan: Plan) -> list[Point]:
    top = max(plan.scaling_ctx)
    pts = [Point(f"scaling-b1-k1-ctx{c}", "scaling", "step",
                 f"scaling: decode step, 1 sequence, context {c} (one compiled step, "
                 f"max_context {top}), plotted", Reported(),
                 {"batch": 1, "k": 1, "ctx": c, "tp": 1, "max_context": top}, hf=c)
           for c in plan.scaling_ctx]
    pts.append(Point(
        "compile-b1-k1", "scaling", "compile",
        f"compile: one compile per (B, K) across all contexts {list(plan.scaling_ctx)} (B=1, "
        f"K=1, max_context {top}); median_us = the backend compile time",
        Equals("compiles", 1, "exactly one compile"),
        {"contexts": list(plan.scaling_ctx), "max_context": top,
         "compile_counting": "jax.monitoring backend_compile_duration events during the first "
                             "step call at each context (and jit cache entries added)"}))
    return pts


def _memory_points(cfg, plan: Plan) -> list[Point]:
    out = []
    for m in sorted({cfg.max_context, max(plan.scaling_ctx)}):
        rule = (bytes_at_most(10 * MiB) if m == cfg.max_context
                else Reported("value_bytes"))
        out.append(Point(f"memory-state-bytes-per-seq-ctx{m}", "memory", "memory",
                         f"memory: state bytes per sequence at max_context {m} "
                         f"(dsa_jax.state.state_bytes_per_seq)", rule, {"max_context": m}))
    return out


def _loop_points(cfg, plan: Plan) -> list[Point]:
    n, ctx, big, per = plan.loop_layers, plan.ctx, plan.big_batch, plan.loop_tokens
    model = f"{n} layers (full and shared in turn) scanned in one program"
    out = [Point(f"loop-b{b}-l{n}", "loop", "loop",
                 f"serving loop (dsa_jax.serve.run): {model}, {b} sequence(s), context {ctx}, "
                 f"{per} tokens per dispatch; time per token per layer",
                 times("kernel_us_per_token_per_layer", x, "the layers' kernel time",
                       field="us_per_token_per_layer"),
                 {"batch": b, "layers": n, "ctx": ctx, "tokens_per_dispatch": per})
           for b, x in ((1, 1.1), (big, 1.2))]
    out.append(Point(
        f"spec-b1-l{n}-k{SPEC_DRAFTS}", "loop", "spec",
        f"speculative decoding: {model}, 1 sequence, {SPEC_DRAFTS} drafts verified per round "
        f"(a scripted drafter, {SPEC_ACCEPTANCE:g} of its drafts right), context {ctx}; time "
        f"per token", Reported("tokens_per_s", "tokens/s reported with the acceptance it ran "
                                               "at"),
        {"batch": 1, "layers": n, "drafts": SPEC_DRAFTS, "ctx": ctx,
         "tokens_per_dispatch": per, "stated_acceptance": SPEC_ACCEPTANCE}))
    out.append(Point(
        f"engine-b{big}-l{n}", "loop", "engine",
        f"the engine's own step as a user drives it (Engine.step): {model}, {big} sequences "
        f"of {plan.engine_prompt}-token prompts, {per} tokens per dispatch; time per step per "
        f"layer", times("kernel_per_step_per_layer_us", 1.5, "its kernel time",
                        field="per_step_per_layer_us"),
        {"batch": big, "layers": n, "prompt": plan.engine_prompt, "tokens_per_dispatch": per}))
    return out


def plan_points(cfg, plan: Plan) -> list[Point]:
    """Every point of `plan`, in the order the suite runs them within each group."""
    pts = _step_points(cfg, plan, 1)
    pts += _kernel_points(cfg, plan) + _selection_points(cfg, plan)
    s = plan.prefill_tokens
    pts.append(Point(f"prefill-{s}", "prefill", "prefill",
                     f"prefill of {s} tokens, one sequence", time_at_most(10_000.0, " per layer"),
                     {"tokens": s}, hf="prefill"))
    pts += _scaling_points(cfg, plan)
    for tp in plan.tp:
        if tp != 1:
            pts += _step_points(cfg, plan, tp)
    return pts + _memory_points(cfg, plan) + _loop_points(cfg, plan)
