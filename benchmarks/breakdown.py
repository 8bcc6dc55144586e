"""Where the step's time goes: each stage of `dsa_jax.layer.step` jitted alone from the public
functions it is made of (same inputs; the state threaded and donated where a stage writes it),
beside the whole jitted step and its device kernels; and the public `dsa_jax.decode` call split
into its host checks, its row padding and the step.

Stages: project (`projection.project`), cache_writes (`attend.write_latents` and
`indexer.write_index_rows` at positions `lengths + r`, r < n_new), pool_scores
(`indexer.pool_scores` over `layer.candidate_pools`), top_k (`select.top_pools`), expand
(`select.expand_selection`), attend (`attend.attend`), output_projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsa_jax import attend, indexer, layer, projection, select
from dsa_jax import step as dsa_step

from .harness import check_device, err_text, log, measure, profile_step
from .measures import host_checks_us, row_padding_us, time_public_decode
from .workloads import StepRunner

STAGES = ("project", "cache_writes", "pool_scores", "top_k", "expand", "attend",
          "output_projection")


def row_positions(state, rows: int, n_new):
    """`pos [B, rows]` = lengths + r and `valid [B, rows]` = r < n_new: where the step writes."""
    pos = state.lengths[:, None] + jnp.arange(rows, dtype=jnp.int32)
    return pos, jnp.arange(rows)[None, :] < n_new[:, None]


def stage_fns(cfg) -> dict:
    """The step's stages as separately jitted functions."""

    def cache_writes(weights, state, proj, n_new):
        pos, valid = row_positions(state, proj.kv_raw.shape[1], n_new)
        state = attend.write_latents(cfg, state, proj.kv_raw, weights.kv_a_norm, pos, valid)
        return indexer.write_index_rows(cfg, weights, state, proj.k_raw, proj.g, pos, valid)

    def pool_scores(proj, pool_keys, pos, valid):
        return indexer.pool_scores(cfg, proj.qi, proj.w, pool_keys,
                                   layer.candidate_pools(cfg, pos, valid))

    def attend_rows(state, q_abs, sel):
        return attend.attend(cfg, state, q_abs, sel, dsa_step.live_rows(cfg, q_abs))

    return {"project": jax.jit(lambda w, x: projection.project(cfg, w, x)),
            "cache_writes": jax.jit(cache_writes, donate_argnums=(1,)),
            "pool_scores": jax.jit(pool_scores),
            "top_k": jax.jit(lambda s: select.top_pools(cfg, s)),
            "expand": jax.jit(lambda p, pos, v: select.expand_selection(cfg, p, pos, v)),
            "attend": jax.jit(attend_rows),
            "output_projection": jax.jit(projection.output_projection)}


def run(suite) -> None:
    """The breakdown at the decode (1 and big_batch sequences), the K=3 verify, one prompt,
    and the batch-1 decode at each TP degree > 1 (one rank's work, as the tp8 points)."""
    p = suite.plan
    out: dict = {"note": "stage medians; 'sum' adds the stages, 'step' is the whole jitted "
                         "step (jax.jit(dsa_jax.layer.step), state donated) at the same shapes",
                 "runs": {}}
    suite.result["breakdown"] = out
    verify_k = min(3, suite.cfg.max_verify)
    runs = [(impl, b, 1, 1) for b in (1, p.big_batch) for impl in suite.impls]
    runs += [(impl, 1, verify_k, 1) for impl in suite.impls]
    runs += [(impl, 1, p.prefill_tokens, 1) for impl in suite.impls]
    runs += [(impl, 1, 1, tp) for tp in p.tp if tp != 1 for impl in suite.impls]
    for impl, b, k, tp in suite.tqdm(runs, "breakdown"):
        if suite.late():
            break
        key = (f"{impl}-b{b}" if k == 1 else f"{impl}-b{b}-k{k}" if k == verify_k
               else f"{impl}-prefill{k}") + (f"-tp{tp}" if tp != 1 else "")
        res: dict = {}
        out["runs"][key] = res
        try:
            one(suite, suite.cfg.replace(implementation=impl, tp_degree=tp), b, k, res)
        except Exception as e:
            log(f"[bench] breakdown {key} failed: {type(e).__name__}: {str(e)[:300]}")
            check_device(e)
            res["error"] = err_text(e)
        suite.save()


