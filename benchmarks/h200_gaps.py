"""H200: where a short call's wall time goes beyond its kernels (the attend-kernel-64x1 and
selection-b64 points: wall 64-78 us over 45-60 us of kernels), side by side in one process.

    PYTHONPATH=. python3 benchmarks/h200_gaps.py --out $OUT/h200-gaps.json [--flags a,b]
    PYTHONPATH=. python3 benchmarks/h200_gaps.py --sections launches --calls attend-a,args \
        --rounds 3 --out $OUT/h200-gaps.json
    PYTHONPATH=. python3 benchmarks/h200_gaps.py --smoke --out /tmp/h200-gaps.json

--sections: which of SECTIONS run; --calls: only the calls whose name holds one of these
strings; --rounds: each section's calls that many times, interleaved (the host drifts between
rows); --traced-rounds: how many of the first rounds also take the profiler traces (the slow
part of a row; 0: wall and enqueue times only).

--flags: each named XLA flag set (FLAGS) in a fresh process (XLA reads its flags once), the
rows tagged with it; without it, this process's flags.

Per call, each built as the bench builds it (`benchmarks.measures`): `wall_us` (median of
back-to-back calls, `harness.measure` with the bench plan's groups and inner), `enqueue_us`
(host time per call to issue `inner` calls without a block: near `wall_us`, the host sets the
pace), and from a profiler trace the kernel time per call, the time the device had a kernel
running (`busy_us`), the first kernel's start to the last one's end (`span_us`), launches. If
`span_us` ~ `wall_us` and `busy_us` < `span_us`, the device idles between its kernels inside
the pipelined calls (launch gaps); if `enqueue_us` ~ `wall_us`, the host paces them.
`launches` (`launch_calls`): the same kernels in fewer launches per program, and one fusion
of 1, 8 or 16 inputs, to read what a launch and an argument cost the host. Then one trivial
program per launch kind (`kind_calls`: an XLA fusion, Pallas Triton, Pallas
Mosaic GPU, jax-triton; the XLA one alone on a CPU): the host's cost of a call with ~1 us of
kernel. `gap_before_us`: per kernel name, the median idle time of the device before it starts (from
the trace; the profiler slows the host, so these are upper bounds). Variants: `bench` (the
state pytree, q, sel: the point's call until s30), `lean` (only the arrays the attend reads:
the point's call since), `x8` (8
attends of distinct inputs in one program: per attend, the device's time with the program's
own launches, one dispatch for 8), and for the selection `bench` (cfg a static argument, as
the point) and `bound` (cfg closed over: no hash of the config per call).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.device_script import header, json_parser, run_section, write_json
from benchmarks.harness import (
    call_floor_program,
    host_events,
    measure,
    profile,
    trace_events,
    trace_names,
)
from benchmarks.points import full_plan, smoke_plan
from benchmarks.workloads import Cycle, attend_inputs, selection_inputs
from dsa_jax import indexer, layer, select
from dsa_jax.attend import attend as attend_rows
from dsa_jax.pallas import attend_prep, pool_topk
from dsa_jax.pallas import sparse_attend_mgpu as mgpu_op
from dsa_jax.pallas.colaunch import colaunch
from dsa_jax.pallas.common import sm_count
from dsa_jax.pallas.merge_splits import merge_splits_pallas
from dsa_jax.pallas.sparse_attend import AttendTuning
from dsa_jax.shapes import glm53_flash, tiny

# XLA_FLAGS per flag set: XLA's default; every kernel kind captured in command buffers however
# short the run; command buffers off.
SECTIONS = ("launches", "kinds", "attend", "selection")
FLAGS = {"default": "",
         "min1": "--xla_gpu_graph_min_graph_size=1",
         "all-min1": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
                     "--xla_gpu_graph_min_graph_size=1",
         "off": "--xla_gpu_enable_command_buffer="}

# Per-program compile options (`jax.jit(compiler_options=)`, not XLA_FLAGS): command buffers
# off; fusions captured but custom calls (the Pallas kernels) launched on their own.
CB_VARIANTS = {"cboff": {"xla_gpu_enable_command_buffer": ""},
               "cbfusion": {"xla_gpu_enable_command_buffer": "FUSION"}}


@functools.partial(jax.jit, static_argnums=0)
def selection_static(cfg, qi, w, keys, pos, valid):  # as the selection point's
    scores = indexer.pool_scores(cfg, qi, w, keys, layer.candidate_pools(cfg, pos, valid))
    return select.expand_selection(cfg, select.top_pools(cfg, scores), pos, valid)


def enqueue_us(call, inner: int, reps: int = 15) -> float:
    """Median host us per call to issue `inner` calls back to back (then waited for)."""
    out = []
    for _ in range(reps):
        jax.block_until_ready(call())
        t0 = time.perf_counter()
        for _ in range(inner):
            r = call()
        out.append((time.perf_counter() - t0) / inner * 1e6)
        jax.block_until_ready(r)
    return statistics.median(out)


def gaps_before(call, calls: int = 20) -> dict:
    """Per kernel name, the median idle us of the device stream before that kernel starts."""
    ev = trace_events(call, calls)
    _, threads, dev = trace_names(ev)
    kern = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "?"))
                  for e in ev if e.get("ph") == "X" and e.get("pid") in dev
                  and "Stream" in threads.get((e["pid"], e.get("tid")), ""))
    gaps: dict = {}
    for (_, end0, _), (start, _, name) in zip(kern, kern[1:], strict=False):
        gaps.setdefault(name[:60], []).append(start - end0)
    return {n: statistics.median(g) for n, g in gaps.items()}


def row(name: str, call, plan, per: int = 1, traced: bool = True) -> dict:
    """`per`: calls of the timed work in one call (the rows' times are per work item);
    traced=False: the wall and enqueue times only (no profiler traces: quicker rounds)."""
    jax.block_until_ready(call())
    t = measure(call, warmup=plan.warmup, groups=plan.groups, inner=plan.inner)
    if not traced:
        return {"call": name, "flags": os.environ.get("XLA_FLAGS", ""),
                "wall_us": t["median_us"] / per, "wall_p10_us": t["p10_us"] / per,
                "enqueue_us": enqueue_us(call, plan.inner) / per, "kernel_us": None,
                "busy_us": None, "span_us": None, "launches": None, "top": None,
                "gap_before_us": None, "host": None, "error": None}
    prof = profile(call, 20, top=8)
    k = {key: (prof.get(f) / per if prof.get(f) is not None else None) for key, f in (
        ("kernel_us", "kernel_us_per_step"), ("busy_us", "kernel_busy_us_per_step"),
        ("span_us", "first_to_last_kernel_us_per_step"), ("launches", "launches_per_step"))}
    return {"call": name, "flags": os.environ.get("XLA_FLAGS", ""),
            "wall_us": t["median_us"] / per, "wall_p10_us": t["p10_us"] / per,
            "enqueue_us": enqueue_us(call, plan.inner) / per, **k, "top": prof.get("top_kernels"),
            "gap_before_us": gaps_before(call) if prof.get("error") is None else None,
            "host": host_events(call, 20, top=40, skip=("$",)), "error": prof.get("error")}


def attend_calls(cfg, plan):
    b, r, h, w = plan.kernel_a
    st, sets = attend_inputs(cfg, b, r, h, w, plan.ctx, 77 + r + b)
    bench = jax.jit(functools.partial(attend_rows, cfg))

    @jax.jit
    def lean(latent, kv_scale, tables, q, sel):
        return attend_rows(cfg, st._replace(latent=latent, kv_scale=kv_scale,
                                            block_tables=tables), q, sel)

    @jax.jit
    def x8(st, qs, sels):  # 8 attends of distinct inputs, one program
        return [attend_rows(cfg, st, q, s) for q, s in zip(qs, sels, strict=True)]

    qs = [sets[i % len(sets)][0] * (1.0 + i / 8) for i in range(8)]
    sels = [sets[i % len(sets)][1] for i in range(8)]
    return {"attend-a-bench": (Cycle(lambda q, s: bench(st, q, s), sets), 1),
            "attend-a-lean": (Cycle(lambda q, s: lean(st.latent, st.kv_scale, st.block_tables,
                                                      q, s), sets), 1),
            "attend-a-x8": (lambda: x8(st, qs, sels), 8)}


def selection_calls(cfg, plan):
    keys, pos, valid, sets = selection_inputs(cfg, plan.big_batch, 1, plan.ctx, 301)

    @jax.jit
    def bound(qi, w, keys, pos, valid):
        scores = indexer.pool_scores(cfg, qi, w, keys, layer.candidate_pools(cfg, pos, valid))
        return select.expand_selection(cfg, select.top_pools(cfg, scores), pos, valid)

    return {"selection-b64-bench": (Cycle(
                lambda qi, w: selection_static(cfg, qi, w, keys, pos, valid), sets), 1),
            "selection-b64-bound": (Cycle(lambda qi, w: bound(qi, w, keys, pos, valid), sets),
                                    1)}


def _mosaic_body(x_gmem, o_gmem):
    """y = 2 x + 1 as a Mosaic GPU kernel: a bulk copy in, the arithmetic in shared memory,
    a bulk copy out."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def scoped(buf, bar):
        plgpu.copy_gmem_to_smem(x_gmem, buf, bar)
        plgpu.barrier_wait(bar)
        buf[...] = buf[...] * 2.0 + 1.0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM(x_gmem.shape, x_gmem.dtype), plgpu.Barrier(num_arrivals=1))


