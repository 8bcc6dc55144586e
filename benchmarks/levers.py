"""Levers: design choices measured against their alternative, each with its prediction.

- kv_b applied at run time (the step's form) against absorbed at load time: byte counts, and
  both forms timed;
- the two fused input GEMMs against seven separate ones;
- `batch_invariant` on against off (docs/decisions.md's rule for its defaults).

The fp8 weights' GEMMs against bf16 are the `fp8` group's (benchmarks/fp8_weights.py). The
pool keys cached vs recomputed and the state donated vs copied levers were measured and
removed (docs/performance.md's lever table; their code at tag `lab-2026-12`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import layer, projection

from .harness import check_device, err_text, kernel_us, log, measure, profile_step
from .roofline import absorbed_vs_runtime
from .schema import ratio
from .workloads import StepRunner

FORM_TIMES = "_us: median wall time, _kernel_us: device kernel time (trace)"


def run(suite) -> None:
    p, lev = suite.plan, suite.result["levers"]
    lev["kv_b_absorbed_vs_runtime"] = {
        f"tp{tp}": absorbed_vs_runtime(suite.cfg.replace(tp_degree=tp)) for tp in p.tp}
    suite.save()
    if suite.args.no_levers:
        return
    for name, fn in (("kv_b_absorbed_vs_runtime_measured", kv_b_forms),
                     ("fused_projections_vs_separate", fused_projections),
                     ("batch_invariant_vs_default", batch_invariance)):
        if suite.late():
            lev[name] = {"skipped": "over the time budget"}
            continue
        lev[name] = suite.guarded(f"lever {name}", functools.partial(fn, suite))
        suite.save()


# Two forms of the same work ------------------------------------------------------------------


def wall_and_kernel_us(calls: dict, plan) -> dict:
    """For each named call: `<name>_us`, the median wall time of back-to-back calls, and
    `<name>_kernel_us`, its device kernel time per call (None off a GPU)."""
    res = {}
    for name, fn in calls.items():
        res[f"{name}_us"] = measure(fn, warmup=plan.warmup, groups=plan.groups,
                                    inner=plan.inner)["median_us"]
        res[f"{name}_kernel_us"] = kernel_us(fn)
    return res


def add_ratios(res: dict, base: str, other: str) -> None:
    """A two-form lever's `<other>_over_<base>` ratios, of wall and of kernel times."""
    for t in ("", "_kernel"):
        res[f"{other}_over_{base}{t}"] = ratio(res[f"{other}{t}_us"], res[f"{base}{t}_us"])


def compare_forms(calls: dict, plan, base: str, other: str) -> dict:
    """Wall and kernel times of a lever's two forms and the ratios of `other` to `base`."""
    res = wall_and_kernel_us(calls, plan)
    add_ratios(res, base, other)
    return res


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def absorbed_kv_b(weights):
    """The load-time form of kv_b: `W_qb` folded with `U_k` ([Hl*C, R_q]) and `o_proj` with
    `U_v` ([D, Hl*C]), folded in fp32 and stored in the param dtype (the lever's other side)."""
    hl, dn, c = weights.u_k.shape
    f32 = jnp.float32
    q_b = weights.q_proj[:hl * dn].astype(f32).reshape(hl, dn, -1)  # [Hl, Dn, R]
    w_q = jnp.einsum("hdc,hdr->hcr", weights.u_k.astype(f32), q_b,
                     precision="highest").reshape(hl * c, -1)
    o = weights.o_proj.astype(f32).reshape(weights.o_proj.shape[0], hl, -1)  # [D, Hl, Dv]
    w_o = jnp.einsum("ehv,hvc->ehc", o, weights.u_v.astype(f32),
                     precision="highest").reshape(o.shape[0], hl * c)
    return w_q.astype(weights.q_proj.dtype), w_o.astype(weights.o_proj.dtype)


@jax.jit
def _q_runtime(q_b, u_k, q_resid):
    hl, dn, _ = u_k.shape
    q = projection.matmul(q_resid, q_b)  # [..., Hl*Dn]
    return projection.per_head(q.reshape(*q.shape[:-1], hl, dn), u_k, 1)  # [..., Hl, C]


