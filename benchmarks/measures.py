"""The measuring function of each point kind (`MEASURES[point.kind](suite, point)`).

Each returns `{"timings": {impl: timing}, "cost": (bytes, flops) or None, "fields": {...}}`:
a timing is `benchmarks.harness.measure`'s dict (plus what the kind adds) or `{"error": ...,
"median_us": None}`; the suite turns it into the point's JSON (`Suite.record`). Only the public
API of dsa_jax is used.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

import dsa_jax
from dsa_jax import indexer, layer, select
from dsa_jax.attend import attend as attend_rows
from dsa_jax.state import init_state, ring_rows, state_bytes_breakdown, state_bytes_per_seq

from .harness import (
    call_floor_program,
    host_time_us,
    jit_cache_size,
    kernel_us,
    measure,
    profile_step,
)
from .roofline import (
    FLASHMLA_TFLOPS,
    attend_cost,
    itemsize,
    param_bytes,
    prefill_cost,
    selection_cost,
    step_cost,
)
from .workloads import STEP, STEP_WHAT, Cycle, StepRunner, attend_inputs, selection_inputs


def run_step(suite, impl: str, tp: int, num_seqs: int, k: int, ctx: int,
             changes: dict | None = None, kernel_time: bool = False) -> dict:
    """Time the jitted step at `ctx` (the state set back before every group); the first call's
    compiles are recorded in `suite.compile_record[(cfg, num_seqs)]`."""
    cfg = suite.cfg.replace(implementation=impl, tp_degree=tp, **(changes or {}))
    p = suite.plan
    start = max(0, ctx - p.inner * k)
    weights = suite.weights_for(tp)
    runner = StepRunner(cfg, weights, num_seqs, k,  # the rows decode / decode_k run
                        layer.decode_rows(cfg, "decode" if k == 1 else "verify"), start,
                        1000 + num_seqs * 7 + k + ctx)
    jax.block_until_ready(runner.state)
    size0 = jit_cache_size(STEP)
    mark = suite.compiles.mark()
    t_first = time.perf_counter()
    jax.block_until_ready(runner())  # compile (when not cached) + one step
    first_s = time.perf_counter() - t_first
    n_comp, comp_s = suite.compiles.since(mark)
    added = None if size0 is None else jit_cache_size(STEP) - size0
    suite.compile_record.setdefault((cfg, num_seqs), []).append(
        {"ctx": ctx, "k": k, "compiles": n_comp, "compile_s": comp_s, "first_call_s": first_s,
         "jit_cache_entries_added": added})
    t = measure(runner, warmup=p.warmup, groups=p.groups, inner=p.inner, reset=runner.reset)
    y = runner.last[0]
    t.update(first_call_s=first_s, compiles=n_comp, compile_s=comp_s,
             jit_cache_entries_added=added, ctx_range=[start, start + p.inner * k],
             finite=bool(np.isfinite(np.asarray(y[:, :k], np.float32)).all()), timed=STEP_WHAT)
    if kernel_time:  # traced calls stay within the timed context range
        t["kernel_us"] = profile_step(runner, max(1, p.inner - 2), top=0).get(
            "kernel_us_per_step")
    return t


def per_impl(suite, point, fn) -> dict:
    return {impl: suite.guarded(f"{point.name} {impl}", functools.partial(fn, impl))
            for impl in suite.tqdm(suite.impls, point.name)}


def step(suite, point) -> dict:
    """A decode, verify or scaling point: the jitted step at the point's shape."""
    q = point.params
    changes = {"max_context": q["max_context"]} if "max_context" in q else {}
    timings = per_impl(suite, point, lambda impl: run_step(
        suite, impl, q["tp"], q["batch"], q["k"], q["ctx"], changes, point.kernel_time))
    cfg = suite.cfg.replace(tp_degree=q["tp"])
    pb = param_bytes(suite.weights_for(q["tp"]))
    return {"timings": timings, "cost": step_cost(cfg, pb, q["batch"], q["k"], q["ctx"])}


def time_public_decode(cfg, weights, state, x1, start: int, *, warmup: int, groups: int,
                       inner: int, **decode_kwargs) -> tuple[dict, object]:
    """`dsa_jax.decode` (host checks, padding, the step, slicing) of `x1 [B, D]` on `state`,
    set back to `start` tokens before every group. Returns the timing and the final state."""
    holder = {"state": state}

    def call():
        y, holder["state"], _ = dsa_jax.decode(cfg, weights, holder["state"], x1,
                                               **decode_kwargs)
        return y

    def reset():  # the public rewind: the host keeps its copy of the lengths, as in a loop
        b = holder["state"].lengths.shape[0]
        holder["state"] = dsa_jax.rewind(cfg, holder["state"], np.full((b,), start, np.int32))
        jax.block_until_ready(holder["state"])  # its device work stays outside the timing

    t = measure(call, warmup=warmup, groups=groups, inner=inner, reset=reset)
    return t, holder["state"]


