"""Where do the scanned model and the unrolled stack part? Every layer's intermediates, tapped.

`h200_scan_check.py` found the scanned model (`model.forward`) and the unrolled stack
(`model.forward_unrolled`) bitwise apart on the H200 at GLM shapes, from one layer's output on,
with that layer's inputs and caches equal. This script taps, in both programs, each layer's
input rows, projections (every GEMM and norm; q_abs, kv_raw, qi, k_raw, g, w), pool scores,
top pools, attend output and output projection through ordered host callbacks (the k-th value
of a tap is the k-th layer that computes it), and reports the first layer and the taps that
differ there. The taps change both programs (each tapped value is materialized), so the
untapped programs are compared as well: if they differ and the tapped ones do not, the
difference lives in a fusion that a tap breaks.

    PYTHONPATH=. python3 benchmarks/h200_scan_taps.py --out $OUT/taps.json [--configs glm8 glm8b64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.device_script import header, write_json
from benchmarks.h200_scan_check import configs, leaf_diff, setup
from dsa_jax import layer as layer_mod
from dsa_jax import model as model_mod
from dsa_jax import projection as proj_mod
from dsa_jax.bitwise import BITWISE_OPTIONS
from dsa_jax.model import forward, forward_unrolled, unfold_state

# The model's and layer.step's callees tapped (each returns arrays or a NamedTuple of them);
# inside the projections every GEMM and norm too. Only the layers call them.
TAPPED = ("project", "pool_scores", "top_pools", "attend", "output_projection")
PROJECTION_TAPPED = ("matmul", "rms_norm", "per_head")
_records: dict = {}


def _tap(name: str, fn, with_input: bool = False):
    """`fn` whose outputs (and with `with_input` its third argument, `project`'s rows) go to
    the host in execution order: the k-th value of a tap is the k-th layer that computes it
    (scanned and unrolled programs run their layers in the same order)."""
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        leaves = {f"{name}.{k}": v for k, v in
                  (out._asdict().items() if hasattr(out, "_asdict") else [("out", out)])
                  if v is not None}
        if with_input:
            leaves[f"{name}.x"] = args[2]

        def record(**vals):
            for k, v in vals.items():
                _records.setdefault(_records["__program__"], {}).setdefault(
                    k, []).append(np.asarray(v))
        jax.debug.callback(record, ordered=True, **leaves)
        return out
    return run


@contextlib.contextmanager
def tapped():
    """Tap the functions the scanned model's blocks and `layer.step` call (TAPPED) and the
    projections' GEMMs and norms."""
    mods = {m: {n: getattr(m, n) for n in TAPPED if hasattr(m, n)}
            for m in (model_mod, layer_mod)}
    mods[proj_mod] = {n: getattr(proj_mod, n) for n in PROJECTION_TAPPED}
    try:
        for m, fns in mods.items():
            for n, f in fns.items():
                setattr(m, n, _tap(n, f, with_input=n == "project"))
        yield
    finally:
        for m, fns in mods.items():
            for n, f in fns.items():
                setattr(m, n, f)


def _fence(f):
    def fenced(v, *args, _f=f):
        return lax.optimization_barrier(_f(lax.optimization_barrier(v), *args))
    return fenced


# name -> the functions fenced: each an island of its own (barriers on its input and output),
# so XLA cannot fuse it, or what feeds it, with anything program-dependent.
FENCES = {"none": (), "fenced_norm": ("rms_norm",), "fenced_gemm": ("matmul", "per_head"),
          "fenced_all": ("rms_norm", "matmul", "per_head")}


@contextlib.contextmanager
def candidate(name: str):
    """A change to both programs, to test a suspect (FENCES): the RMSNorms of the step (the
    layer's input norm, the q_a norm) and/or its GEMMs fenced."""
    mods = [m for m in (proj_mod, model_mod)]
    orig = {(m, n): getattr(m, n) for m in mods for n in FENCES[name] if hasattr(m, n)}
    try:
        for (m, n), f in orig.items():
            setattr(m, n, _fence(f))
        yield
    finally:
        for (m, n), f in orig.items():
            setattr(m, n, f)


CANDIDATES = tuple(FENCES)


def first_difference(got: dict, want: dict) -> dict | None:
    """got/want: tap -> [values in execution order, one per layer that computes it]. The taps
    apart at the first occurrence (layer order) with any."""
    diffs = []
    for k in sorted(set(got) & set(want)):
        for i, (a, b) in enumerate(zip(got[k], want[k], strict=False)):
            if (d := leaf_diff(a, b)) is not None:
                diffs.append({"tap": k, "occurrence": i, **d})
                break
    if not diffs:
        return None
    first = min(d["occurrence"] for d in diffs)
    return {"first_occurrence": first,
            "taps_apart_there": [d for d in diffs if d["occurrence"] == first],
            "later": sorted((d["tap"], d["occurrence"]) for d in diffs
                            if d["occurrence"] != first)[:40],
            "counts": {k: (len(got[k]), len(want.get(k, []))) for k in sorted(got)},
            "only_in_one": sorted(set(got) ^ set(want))[:20]}


def run(cfg, vocab: int, b: int, steps: int, cand: str = "none") -> dict:
    mcfg, weights, stacked, ms = setup(cfg, vocab, b)
    r = cfg.max_verify
    rng = np.random.default_rng(7)
    n_news = [[r, r - 1], [1, r], [r - 1, 0], [1, 1], [r, 2]][:steps]
    states = tuple(unfold_state(mcfg, ms))
    plain = {}
    tapped_out = {}
    for label, use_taps in (("plain", False), ("taps", True)):
        ctx = tapped() if use_taps else contextlib.nullcontext()
        with candidate(cand), ctx:
            scan = jax.jit(lambda w, s, t, n: forward(mcfg, w, s, t, n)).lower(
                stacked, ms, jnp.zeros((b, r), jnp.int32), jnp.ones((b,), jnp.int32)
            ).compile(compiler_options=BITWISE_OPTIONS)
            unrolled = jax.jit(lambda w, s, t, n: forward_unrolled(mcfg, w, s, t, n)).lower(
                weights, states, jnp.zeros((b, r), jnp.int32), jnp.ones((b,), jnp.int32)
            ).compile(compiler_options=BITWISE_OPTIONS)
        ms_a, st_u = ms, states
        rng = np.random.default_rng(7)
        outcome = {"equal_steps": 0}
        for i, n_new in enumerate(n_news):
            tokens = jnp.asarray(rng.integers(0, vocab, (b, r)), jnp.int32)
            n = jnp.asarray(np.resize(n_new, b), jnp.int32)
            _records.clear()
            _records["__program__"] = "scan"
            a = jax.block_until_ready(scan(stacked, ms_a, tokens, n))
            jax.effects_barrier()
            _records["__program__"] = "unrolled"
            u = jax.block_until_ready(unrolled(weights, st_u, tokens, n))
            jax.effects_barrier()
            d = leaf_diff(a[0], u[0])
            apart = [l for l, (sa, su) in enumerate(zip(unfold_state(mcfg, a[1]), u[1],
                                                        strict=True))
                     if any(leaf_diff(getattr(sa, f), getattr(su, f)) is not None
                            for f in ("latent", "index_k", "index_g", "pool_keys"))]
            if d is not None or apart:
                outcome.update(first_step=i, logits=d, cache_layers_apart=apart)
                if use_taps:
                    outcome["taps"] = first_difference(_records.get("scan", {}),
                                                       _records.get("unrolled", {}))
                    outcome["n_taps"] = len(_records.get("scan", {}))
                break
            outcome["equal_steps"] = i + 1
            if use_taps:  # the taps came back from both programs, for the same layers
                outcome["taps_per_program"] = {k: len(_records.get(k, {}))
                                               for k in ("scan", "unrolled")}
                outcome["tap_keys_equal"] = (set(_records.get("scan", {}))
                                             == set(_records.get("unrolled", {})))
            ms_a, st_u = a[1], u[1]
        (plain if label == "plain" else tapped_out).update(outcome)
    return {"plain": plain, "tapped": tapped_out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--configs", nargs="*", default=["glm8"], choices=("tiny", "glm8", "glm8b64"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--candidates", nargs="*", default=["none"], choices=CANDIDATES)
    args = ap.parse_args(argv)
    res = {**header("h200_scan_taps.py", argv, backend=False),
           "options": BITWISE_OPTIONS, "results": {}}
    for name, cfg in configs(args.smoke, ["pallas"] if not args.smoke else []).items():
        if not args.smoke and name.split("-")[0] not in args.configs:
            continue
        for cand in args.candidates:
            try:
                r = run(cfg, 64 if args.smoke else args.vocab,
                        64 if name.startswith("glm8b64") else 2, args.steps, cand)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"[:800]}
            res["results"].setdefault(name, {})[cand] = r
            print(name, cand, json.dumps(r, default=str)[:3000], flush=True)
            write_json(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