def one(suite, cfg, b: int, k: int, res: dict) -> None:
    """Stages of one step: a decode or verify (k <= max_verify rows, padded to max_verify, at
    context ctx) or a prefill (k rows from an empty context; fewer repetitions); at the
    config's TP degree, one rank's work."""
    p = suite.plan
    f = stage_fns(cfg)
    weights = suite.weights_for(cfg.tp_degree)
    decode = k <= cfg.max_verify
    rows, start = (cfg.max_verify, p.ctx - p.inner * k) if decode else (k, 0)
    groups, inner = (p.groups, p.inner) if decode else (p.long_groups, 1)
    runner = StepRunner(cfg, weights, b, k, rows, start, 2000 + b + k)
    x = runner.xs[0]
    st = {"state": runner.state}
    pos, valid = row_positions(runner.state, rows, runner.n_new)
    proj = f["project"](weights, x)
    st["state"] = f["cache_writes"](weights, st["state"], proj, runner.n_new)
    scores = f["pool_scores"](proj, st["state"].pool_keys, pos, valid)
    pools = f["top_k"](scores)
    sel = f["expand"](pools, pos, valid)
    o_lat = f["attend"](st["state"], proj.q_abs, sel)
    jax.block_until_ready(f["output_projection"](weights, o_lat))

    def write_call():
        st["state"] = f["cache_writes"](weights, st["state"], proj, runner.n_new)
        return st["state"]

    calls = {
        "project": lambda: f["project"](weights, x),
        "cache_writes": write_call,
        "pool_scores": lambda: f["pool_scores"](proj, st["state"].pool_keys, pos, valid),
        "top_k": lambda: f["top_k"](scores),
        "expand": lambda: f["expand"](pools, pos, valid),
        "attend": lambda: f["attend"](st["state"], proj.q_abs, sel),
        "output_projection": lambda: f["output_projection"](weights, o_lat),
    }
    for name, call in calls.items():
        t = measure(call, warmup=2, groups=groups, inner=inner)
        res[name] = {q: t[q] for q in ("median_us", "p10_us", "p90_us")}
    res["sum_us"] = sum(v["median_us"] for v in res.values())
    runner.state = st["state"]
    runner.reset()
    jax.block_until_ready(runner())
    res["step_us"] = measure(runner, warmup=2, groups=groups, inner=inner,
                             reset=runner.reset)["median_us"]
    # The same step one call at a time (a block after each): dispatch not hidden.
    res["step_blocked_each_call_us"] = measure(runner, warmup=1, groups=groups, inner=1,
                                               reset=runner.reset)["median_us"]
    if b == 1 and k == 1 and cfg.tp_degree == 1:
        res["public_decode"] = public_breakdown(suite, cfg, weights, runner)
    try:  # traced calls stay within the timed context range
        res["profile"] = profile_step(runner, max(1, p.inner - 2) if decode else 1)
    except Exception as e:
        res["profile"] = {"error": err_text(e)}


def public_breakdown(suite, cfg, weights, runner) -> dict:
    """`dsa_jax.decode` = host checks + row padding + the step (+ slicing), pipelined."""
    p = suite.plan
    x1 = runner.xs[0][:, 0]  # [B, D]
    res = {"host_checks_us": host_checks_us(cfg, weights, runner.state, x1, p.groups * p.inner),
           "row_padding_blocked_us": row_padding_us(cfg, x1, p.groups)}
    for key, check in (("decode_us", True), ("decode_unchecked_us", False)):
        t, runner.state = time_public_decode(cfg, weights, runner.state, x1, runner.start,
                                             warmup=2, groups=p.groups, inner=p.inner,
                                             check=check)
        res[key] = t["median_us"]
    jax.block_until_ready(runner.state)
    return res
