"""The `fp8` group: the step, a prompt and the serving loop with fp8 weights kept as the
checkpoint stores them (`DsaConfig(param_dtype="float8_e4m3fn")`, `dsa_jax.fp8`) beside the
same checkpoint dequantized to bf16 at load, in one run (issue 59).

Both sides fold one fine-grained fp8 checkpoint (the suite's random layer quantized in
`weight_block` blocks, `dsa_jax.weights.quantize_hf_tensors`), so they compute the same
values: the fp8 side's outputs are checked `==` the bf16 side's at every point. Each point is
the suite's own point (benchmarks/points.py) measured by its own function with the config and
weights swapped, so the timing method is the suite's; a decode point's kernels are listed per
kernel (the weight GEMMs against the rest). Records `result["fp8_weights"]`: per point both
sides' wall and kernel times and `fp8_over_bf16`, and the weights' bytes per layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import fp8
from dsa_jax.implementation import matmul_op
from dsa_jax.layer import decode_rows
from dsa_jax.model import ModelConfig, init_model, stack_weights
from dsa_jax.weights import fold_weights, quantize_hf_tensors

from . import loop, measures
from .harness import err_text, log, profile_step
from .levers import compare_forms
from .roofline import param_bytes
from .schema import ratio
from .workloads import RNG, StepRunner, random_hf_tensors

SIDES = ("bf16", "fp8")
TIMES = ("median_us", "kernel_us", "kernel_us_per_token_per_layer", "us_per_token_per_layer")


def point_names(plan) -> list[str]:
    """The suite's points this group runs (issue 59's list)."""
    big, s, n = plan.big_batch, plan.prefill_tokens, plan.loop_layers
    return ["decode-b1-k1-tp1", f"decode-b{big}-k1-tp1", "verify-b1-k3-tp1", f"prefill-{s}",
            f"loop-b1-l{n}"]


SMOKE_BLOCK = (32, 32)  # the tiny config's heads are 64 rows: whole blocks of 32, not of 128


def side_config(suite, side: str):
    """The suite's config with its weights in bf16 or fp8 (the smoke run in smaller blocks)."""
    block = SMOKE_BLOCK if suite.args.smoke else suite.cfg.weight_block
    return suite.cfg.replace(param_dtype=fp8.FP8 if side == "fp8" else "bfloat16",
                             weight_block=block)


def checkpoint(suite, block) -> dict:
    """The suite's random layer as a fine-grained fp8 checkpoint (values + scales)."""
    return quantize_hf_tensors(suite.hf_tensors(), block)