def public_decode(suite, point) -> dict:
    """The README's `dsa_jax.decode` call, blocked after every call, beside the device time of
    the step it runs (its kernel time from a trace) and the jitted step's pipelined time."""
    q, p = point.params, suite.plan

    def one(impl):
        cfg = suite.cfg.replace(implementation=impl)
        weights = suite.weights_for(1)
        start = max(0, q["ctx"] - p.inner)
        runner = StepRunner(cfg, weights, 1, 1, cfg.max_verify, start, 1100)
        device_step = profile_step(runner, max(1, p.inner - 2), top=0).get(
            "kernel_us_per_step")
        step_us = measure(runner, warmup=1, groups=p.groups, inner=p.inner,
                          reset=runner.reset)["median_us"]
        t, _ = time_public_decode(cfg, weights, runner.state, runner.xs[0][:, 0], start,
                                  warmup=p.warmup, groups=p.groups, inner=1)
        t.update(device_step_us=device_step, step_us=step_us,
                 timed="dsa_jax.decode(cfg, weights, state, x [1, D]), blocked after each call")
        return t

    return {"timings": per_impl(suite, point, one), "cost": None}


def gather_attend(suite, point) -> dict:
    """The gather-attend alone (`dsa_jax.attend.attend`, every row live) on a random latent
    cache; TFLOP/s and GB/s, and against the measured ceilings."""
    s, p, cfg0 = point.params["shape"], suite.plan, suite.cfg
    cost = attend_cost(s["B"], s["R"], s["H"], s["W"], s["C"], itemsize(cfg0.cache_dtype))

    def one(impl):
        cfg = cfg0.replace(implementation=impl)
        st, sets = attend_inputs(cfg, s["B"], s["R"], s["H"], s["W"], s["ctx"],
                                 77 + s["R"] + s["B"])

        # The arrays the attend reads are the program's arguments; the state's indexer arrays
        # are not (as leaves of a state argument, jit prunes them from the program but the
        # dispatch still checks each: ~4-18 us a call measured on the lent hosts).
        @jax.jit
        def fn(latent, kv_scale, block_tables, q, sel):
            return attend_rows(cfg, st._replace(latent=latent, kv_scale=kv_scale,
                                                block_tables=block_tables), q, sel)

        args = [(st.latent, st.kv_scale, st.block_tables, q, sel) for q, sel in sets]
        call = Cycle(fn, args)
        finite = bool(np.isfinite(np.asarray(call())).all())
        t = measure(call, warmup=p.warmup, groups=p.groups, inner=p.inner)
        t["call_floor_us"] = call_floor_us(fn, args, p)
        sec = t["median_us"] * 1e-6
        # Device time beside the wall time: a short program's wall follows the host's dispatch
        # when the host is slow (the same kernels measured 102 and 144 us of wall).
        t.update(finite=finite, kernel_us=kernel_us(call), GBps=cost[0] / sec / 1e9,
                 TFLOPs=cost[1] / sec / 1e12,
                 frac_of_bandwidth=cost[0] / sec / 1e9 / suite.ceil.copy_GBps,
                 frac_of_matmul_rate=cost[1] / sec / 1e12 / suite.ceil.matmul_TFLOPs,
                 frac_of_flashmla=cost[1] / sec / 1e12 / FLASHMLA_TFLOPS)
        return t

    fields = {"flashmla_TFLOPs": FLASHMLA_TFLOPS,
              "flop_count": "4*rows*heads*slots*C (QK and PV over the C=512 latent); FlashMLA "
                            "counts 2*h*s_q*topk*(576+512) per sequence"}
    return {"timings": per_impl(suite, point, one), "cost": cost, "fields": fields}


def call_floor_us(fn, args: list[tuple], plan) -> float:
    """The median wall of `harness.call_floor_program(fn)` over the same argument sets, timed
    as the point: what the host lets any implementation of this lone call take here (a wall
    target below it cannot be met on this host, whatever the kernels)."""
    floor = Cycle(call_floor_program(fn, args[0]), args)
    jax.block_until_ready(floor())
    return measure(floor, warmup=plan.warmup, groups=plan.groups, inner=plan.inner)["median_us"]


@functools.partial(jax.jit, static_argnums=0)
def selection_call(cfg, qi, w, keys, pos, valid):
    # select_slots: the top-k kernel writes the token slots itself (the same slots as
    # expand_selection(top_pools(...)); the step's co-launched top-k writes them too);
    # pool_scores_at: the kernels take each row's candidate count and position from pos and
    # valid themselves (no pass before them)
    scores = indexer.pool_scores_at(cfg, qi, w, keys, pos, valid)
    return select.select_slots(cfg, scores, pos, valid)