def kv_b_forms(suite) -> dict:
    """kv_b applied at run time (q_b head rows then U_k; U_v then o_proj, as the step does)
    against absorbed at load time (one GEMM each way), timed on the same random inputs at 1
    and big_batch sequences, rows padded to max_verify as decode runs them, each TP degree."""
    p, cfg = suite.plan, suite.cfg
    matmul, o_runtime = jax.jit(projection.matmul), jax.jit(projection.output_projection)
    out = {"prediction": "at B=1 the run-time form reads fewer weight bytes (see "
                         "kv_b_absorbed_vs_runtime) and so should be faster once the GEMMs "
                         "are bandwidth-bound; at B=64 the absorbed form's extra FLOPs "
                         "(rows x bytes ratio) start to count as well",
           "results": {}}
    for tp in p.tp:
        w = suite.weights_for(tp)
        hl, dn, c = w.u_k.shape
        w_q, w_o = jax.block_until_ready(absorbed_kv_b(w))
        q_b = w.q_proj[:hl * dn]
        for b in (1, p.big_batch):
            rng = np.random.default_rng(700 + b)
            rows = (b, cfg.max_verify)
            q_resid = jax.device_put(rng.standard_normal((*rows, cfg.q_lora_rank), np.float32))
            o_lat = 0.1 * rng.standard_normal((*rows, hl, c), np.float32)  # [B, R, Hl, C]
            o_flat = jax.device_put(o_lat.reshape(*rows, hl * c))
            o_lat = jax.device_put(o_lat)
            calls = {"q_runtime": functools.partial(_q_runtime, q_b, w.u_k, q_resid),
                     "q_absorbed": functools.partial(matmul, q_resid, w_q),
                     "o_runtime": functools.partial(o_runtime, w, o_lat),
                     "o_absorbed": functools.partial(matmul, o_flat, w_o)}
            res = wall_and_kernel_us(calls, p)
            for form in ("runtime", "absorbed"):
                for t in ("", "_kernel"):
                    qt, ot = res[f"q_{form}{t}_us"], res[f"o_{form}{t}_us"]
                    res[f"{form}{t}_us"] = None if qt is None or ot is None else qt + ot
            add_ratios(res, "runtime", "absorbed")
            res["q_rel_diff"] = rel_diff(np.asarray(calls["q_absorbed"]()).reshape(
                *rows, hl, c), calls["q_runtime"]())
            res["o_rel_diff"] = rel_diff(calls["o_absorbed"](), calls["o_runtime"]())
            out["results"][f"tp{tp}-b{b}"] = res
    out["note"] = ("<half>_us: median wall time of the jitted half, back-to-back calls (at B=1 "
                   "this is dispatch-bound); <half>_kernel_us: its device kernel time from a "
                   "profiler trace (the bytes-bound figure the prediction is about); rel_diff "
                   "= ||absorbed - runtime|| / ||runtime|| (bf16 weights: the folds round once "
                   "more)")
    return out


@functools.partial(jax.jit, static_argnums=0)
def split_projection_weights(cfg, weights) -> tuple:
    """The fused input weights cut back into the seven GEMMs they fuse: x_proj rows q_a, kv_a,
    wk, gate, weights_proj; then q_b (q_proj) and wq_b (qi_proj), two GEMMs in both forms
    (the separate side of the fusion lever)."""
    r, c, di, hi = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_n_heads
    cuts = [0, r, r + c, r + c + di, r + c + 2 * di, r + c + 2 * di + hi]
    x = tuple(weights.x_proj[a:b] for a, b in zip(cuts, cuts[1:], strict=False))
    return x, (weights.q_proj, weights.qi_proj)


@functools.partial(jax.jit, static_argnums=0)
def _fused(cfg, weights, x):
    return tuple(projection.project(cfg, weights, x))


@functools.partial(jax.jit, static_argnums=0)
def _separate(cfg, pieces, q_a_norm, u_k, x):
    """The projections with seven input GEMMs; returns (q_abs, kv_raw, qi, k_raw, g, w)."""
    mm = projection.matmul
    (wqa, wkva, wk, wg, ww), (wqb, wqi) = pieces
    q_resid = projection.rms_norm(mm(x, wqa), q_a_norm, cfg.rms_norm_eps)  # [..., R]
    q = mm(q_resid, wqb)
    q = q.reshape(*q.shape[:-1], cfg.local_heads, cfg.qk_nope_head_dim)  # [..., Hl, Dn]
    qi = mm(q_resid, wqi)
    qi = qi.reshape(*qi.shape[:-1], cfg.index_n_heads, cfg.index_head_dim)  # [..., Hi, Di]
    return (projection.per_head(q, u_k, 1), mm(x, wkva), qi, mm(x, wk), mm(x, wg), mm(x, ww))