def kind_calls(cfg, plan):
    """One trivial program per launch kind (y = 2 x + 1 on f32[64, 128], three inputs in
    turn): an XLA fusion, a Pallas Triton kernel, a Pallas Mosaic GPU kernel and (where the
    package is installed) a raw Triton kernel through jax-triton: what the host adds per call
    and per launch of each kind, beside the points' own calls. GPU only (the xla row alone on
    a CPU)."""
    del cfg, plan
    xs = [jnp.full((64, 128), float(i), jnp.float32) for i in range(3)]
    sets = [(x,) for x in xs]
    out = jax.ShapeDtypeStruct((64, 128), jnp.float32)

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    calls = {"kind-xla-fusion": jax.jit(lambda x: x * 2.0 + 1.0)}
    if jax.default_backend() == "gpu":
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu
        from jax.experimental.pallas import triton as plt

        calls["kind-pallas-triton"] = jax.jit(pl.pallas_call(
            body, out_shape=out, compiler_params=plt.CompilerParams(num_warps=4)))
        calls["kind-pallas-mosaic"] = jax.jit(plgpu.kernel(
            _mosaic_body, out_type=out, grid=(1,), grid_names=("i",)))
        try:
            import jax_triton as jt
            import triton
            import triton.language as tl

            @triton.jit
            def tkernel(x_ptr, o_ptr, n: tl.constexpr):
                offs = tl.arange(0, n)
                tl.store(o_ptr + offs, tl.load(x_ptr + offs) * 2.0 + 1.0)

            calls["kind-jax-triton"] = jax.jit(lambda x: jt.triton_call(
                x, kernel=tkernel, out_shape=out, grid=(1,), n=64 * 128))
        except ImportError:
            pass
    return {name: (Cycle(fn, sets), 1) for name, fn in calls.items()}