def selection(suite, point) -> dict:
    """Pool scores, top-k and expansion (the step's selection stages) jitted together."""
    q, p = point.params, suite.plan
    b, r, ctx = q["batch"], q["rows"], q["ctx"]

    def one(impl):
        cfg = suite.cfg.replace(implementation=impl)
        keys, pos, valid, sets = selection_inputs(cfg, b, r, ctx, 300 + r)
        call = Cycle(lambda qi, w: selection_call(cfg, qi, w, keys, pos, valid), sets)
        jax.block_until_ready(call())
        t = measure(call, warmup=p.warmup, groups=p.groups, inner=p.inner)
        t["call_floor_us"] = call_floor_us(functools.partial(selection_call, cfg),
                                           [(qi, w, keys, pos, valid) for qi, w in sets], p)
        t["kernel_us"] = kernel_us(call)  # device time beside the wall (gather_attend says why)
        return t

    return {"timings": per_impl(suite, point, one), "cost": selection_cost(suite.cfg, b, r, ctx)}


def prefill(suite, point) -> dict:
    """One sequence's prompt from an empty context: the jitted step over `[1, S, D]`."""
    s, p = point.params["tokens"], suite.plan

    def one(impl):
        cfg = suite.cfg.replace(implementation=impl)
        runner = StepRunner(cfg, suite.weights_for(1), 1, s, s, 0, 500)
        jax.block_until_ready(runner.state)
        mark = suite.compiles.mark()
        t_first = time.perf_counter()
        jax.block_until_ready(runner())
        first_s = time.perf_counter() - t_first
        n_comp, comp_s = suite.compiles.since(mark)
        t = measure(runner, warmup=1, groups=p.long_groups, inner=1, reset=runner.reset)
        t.update(first_call_s=first_s, compiles=n_comp, compile_s=comp_s,
                 finite=bool(np.isfinite(np.asarray(runner.last[0][:, -8:])).all()),
                 timed=f"{STEP_WHAT}, x [1, S, D], from empty")
        return t

    cost = prefill_cost(suite.cfg, param_bytes(suite.weights_for(1)), s)
    return {"timings": per_impl(suite, point, one), "cost": cost}


def compile_count(suite, point) -> dict:
    """Every first K=1 step call of the scaling group's (config, B=1): one compile is expected
    for all contexts. (A K=3 call is its own program, as a K=3 `decode_k` is: the step's
    gather-attend runs on the call's rows, `attend_rows`.)"""
    timings = {}
    for impl in suite.impls:
        cfg = suite.cfg.replace(implementation=impl, tp_degree=1,
                                max_context=point.params["max_context"])
        calls = [c for c in suite.compile_record.get((cfg, 1), []) if c["k"] == 1]
        n = sum(c["compiles"] for c in calls)
        secs = sum(c["compile_s"] for c in calls)
        first = next((c["first_call_s"] for c in calls if c["compiles"]), None)
        errs = [(r.get("impls") or {}).get(impl, {}) for r in suite.records.values()
                if r["name"].startswith("scaling-")]
        errs = [e for e in errs if e.get("error")]
        ok = bool(calls) and not errs
        timings[impl] = {"median_us": secs * 1e6 if ok and n else None, "compiles": n,
                         "compile_s": secs, "first_call_s": first, "calls": calls,
                         **({"error": errs[0]["error"]} if errs else {})}
    return {"timings": timings, "cost": None}


def memory(suite, point) -> dict:
    """`dsa_jax.state.state_bytes_per_seq` against the bytes of a one-sequence state."""
    m = point.params["max_context"]
    cfg = suite.cfg.replace(max_context=m)
    value = state_bytes_per_seq(cfg)
    st = jax.eval_shape(lambda: init_state(cfg, 1))
    actual = int(sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(st)))
    fields = {
        "value_bytes": value, "value_MiB": value / 2 ** 20, "state_array_bytes_one_seq": actual,
        # The state's arrays for one sequence add the one per-tensor kv_scale (4 bytes).
        "accounting_gap_bytes": abs(actual - value),
        # The raw indexer rows live in a ring of ring_rows(cfg) positions (dsa_jax.state).
        "index_ring_rows": ring_rows(cfg),
        "breakdown": state_bytes_breakdown(cfg)}
    return {"timings": {}, "cost": None, "fields": fields}


def host_checks_us(cfg, weights, state, x1, reps: int) -> float:
    """Host time of `dsa_jax.layer.prepare_step` for a decode (its checks read the state)."""
    return host_time_us(lambda: layer.prepare_step(cfg, weights, state, x1, kind="decode"),
                        reps)


def row_padding_us(cfg, x1, groups: int) -> float:
    """`RowLayout.pad` of a decode row to max_verify rows, blocked after every call."""
    pad = jax.jit(lambda x: layer.RowLayout(cfg.max_verify, 1, True).pad(x, None)[0])
    jax.block_until_ready(pad(x1))
    return measure(lambda: pad(x1), warmup=2, groups=groups, inner=1)["median_us"]


MEASURES = {"step": step, "public_decode": public_decode, "attend": gather_attend,
            "selection": selection, "prefill": prefill, "compile": compile_count,
            "memory": memory}