def fused_projections(suite) -> dict:
    """The step's fused input GEMM (x_proj = [q_a; kv_a; wk; gate; weights_proj]; q_b and
    wq_b are two GEMMs in both forms) against seven separate GEMMs on the same weights,
    through the absorbed query, at 1 and big_batch sequences (rows padded to max_verify),
    each TP degree; the two give the same projections."""
    p, cfg = suite.plan, suite.cfg
    out = {"prediction": "at B=1 the GEMMs are bandwidth-bound: both forms read the same "
                         "weight bytes, so fusing saves only the 5 extra launches (a few us "
                         "each); at B=64 the wider GEMMs also use the tensor cores better",
           "results": {}}
    for tp in p.tp:
        c = cfg.replace(tp_degree=tp)
        w = suite.weights_for(tp)
        pieces = jax.block_until_ready(split_projection_weights(c, w))
        for b in (1, p.big_batch):
            rng = np.random.default_rng(600 + b)
            x = jax.device_put(rng.standard_normal((b, c.max_verify, c.hidden_size),
                                                   np.float32).astype(w.x_proj.dtype))
            calls = {"fused": functools.partial(_fused, c, w, x),
                     "separate": functools.partial(_separate, c, pieces, w.q_a_norm, w.u_k, x)}
            res = compare_forms(calls, p, "fused", "separate")
            a, z = calls["fused"](), calls["separate"]()
            res["max_rel_diff"] = max(rel_diff(z[i], a[i]) for i in range(len(z)))
            out["results"][f"tp{tp}-b{b}"] = res
    out["note"] = ("fused: dsa_jax.projection.project (2 input GEMMs + the per-head U_k); "
                   "separate: the same with 7 input GEMMs; " + FORM_TIMES)
    return out


def _time_form(runner, plan, inner: int, warmup: int, what: str) -> dict:
    """One form of a lever: `{"_us": median wall, "_kernel_us": kernel time}` of a runner's
    steps, or `{"error": ...}` where its first call fails (e.g. pallas off a GPU: recorded,
    the lever goes on)."""
    try:
        jax.block_until_ready(runner())
    except Exception as e:
        log(f"[bench] {what}: {type(e).__name__}")
        check_device(e)
        return {"error": err_text(e)}
    return {"_us": measure(runner, warmup=warmup, groups=plan.groups, inner=inner,
                           reset=runner.reset)["median_us"],
            "_kernel_us": profile_step(runner, max(1, inner - 2), top=0).get(
                "kernel_us_per_step")}


def _two_forms(runners: dict, plan, inner: int, warmup: int, what: str) -> dict:
    """A two-form lever at one point: `runners` {base form: make runner, other form: make
    runner}, each form's `_time_form` keys prefixed with its name, and `add_ratios`; or the
    first form's `{"error": ...}`."""
    res = {}
    for form, make in runners.items():
        timed = _time_form(make(), plan, inner, warmup, what)
        if "error" in timed:
            return timed
        res.update({f"{form}{key}": v for key, v in timed.items()})
    add_ratios(res, *runners)
    return res


def batch_invariance(suite) -> dict:
    """`DsaConfig.batch_invariant` on against off, each implementation: the decode step at 1
    and big_batch sequences and a prompt of prefill_tokens rows (one sequence), wall and
    kernel time. The rule (docs/decisions.md): invariance is every entry point's default only
    where it costs <= 5% of kernel time at 1 and big_batch sequences."""
    p = suite.plan
    out = {"prediction": "free at big_batch (its plan is the invariant one); at one sequence "
                         "the attend runs big_batch's split count, 17 tiles in series instead "
                         "of one: well over 5% of a decode", "results": {}}
    for impl in suite.impls:
        cfg = suite.cfg.replace(implementation=impl)
        dec = layer.decode_rows(cfg, "decode")  # the rows a decode runs (as `run_step`)
        for b, k, rows, start, what in ((1, 1, dec, p.ctx - p.inner, "decode-b1"),
                                        (p.big_batch, 1, dec, p.ctx - p.inner,
                                         f"decode-b{p.big_batch}"),
                                        (1, p.prefill_tokens, p.prefill_tokens, 0,
                                         f"prefill-{p.prefill_tokens}")):
            runners = {form: (lambda on=on, b=b, k=k, rows=rows, start=start, cfg=cfg: StepRunner(
                cfg.replace(batch_invariant=on), suite.weights_for(1), b, k, rows, start,
                1700 + b)) for form, on in (("default", False), ("invariant", True))}
            out["results"][f"{impl}-{what}"] = _two_forms(
                runners, p, 1 if k > 1 else p.inner, 1, f"batch-invariance lever {impl}")
    out["note"] = ("the jitted step (`layer.step`, the state donated) with the config's "
                   "batch_invariant off (default) and on; _us: median wall time, _kernel_us: "
                   "device kernel time (trace)")
    return out