def chain(n: int):
    """n dependent Pallas Triton launches of y = 2 x + 1 in one program."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    one = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32),
                         compiler_params=plt.CompilerParams(num_warps=4))

    def run(x):
        for _ in range(n):
            x = one(x)
        return x

    return jax.jit(run)


def mosaic_chain(n: int):
    """n dependent Pallas Mosaic GPU launches of y = 2 x + 1 in one program (each builds its
    TMA descriptors and goes through the Mosaic FFI call on the host)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    one = plgpu.kernel(_mosaic_body, out_type=jax.ShapeDtypeStruct((64, 128), jnp.float32),
                       grid=(1,), grid_names=("i",))

    def run(x):
        for _ in range(n):
            x = one(x)
        return x

    return jax.jit(run)


def busy_chain(n: int):
    """n dependent [2048, 4096] x [4096, 2048] bf16 GEMMs (XLA's) in one program."""
    def run(a, b):
        for _ in range(n):
            a = jnp.concatenate([a @ b, a @ b], axis=1) * 0.5
        return a

    return jax.jit(run)


def _attend_parts(cfg, w: int):
    """The library's Mosaic attend for R = 1 rows cut into its launches (as
    `sparse_attend._mosaic_attend` runs them with AttendTuning's defaults and no padding), every
    array an argument: prep(q, sel, tables) -> inputs; mosaic(h, latent, kv_scale, *inputs) ->
    (o, m, l); merge(o, m, l, kv_scale) -> [N, Hp, C]."""
    t = AttendTuning().mosaic
    bs, c = cfg.block_size, cfg.kv_lora_rank
    softmax_scale = cfg.qk_nope_head_dim ** -0.5

    def plan(n, h):
        hp = -(-h // mgpu_op.HEADS_PER_CTA) * mgpu_op.HEADS_PER_CTA
        tiles_all = -(-w // t.block_w)
        splits = mgpu_op.num_splits(n * (hp // mgpu_op.HEADS_PER_CTA), tiles_all,
                                    sm_count(), t.max_splits)
        tiles = -(-tiles_all // splits)
        return hp, splits, tiles, splits * tiles * t.block_w

    def prep(q, sel, tables):  # q [B, 1, H, C] f32, sel [B, 1, W], tables [B, MB]
        b, r, h, _ = q.shape
        hp, _, _, wp = plan(b * r, h)
        return attend_prep.prep_pallas(
            q.reshape(b * r, h, c), sel, tables, bs, hp=hp, wp=wp,
            heads_per_chunk=t.prep_heads, num_warps=t.prep_warps,
            programs=t.prep_per_sm * sm_count() or None, write_q=not t.q_in_kernel, rows=r,
            scale_heads=t.scale_heads, slots_apart=t.prep_slots_apart)

    def mosaic(h, latent, kv_scale, qk, up, down, slots, live):
        _, splits, tiles, _ = plan(qk.shape[0], h)
        return mgpu_op.sparse_attend_mgpu_partials(
            jnp.asarray(kv_scale, jnp.float32), (up, down), live, qk, slots,
            latent.reshape(-1, c), softmax_scale=softmax_scale, splits=splits, tiles=tiles,
            tuning=t)

    def merge(o, m, l, kv_scale):
        return merge_splits_pallas(o, m, l, dtype=jnp.float32,
                                   scale=jnp.asarray(kv_scale, jnp.float32))

    return prep, mosaic, merge


def launch_calls(cfg, plan, want=lambda name: True):
    """The same kernels with fewer launches per program, to read what one launch costs the
    host in a lone call: chains of 1-8 trivial Pallas Triton kernels and of 1 or 4 Mosaic
    GPU ones; one fusion of 1, 8, 16 inputs (the cost of an argument); the attend point's call
    (prep, Mosaic, merge) with the prep's outputs given (Mosaic + merge) and the Mosaic kernel
    alone; the selection point's call with each row's candidate count given (scores + top-k)
    and its scores alone. Every array is an argument (closed-over arrays would be constants of
    the program), each row's count in `args`; a cut call whose result can be compared is
    checked `==` the whole call's part (`equal_to_whole`). want(name prefix): whether to
    build a group of rows at all."""
    out = {}
    xs = [(jnp.full((64, 128), float(i), jnp.float32),) for i in range(3)]
    if jax.default_backend() == "gpu":
        for n in (1, 2, 3, 4, 8):
            out[f"chain-{n}"] = (Cycle(chain(n), xs), 1, {"args": 1})
        for n in (1, 4):
            out[f"mosaic-chain-{n}"] = (Cycle(mosaic_chain(n), xs), 1, {"args": 1})
    # n dependent ~50 us GEMMs per program (rows per GEMM): a device-bound call, whose wall
    # beyond its kernels is what one execution idles the device (at n = 1) and its launch gaps
    if jax.default_backend() == "gpu" and want("busy-"):
        busy = [(jnp.full((2048, 4096), 0.01 * (i + 1), jnp.bfloat16),
                 jnp.full((4096, 2048), 0.01, jnp.bfloat16)) for i in range(3)]
        for n in (1, 4):
            out[f"busy-{n}"] = (Cycle(busy_chain(n), busy), n, {"args": 2})
    for n in (1, 8, 16):  # one XLA fusion summing n small arrays: the host's cost per argument
        sets = [tuple(jnp.full((64, 128), float(i + j), jnp.float32) for j in range(n))
                for i in range(3)]
        out[f"args-{n}"] = (Cycle(jax.jit(lambda *a: functools.reduce(jnp.add, a)), sets), 1,
                            {"args": n})
    # the attend point's shapes and inputs (attend_calls')
    b, r, h, w = plan.kernel_a
    if jax.default_backend() == "gpu" and want("attend-a-"):
        st, sets = attend_inputs(cfg, b, r, h, w, plan.ctx, 77 + r + b)
        prep, mosaic, merge = _attend_parts(cfg, w)
        arrays = (st.latent, st.kv_scale)
        prepped = [arrays + tuple(jax.block_until_ready(jax.jit(prep)(q, s, st.block_tables)))
                   for q, s in sets]
        def whole_fn(latent, kv_scale, tables, q, s):
            return attend_rows(cfg, st._replace(latent=latent, kv_scale=kv_scale,
                                                block_tables=tables), q, s)

        whole = jax.jit(whole_fn)
        two = jax.jit(lambda latent, kv_scale, *p: merge(*mosaic(h, latent, kv_scale, *p),
                                                         kv_scale))
        one = jax.jit(lambda *p: mosaic(h, *p))
        full = [(*arrays, st.block_tables, q, s) for q, s in sets]
        ref = whole(*full[0])
        same = bool((ref == two(*prepped[0])[:, :h].reshape(ref.shape)).all())
        print(f"attend cut == whole: {same}", flush=True)
        out["attend-a-3launch"] = (Cycle(whole, full), 1, {"args": 5})
        out["attend-a-floor"] = (Cycle(call_floor_program(whole_fn, full[0]), full), 1, {"args": 5})
        # as the bench's point calls it: the state pytree (8 arrays, 3 read: jit prunes the
        # rest from the program, the dispatch still checks every leaf)
        bench = jax.jit(functools.partial(attend_rows, cfg))
        out["attend-a-state"] = (Cycle(lambda q, s: bench(st, q, s), sets), 1,
                                 {"args": len(jax.tree.leaves(st)) + 2})
        for tag, opts in CB_VARIANTS.items():  # the same program under other capture options
            fn = jax.jit(whole_fn, compiler_options=opts)
            out[f"attend-a-{tag}"] = (Cycle(fn, full), 1, {"args": 5, "options": opts})
        out["attend-a-2launch-prepped"] = (Cycle(two, prepped), 1,
                                           {"args": 7, "equal_to_whole": same})
        out["attend-a-1launch-mosaic"] = (Cycle(one, prepped), 1, {"args": 7})
    if not want("selection-b64-"):
        return out

    def sel3_fn(qi, w_, keys, pos, valid):  # the selection points' program until s30
        scores = indexer.pool_scores(cfg, qi, w_, keys, layer.candidate_pools(cfg, pos, valid))
        return select.select_slots(cfg, scores, pos, valid)

    def lib_fn(qi, w_, keys, pos, valid):  # since (the counts and positions in the kernels)
        return select.select_slots(cfg, indexer.pool_scores_at(cfg, qi, w_, keys, pos, valid),
                                   pos, valid)

    sel3, lib = jax.jit(sel3_fn), jax.jit(lib_fn)
    keys4, pos4, valid4, ssets4 = selection_inputs(cfg, plan.big_batch, 4, plan.ctx, 304)
    s4 = [(qi, w_, keys4, pos4, valid4) for qi, w_ in ssets4]
    out["selection-b64-r4-3launch"] = (Cycle(sel3, s4), 1, {"args": 5})
    same4 = bool((sel3(*s4[0]) == lib(*s4[0])).all())
    print(f"selection-r4 library call == 3-launch: {same4}", flush=True)
    out["selection-b64-r4-lib"] = (Cycle(lib, s4), 1, {"args": 5, "equal_to_whole": same4})
    out["selection-b64-r4-floor"] = (Cycle(call_floor_program(sel3_fn, s4[0]), s4), 1, {"args": 5})
    keys, pos, valid, ssets = selection_inputs(cfg, plan.big_batch, 1, plan.ctx, 301)
    n_cand = jax.block_until_ready(layer.candidate_pools(cfg, pos, valid))

    @jax.jit
    def sel2(qi, w_, keys, n_cand, pos, valid):
        return select.select_slots(cfg, indexer.pool_scores(cfg, qi, w_, keys, n_cand), pos,
                                   valid)

    @jax.jit
    def sel1(qi, w_, keys, n_cand):
        return indexer.pool_scores(cfg, qi, w_, keys, n_cand)

    s3 = [(qi, w_, keys, pos, valid) for qi, w_ in ssets]
    s2 = [(qi, w_, keys, n_cand, pos, valid) for qi, w_ in ssets]
    s1 = [(qi, w_, keys, n_cand) for qi, w_ in ssets]
    same = bool((sel3(*s3[0]) == sel2(*s2[0])).all())
    print(f"selection cut == whole: {same}", flush=True)
    out["selection-b64-3launch"] = (Cycle(sel3, s3), 1, {"args": 5})
    same1 = bool((sel3(*s3[0]) == lib(*s3[0])).all())
    print(f"selection library call == 3-launch: {same1}", flush=True)
    out["selection-b64-lib"] = (Cycle(lib, s3), 1, {"args": 5, "equal_to_whole": same1})
    out["selection-b64-floor"] = (Cycle(call_floor_program(sel3_fn, s3[0]), s3), 1, {"args": 5})
    out["selection-b64-2launch-ncand"] = (Cycle(sel2, s2), 1,
                                          {"args": 6, "equal_to_whole": same})
    out["selection-b64-1launch-scores"] = (Cycle(sel1, s1), 1, {"args": 4})
    if jax.default_backend() == "gpu":
        # 2 launches, 5 arguments: the scores given each row's candidate count, the top-k its
        # position (what computing both in the kernels from pos and valid would leave)
        tuning = pool_topk.PoolTopkTuning()

        @jax.jit
        def sel2pv(qi, w_, keys, n_cand, pv):
            scores = indexer.pool_scores(cfg, qi, w_, keys, n_cand)
            part, finish = pool_topk.topk_part(scores, min(cfg.select_k, scores.shape[-1]),
                                               tuning=tuning, expand=select.expansion(cfg),
                                               pv=pv)
            (outs,) = colaunch([part], num_warps=tuning.num_warps, num_stages=1)
            return finish(outs)

        for tag, (sets_, p_, v_) in (("", (s3, pos, valid)), ("-r4", (s4, pos4, valid4))):
            nc = jax.block_until_ready(layer.candidate_pools(cfg, p_, v_))
            pv = jax.block_until_ready(pool_topk.positions(p_, v_).reshape(-1))
            spv = [(qi, w_, k_, nc, pv) for qi, w_, k_, _, _ in sets_]
            same = bool((sel3(*sets_[0]) == sel2pv(*spv[0])).all())
            print(f"selection{tag} 2-launch cut == whole: {same}", flush=True)
            out[f"selection-b64{tag}-2launch-pv"] = (Cycle(sel2pv, spv), 1,
                                                     {"args": 5, "equal_to_whole": same})
    return out


def measure_all(res: dict, smoke: bool, out: str, sections=SECTIONS, only=(), rounds=1,
                traced=1, inners=()) -> None:
    """inners: each call's wall measured with groups of each of these many calls (a row per
    inner, named call@inner): a group's first launch and its final wait are spread over
    `inner` calls, so the rows' difference is their share of a row's wall."""
    cfg = (tiny() if smoke else glm53_flash()).replace(
        implementation="xla" if smoke else "pallas")
    plan = (smoke_plan if smoke else full_plan)(cfg)
    plans = ({f"@{n}": dataclasses.replace(plan, inner=n) for n in inners} if inners
             else {"": plan})

    def wanted(name):
        return not only or any(o in name or name in o for o in only)

    def section(make):
        def go():
            made = (make(cfg, plan, wanted) if make is launch_calls else make(cfg, plan))
            calls = {k: v for k, v in made.items() if not only or any(o in k for o in only)}
            for i in range(rounds):  # rounds interleave the calls: the host drifts
                for (name, (call, per, *extra)), (tag, p) in itertools.product(
                        calls.items(), plans.items()):
                    res["rows"].append({**row(name + tag, call, p, per, traced=i < traced),
                                        **(extra[0] if extra else {}), "round": i,
                                        "inner": p.inner})
                    print(json.dumps(res["rows"][-1])[:600], flush=True)
                    write_json(res, out)
        return go

    for name, make in (("launches", launch_calls), ("kinds", kind_calls),
                       ("attend", attend_calls), ("selection", selection_calls)):
        if name in sections:
            run_section(res, name, section(make))
    write_json(res, out)


def summary(res: dict) -> str:
    """One line per row: wall, its 10th percentile, enqueue and kernel us, launches, the
    program's arguments where the row counts them."""
    return "\n".join(
        f'{r["call"]:30s} r{r.get("round", 0)} wall {r["wall_us"]:6.1f} '
        f'p10 {r["wall_p10_us"]:6.1f} enq {r["enqueue_us"]:6.1f} '
        f'kern {r["kernel_us"] or 0:6.1f} launches {r["launches"]} args {r.get("args", "-")}'
        for r in res["rows"])


def medians(res: dict) -> str:
    """Per call over its rounds: the median wall and enqueue us (the host drifts between
    rounds; with many rounds the medians compare calls a few us apart)."""
    by: dict = {}
    for r in res["rows"]:
        by.setdefault(r["call"], []).append(r)
    return "\n".join(
        f'{name:30s} rounds {len(rs):2d} wall {statistics.median(r["wall_us"] for r in rs):6.1f}'
        f' enq {statistics.median(r["enqueue_us"] for r in rs):6.1f}'
        for name, rs in by.items())


def main(argv: list[str] | None = None) -> int:
    ap = json_parser(__doc__)
    ap.add_argument("--flags", default="", help=f"comma list of {sorted(FLAGS)}")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument("--calls", default="", help="comma list: only calls whose name holds one")
    ap.add_argument("--rounds", type=int, default=1, help="each section's calls, interleaved")
    ap.add_argument("--inners", default="", help="comma list: calls per timed group, a row "
                    "each (default: the plan's)")
    ap.add_argument("--traced-rounds", type=int, default=1,
                    help="the first rounds that also take profiler traces (0: none)")
    args = ap.parse_args(argv)
    res = {**header("h200_gaps.py", argv), "rows": [], "errors": []}
    if not args.flags:
        measure_all(res, args.smoke, args.out, tuple(args.sections.split(",")),
                    tuple(filter(None, args.calls.split(","))), args.rounds, args.traced_rounds,
                    tuple(int(n) for n in filter(None, args.inners.split(","))))
        print(summary(res), "\n" + medians(res), "\nerrors", res["errors"], flush=True)
        return 1 if res["errors"] else 0
    for name in args.flags.split(","):
        part = f"{args.out}.{name}.json"
        flags = f"{os.environ.get('XLA_FLAGS', '')} {FLAGS[name]}".strip()
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update({"XLA_FLAGS": flags} if flags else {})
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # for `benchmarks`
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        cmd = [sys.executable, __file__, "--out", part, *(["--smoke"] if args.smoke else [])]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        print(name, p.returncode, p.stdout[-3000:], p.stderr[-1500:] if p.returncode else "",
              flush=True)
        try:
            with open(part) as f:
                child = json.load(f)
        except OSError as e:
            res["errors"].append({"flags": name, "error": str(e), "stderr": p.stderr[-1500:]})
            continue
        res["rows"] += [{**r, "flag_set": name} for r in child["rows"]]
        res["errors"] += child["errors"]
        write_json(res, args.out)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
