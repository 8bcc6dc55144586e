"""H200: what `dsa_jax.BITWISE_OPTIONS` (XLA's GEMM split-K forced to 1) costs, and that it is
what makes a batched prefill select what each sequence alone selects.

    PYTHONPATH=. python3 benchmarks/h200_bits.py --out $OUT/h200-bits.json
    PYTHONPATH=. python3 benchmarks/h200_bits.py --smoke --out /tmp/bits.json   (CPU, seconds)

1. Cost: the bench's step points (decode B=1 and B=64, the K=3 verify at B=1, a 9000-token
   prefill; GLM-5.3-Flash shapes, 16K context, pallas) timed with the step jitted plainly and
   with `bitwise_jit`, alternated twice in this one process: wall median of back-to-back calls
   (as the bench times them) and device kernel time from a profile.
2. Control: two sequences' 128-row prefill chunks in one program against each alone, with a
   plain and a bitwise jit of the same step: the rows whose selection differs
   (tests/test_bitwise.py asserts 0 for the library's programs).
3. Scan: 8 layers scanned against the unrolled stack at 64 sequences x 16K (`scan_check`).
Each part and variant is selectable (`--parts`, `--variants`); a candidate beside the library's
options (`CANDIDATES`) is timed and checked like them.
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from benchmarks.harness import machine_info, measure, profile_step
from benchmarks.schema import write_json
from benchmarks.workloads import StepRunner, random_hf_tensors, random_weights
from dsa_jax import bitwise_jit, layer
from dsa_jax.shapes import ODD, glm53_flash
from dsa_jax.testing import copy_tree, random_rows
from dsa_jax.testing import random_state as prefilled_state

# Candidate compile options beside the library's: XLA's GEMM autotuning off (each GEMM's
# algorithm then follows its shape by heuristic, not by a timing taken per program).
CANDIDATES = {"bitwise+autotune0": {"xla_gpu_autotune_level": 0}}
STEP_KW = dict(static_argnames=("cfg",), donate_argnames=("state",))
JITS = {
    "plain": jax.jit(layer.step, **STEP_KW),
    "bitwise": bitwise_jit(layer.step, **STEP_KW),
    **{k: bitwise_jit(layer.step, compiler_options=v, **STEP_KW) for k, v in CANDIDATES.items()},
}


def points(cfg, smoke: bool) -> dict:
    """name -> (sequences, new rows per sequence, padded rows, start context)."""
    ctx = 64 if smoke else 16384
    pre = 40 if smoke else 9000
    return {"decode-b1-k1": (1, 1, cfg.max_verify, ctx - 8),
            "decode-b64-k1": (4 if smoke else 64, 1, cfg.max_verify, ctx - 8),
            "verify-b1-k3": (1, 3, cfg.max_verify, ctx - 24),
            f"prefill-{pre}": (1, pre, pre, 0)}


def cost(cfg, weights, smoke: bool, rounds: int, variants) -> dict:
    out: dict = {}
    for rnd in range(rounds):
        for name, (b, k, rows, start) in points(cfg, smoke).items():
            for jit_name in variants:
                step = JITS[jit_name]
                runner = StepRunner(cfg, weights, b, k, rows, start, 17 + b + k, step=step)
                jax.block_until_ready(runner())  # compile + one step
                prefill = k == rows
                t = measure(runner, warmup=1, groups=5 if prefill else 20,
                            inner=1 if prefill else 10, reset=runner.reset)
                prof = profile_step(runner, 3 if prefill else 8, top=8)
                row = out.setdefault(name, {}).setdefault(jit_name, [])
                row.append({"round": rnd, "median_us": t["median_us"], "p10_us": t["p10_us"],
                            "p90_us": t["p90_us"],
                            "kernel_us": prof.get("kernel_us_per_step"),
                            "top_kernels": prof.get("top_kernels")})
                print(f"{name:16s} {jit_name:8s} round {rnd}: wall {t['median_us']:9.1f} us, "
                      f"kernels {prof.get('kernel_us_per_step') or 0:9.1f} us", flush=True)
    return out


def control(smoke: bool, variants) -> dict:
    """Rows of a 2-sequence prefill chunk whose selection differs from each sequence alone."""
    cfg = (ODD if smoke else glm53_flash(max_context=4096)).replace(
        implementation="xla" if smoke else "pallas")
    weights = jax.block_until_ready(dsa_jax.init_random_weights(cfg, jax.random.key(5)))
    prompt, chunk = (20, 8) if smoke else (1531, 128)
    base = prefilled_state(cfg, weights, 2, prompt, 7, kv_scale=1 / 64, dtype=jnp.bfloat16)
    x = random_rows(8, 2, chunk, cfg.hidden_size, dtype=jnp.bfloat16)  # [2, chunk, D]
    n2 = jnp.full((2,), chunk, jnp.int32)
    n1 = jnp.full((1,), chunk, jnp.int32)
    per_seq = ("block_tables", "index_k", "index_g", "pool_keys", "lengths", "index_lengths")
    out = {}
    for jit_name in variants:
        step = JITS[jit_name]
        _, both, sel = step(cfg, weights, copy_tree(base), x, n2, None)
        differ, keys_differ = 0, 0
        for s in range(2):
            one = copy_tree(base)
            one = one._replace(**{n: getattr(one, n)[s:s + 1] for n in per_seq})
            _, alone, sel_s = step(cfg, weights, one, x[s:s + 1], n1, None)
            differ += int((np.asarray(sel[s]) != np.asarray(sel_s[0])).any(-1).sum())
            keys_differ += int((np.asarray(both.pool_keys[s]) != np.asarray(alone.pool_keys[0]))
                               .any(-1).sum())
        out[jit_name] = {"rows": 2 * chunk, "sel_rows_differing": differ,
                         "pool_keys_differing": keys_differ}
        print(f"control {jit_name}: {out[jit_name]}", flush=True)
    return out


def scan_check(b: int, smoke: bool, variants) -> dict:
    """One decode forward of 8 GLM-5.3-Flash layers (full/shared alternating, 16K context,
    caches random up to the context) at `b` sequences: the scanned model against its
    unrolled stack, each pair compiled under one variant's options; logits, selections and
    every cache leaf compared bit for bit (the first differing layer's latent named)."""
    from benchmarks.loop_checks import bits_equal, model, random_serving
    from dsa_jax import serve
    from dsa_jax.model import forward, forward_unrolled, unfold_state
    from dsa_jax.shapes import tiny

    cfg = (tiny(implementation="xla", max_context=64, indexer_types=("full", "shared"))
           if smoke else glm53_flash(implementation="pallas",
                                     indexer_types=("full", "shared") * 4))
    mcfg, weights, stacked = model(cfg, 256, 21)
    out = {}
    for name in variants:
        opts = {**dsa_jax.BITWISE_OPTIONS, **CANDIDATES.get(name, {})}
        kw = dict(static_argnums=0, donate_argnums=2, compiler_options=opts)
        ms = random_serving(serve.Program(mcfg), b, cfg.max_context - 8, jax.random.key(3)).model
        states = tuple(unfold_state(mcfg, copy_tree(ms)))
        tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, (b, cfg.max_verify)),
                             jnp.int32)
        one = jnp.ones((b,), jnp.int32)
        la, ms2, sa = jax.jit(forward, **kw)(mcfg, stacked, ms, tokens, one)
        lu, st2, su = jax.jit(forward_unrolled, **kw)(mcfg, weights, states, tokens, one)
        layers = [bool(bits_equal(a, u)) for a, u in zip(unfold_state(mcfg, ms2), st2,
                                                          strict=True)]
        out[name] = {"batch": b, "logits_equal": bool(bits_equal(la, lu)),
                     "sel_equal": bool(bits_equal(sa, su)), "layers_equal": layers,
                     "logits_max_abs_diff": float(jnp.max(jnp.abs(la - lu)))}
        print(f"scan b={b} {name}: {out[name]}", flush=True)
        del ms2, st2
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="h200-bits.json")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--parts", default="control,scan,cost")
    p.add_argument("--scan-batch", type=int, default=64)
    p.add_argument("--variants", default=",".join(JITS), help="cost and control variants")
    args = p.parse_args(argv)
    parts, variants = args.parts.split(","), args.variants.split(",")
    res = {"command": "PYTHONPATH=. python3 benchmarks/h200_bits.py " + " ".join(argv or []),
           "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "machine": machine_info()}
    if "control" in parts:
        res["control"] = control(args.smoke, variants)
        write_json(args.out, res)
    if "scan" in parts:
        res["scan"] = scan_check(2 if args.smoke else args.scan_batch, args.smoke,
                                 [v for v in variants if v != "plain"])
        write_json(args.out, res)
    if "cost" in parts:
        cfg = (ODD.replace(max_context=64, max_verify=4) if args.smoke else glm53_flash()
               ).replace(implementation="xla" if args.smoke else "pallas")
        weights = random_weights(cfg, random_hf_tensors(cfg, 0), 1)
        res["cost"] = cost(cfg, weights, args.smoke, 1 if args.smoke else args.rounds,
                           variants)
        write_json(args.out, res)
    print(json.dumps({k: res.get(k) for k in ("control", "scan")}))


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