def loop_weights(suite, cfg):
    """The loop points' stacked model weights at `cfg`, each layer folded from its fp8
    checkpoint (as `benchmarks.loop.loop_model` draws them)."""
    p = suite.plan
    kinds = ("full", "shared") * (p.loop_layers // 2) + ("full",) * (p.loop_layers % 2)
    cfg = cfg.replace(tp_degree=1, indexer_types=kinds)
    mcfg = ModelConfig(cfg, vocab_size=loop.VOCAB)
    layers = tuple(fold_weights(cfg, quantize_hf_tensors(
        random_hf_tensors(cfg, suite.args.seed + 10 + i, kind == "full"), cfg.weight_block))
        for i, kind in enumerate(kinds))
    weights = init_model(mcfg, jax.random.key(suite.args.seed, impl=RNG), layers=layers)
    return jax.block_until_ready(stack_weights(mcfg, weights))


@contextlib.contextmanager
def swapped(suite, cfg, weights, stacked):
    """The suite measuring at `cfg` with `weights` (TP 1) and the loop's `stacked` weights."""
    saved = suite.cfg, suite._weights, suite.loop_weights, suite.impls
    suite.cfg, suite._weights, suite.loop_weights = cfg, {1: weights}, stacked
    suite.impls = [main(suite)]
    try:
        yield
    finally:
        suite.cfg, suite._weights, suite.loop_weights, suite.impls = saved


def main(suite) -> str:
    """The implementation the group runs: the kernels where the suite runs them (compiled
    ones on a GPU only)."""
    runnable = [i for i in suite.impls if i != "pallas" or jax.default_backend() == "gpu"]
    return "pallas" if "pallas" in runnable else (runnable or suite.impls)[0]


def kernels_by_name(suite, cfg, weights, batch: int, prompt: int = 0) -> dict:
    """A decode step's device kernels, per kernel: time per step and launches (the rows
    `decode` runs: one per sequence under the row-invariant GEMMs); prompt: a prefill of this
    many rows into an empty sequence instead."""
    p = suite.plan
    cfg = cfg.replace(implementation=main(suite))
    if prompt:
        runner = StepRunner(cfg, weights, batch, prompt, prompt, 0, 3100, n_inputs=1)
        return profile_step(runner, 2, top=40)
    runner = StepRunner(cfg, weights, batch, 1, decode_rows(cfg, "decode"), p.ctx - p.inner,
                        3000 + batch)
    return profile_step(runner, max(1, p.inner - 2), top=40)


def same_outputs(suite, cfgs: dict, weights: dict) -> bool:
    """A 2-row verify step of 2 sequences from one random state: the fp8 side's `y` and
    selection `==` the bf16 side's."""
    outs = {}
    for side in SIDES:
        cfg = cfgs[side].replace(implementation=main(suite))
        runner = StepRunner(cfg, weights[side], 2, min(2, cfg.max_verify), cfg.max_verify,
                            suite.plan.ctx // 2, 77)
        outs[side] = [np.asarray(a) for a in jax.device_get(runner.step(
            cfg, weights[side], runner.state, runner.xs[0], runner.n_new, None)[::2])]
    return all((a == b).all() for a, b in zip(outs["fp8"], outs["bf16"], strict=True))


def weight_gemms(suite, block) -> dict:
    """The row-invariant GEMM kernel over each weight GEMM's shape with fp8 weights
    (`fp8.Fp8Block`, tiles dequantized in the kernel) against the same weights in bf16, at 1
    and big_batch rows: kernel and wall time, bits, and the floor of the fp8 weights' bytes
    at the copy bandwidth (issue 59: within 1.3x of it)."""
    if main(suite) != "pallas":
        return {"skipped": "the kernels (pallas) were not run"}
    cfg, p = suite.cfg, suite.plan
    kernels = cfg.replace(param_dtype="bfloat16", implementation="pallas" if  # interpret mode
                          jax.default_backend() == "gpu" else "pallas-interpret")  # (smoke)
    shapes = {"o_proj": (cfg.hidden_size, cfg.local_heads * cfg.v_head_dim),
              "q_b": (cfg.local_heads * cfg.qk_nope_head_dim, cfg.q_lora_rank),
              "qi": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
              "x_fp8_rows": (cfg.q_lora_rank + cfg.kv_lora_rank + 2 * cfg.index_head_dim,
                             cfg.hidden_size)}
    gemm = jax.jit(functools.partial(matmul_op, kernels))  # the row-invariant GEMM kernel
    out = {"prediction": "a weight-read-bound GEMM halves with its bytes: fp8 within 1.3x of "
                         "the fp8 bytes' floor at 1 row; no slower than bf16 at big_batch",
           "note": "the matmul kernel (v [m, K], w [N, K]) jitted; bf16: the dequantized "
                   "weight; fp8: values + block scales; floor: fp8 values + scales / the copy "
                   "bandwidth", "results": {}}
    rng = np.random.default_rng(59)
    for name, (n, k) in shapes.items():
        w8 = fp8.quantize_blocks(rng.standard_normal((n, k), np.float32) * k ** -0.5, block)
        w16 = w8.dequantize()
        for m in (1, p.big_batch):
            v = jnp.asarray(rng.standard_normal((m, k), np.float32))
            res = compare_forms({"bf16": lambda v=v, w=w16: gemm(v, w),
                                 "fp8": lambda v=v, w=w8: gemm(v, w)}, p, "bf16", "fp8")
            res["same_bits"] = bool((np.asarray(gemm(v, w8)) == np.asarray(gemm(v, w16)))
                                    .all())
            res["fp8_bytes_floor_us"] = w8.nbytes / (suite.ceil.copy_GBps * 1e3)
            res["fp8_over_floor_kernel"] = ratio(res["fp8_kernel_us"],
                                                 res["fp8_bytes_floor_us"])
            out["results"][f"{name}-{n}x{k}-m{m}"] = res
    return out


def run(suite) -> None:
    out: dict = {"note": "fp8: DsaConfig(param_dtype='float8_e4m3fn') over the checkpoint's "
                         "blocks; bf16: the same checkpoint dequantized at load. The suite's "
                         "points and measuring functions, the config and weights swapped",
                 "points": {}}
    suite.result["fp8_weights"] = out
    if not suite.impls:
        out["skipped"] = "no implementation to run"
        return
    cfgs = {side: side_config(suite, side) for side in SIDES}
    hf = checkpoint(suite, cfgs["fp8"].weight_block)
    weights = {side: jax.block_until_ready(fold_weights(cfgs[side], hf)) for side in SIDES}
    out["weight_bytes_per_layer"] = {side: param_bytes(weights[side]) for side in SIDES}
    out["weight_bytes_fp8_over_bf16"] = ratio(*[param_bytes(weights[s]) for s in ("fp8", "bf16")])
    out["same_outputs"] = suite.guarded("fp8 same outputs",
                                        lambda: {"equal": same_outputs(suite, cfgs, weights)})
    out["gemms"] = suite.guarded("fp8 gemms",
                                 lambda: weight_gemms(suite, cfgs["fp8"].weight_block))
    suite.save()
    points = {pt.name: pt for pt in suite.points}
    stacked = {}
    for name in point_names(suite.plan):
        if suite.late() or name not in points:
            out["points"][name] = {"skipped": "over the time budget" if name in points
                                   else "not a point of this plan"}
            continue
        pt = points[name]
        if pt.kind == "step":
            pt = dataclasses.replace(pt, kernel_time=True)
        res = out["points"][name] = {}
        for side in SIDES:
            try:
                if pt.kind == "loop" and side not in stacked:
                    stacked[side] = loop_weights(suite, cfgs[side])
                with swapped(suite, cfgs[side], weights[side], stacked.get(side)):
                    measured = measures.MEASURES.get(pt.kind, loop.MEASURES.get(pt.kind))(
                        suite, pt)
                t = next(iter(measured["timings"].values()), None) or {}
                res[side] = {k: t.get(k) for k in TIMES + ("error",) if t.get(k) is not None}
            except Exception as e:
                log(f"[bench] fp8 {name} {side} failed: {type(e).__name__}: {str(e)[:300]}")
                res[side] = {"error": err_text(e)}
        for k in TIMES:
            a, b = (res.get(s, {}).get(k) for s in ("fp8", "bf16"))
            if a is not None and b is not None:
                res[f"fp8_over_bf16_{k}"] = ratio(a, b)
        suite.save()
    s = suite.plan.prefill_tokens
    for key, b, prompt in (("decode-b1", 1, 0), (f"decode-b{suite.plan.big_batch}",
                                                  suite.plan.big_batch, 0), (f"prefill-{s}", 1, s)):
        if suite.late():
            break
        out[f"{key}-kernels"] = {side: suite.guarded(
            f"fp8 kernels {key} {side}", lambda side=side, b=b, prompt=prompt:
            kernels_by_name(suite, cfgs[side], weights[side], b, prompt)) for side in SIDES}
        suite.save()
