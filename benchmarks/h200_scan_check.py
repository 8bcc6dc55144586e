"""H200: where the scanned model and its unrolled reference differ in bits, and which candidate
fix makes them equal, side by side in one call.

    PYTHONPATH=. python3 benchmarks/h200_scan_check.py --out benchmarks/results/h200-scan-check.json
    PYTHONPATH=. python3 benchmarks/h200_scan_check.py --smoke --out /tmp/scan-check.json  (CPU)

Models: the tiny config (4 layers, full/shared) and GLM-5.3-Flash block shapes (8 layers
alternating, 1K context), implementations "pallas" and "xla"; caches filled with random values
to about half the context, then a few ragged decode/verify-shaped steps (`max_verify` rows).
Each candidate pairs a scanned program with a reference program:
- repeat: the scanned program run twice on the same inputs (is it deterministic at all?);
- plain: `forward` vs `forward_unrolled`, both with `layer_barrier=False` (the old programs);
- barrier: both with `layer_barrier=True` (a fusion boundary where each layer starts);
- per_layer_jit: `forward` (barrier) vs a Python loop over ONE jitted layer function (norm,
  `layer.step`, residual add) per layer kind;
- barrier+autotune0 / plain+autotune0: compiled with `xla_gpu_autotune_level=0` (no GEMM or
  fusion autotuning: the default algorithm, the same in any context);
- barrier+no_triton_gemm: `xla_gpu_enable_triton_gemm=False` (GEMMs go to cuBLAS);
- barrier+splitk1: every Triton GEMM without split-K (`xla_gpu_experimental_force_split_k`;
  XLA otherwise picks the split per program, and with it the summation order);
- barrier+dsfusion(+cublas): XLA's dynamic-slice fusion (and cuBLAS GEMMs), the loop
  program's candidate options (benchmarks/h200_loop.py): do they keep scanned == unrolled?
Candidates that change the Pallas path's jnp glue (both programs traced under the same change,
`layer_barrier=True`, reference unrolled), to find which glue's fusion depends on the program:
- ops_barrier: an optimization barrier on every hot-path op's array inputs and outputs (each
  kernel call and its own glue an island);
- merge_barrier: barriers around the gather-attend's split merge (`merge_splits`: inputs and
  output), so XLA fuses it alone, the same in any program;
- merge_pallas: the split merge as a small Pallas Triton kernel (a fixed reduction order);
- no_splits: the Mosaic attend with one split per row (no merge arithmetic at all);
- q_in_kernel: the Mosaic kernel scales and converts q itself (no jnp conversion before it).
For the first step where a pair differs: every differing leaf (logits, the first layer's `sel`,
each layer's latent cache, each full layer's indexer rows and pool keys) with its count and max
abs/rel difference; `first_layer` is the first layer whose cache differs, i.e. the first layer
whose input rows (or its own projections) differ. A candidate whose compiler options are
refused records the error. The JSON is written after every candidate; the table prints last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax.attend
import dsa_jax.indexer
import dsa_jax.select
from benchmarks.device_script import header, json_parser, write_json
from benchmarks.workloads import random_caches
from dsa_jax.layer import step
from dsa_jax.model import (
    ModelConfig,
    ModelState,
    forward,
    forward_unrolled,
    init_model,
    init_model_state,
    lm_head,
    stack_weights,
    unfold_state,
)
from dsa_jax.pallas import sparse_attend as attend_mod
from dsa_jax.pallas import sparse_attend_mgpu as mgpu_mod
from dsa_jax.pallas.merge_splits import merge_splits_pallas
from dsa_jax.projection import rms_norm
from dsa_jax.shapes import glm53_flash, tiny

AUTOTUNE0 = {"xla_gpu_autotune_level": 0}
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}
# The loop program's candidate options (benchmarks/h200_loop.py LOOP_VARIANTS): the stacked
# weights' slices read in place by the GEMMs instead of copied.
DSFUSION = {"xla_gpu_enable_dynamic_slice_fusion": True}
# XLA picks each Triton GEMM's split-K per program (benchmarks/notes.md, #16): force one.
SPLITK1 = {"xla_gpu_experimental_force_split_k": 1}
# name -> (scanned layer_barrier, reference: "unrolled" | "per_layer_jit" | "repeat", options,
#          glue patch name or None)
CANDIDATES = {
    "repeat": (True, "repeat", None, None),
    "plain": (False, "unrolled", None, None),
    "barrier": (True, "unrolled", None, None),
    "per_layer_jit": (True, "per_layer_jit", None, None),
    "barrier+autotune0": (True, "unrolled", AUTOTUNE0, None),
    "plain+autotune0": (False, "unrolled", AUTOTUNE0, None),
    "barrier+no_triton_gemm": (True, "unrolled", NO_TRITON_GEMM, None),
    "barrier+splitk1": (True, "unrolled", SPLITK1, None),
    "barrier+dsfusion": (True, "unrolled", DSFUSION, None),
    "barrier+dsfusion+cublas": (True, "unrolled", {**DSFUSION, **NO_TRITON_GEMM}, None),
    "barrier+dsfusion+cublas+autotune0": (True, "unrolled",
                                          {**DSFUSION, **NO_TRITON_GEMM, **AUTOTUNE0}, None),
    "ops_barrier": (True, "unrolled", None, "ops_barrier"),
    "merge_barrier": (True, "unrolled", None, "merge_barrier"),
    "merge_pallas": (True, "unrolled", None, "merge_pallas"),
    "no_splits": (True, "unrolled", None, "no_splits"),
    "q_in_kernel": (True, "unrolled", None, "q_in_kernel"),
}
# The glue candidates again under split-K 1 (the library's BITWISE_OPTIONS).
CANDIDATES.update({f"{k}+splitk1": (v[0], v[1], SPLITK1, v[3]) for k, v in list(CANDIDATES.items())
                   if v[3] is not None})
# Any candidate but per_layer_jit with "+hidden": both programs also return every layer's
# input rows, compared per layer (f32: a difference shows there long before it reaches the
# fp8 / bf16 caches); the extra output changes both programs.
HIDDEN = "+hidden"
STATE_LEAVES = ("latent", "index_k", "index_g", "pool_keys", "lengths")


def candidate(name: str) -> tuple[tuple, bool]:
    """name -> (its CANDIDATES entry, hidden)."""
    hidden = name.endswith(HIDDEN)
    return CANDIDATES[name[:-len(HIDDEN)] if hidden else name], hidden


def candidate_names() -> list[str]:
    return list(CANDIDATES) + [k + HIDDEN for k, v in CANDIDATES.items()
                               if v[1] != "per_layer_jit"]


def _barrier_arrays(tree):
    """An optimization barrier on the array leaves of `tree` (other leaves pass as they are)."""
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, v in enumerate(leaves) if isinstance(v, jax.Array)]
    fenced = jax.lax.optimization_barrier([leaves[i] for i in idx])
    for i, v in zip(idx, fenced, strict=True):
        leaves[i] = v
    return jax.tree.unflatten(treedef, leaves)


def _fenced_op(op):
    """`op` whose reference and kernel see their array arguments and results behind
    barriers."""
    def wrap(fn):
        def run(*args, **kwargs):
            return _barrier_arrays(fn(*_barrier_arrays(args), **kwargs))
        return run
    return dataclasses.replace(op, reference=wrap(op.reference), kernel=wrap(op.kernel))


@contextlib.contextmanager
def _patched(targets):
    """Set (module, name) -> value for the duration; restore after."""
    saved = [(mod, name, getattr(mod, name)) for (mod, name) in targets]
    try:
        for (mod, name), value in targets.items():
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def glue_patch(name: str | None):
    """The context in which a candidate's programs are traced (module docstring)."""
    if name is None:
        return contextlib.nullcontext()
    if name == "ops_barrier":
        return _patched({(mod, op): _fenced_op(getattr(mod, op)) for mod, op in (
            (dsa_jax.attend, "sparse_attend_op"), (dsa_jax.attend, "latent_write_op"),
            (dsa_jax.indexer, "index_write_op"), (dsa_jax.indexer, "pool_scores_op"),
            (dsa_jax.select, "pool_topk_op"))})
    if name == "merge_barrier":
        merge = attend_mod.merge_splits
        return _patched({(attend_mod, "merge_splits"): lambda o, m, l: jax.lax.
                         optimization_barrier(merge(*jax.lax.optimization_barrier((o, m, l))))})
    if name == "merge_pallas":
        return _patched({(attend_mod, "merge_splits"): merge_splits_pallas})
    if name == "no_splits":
        return _patched({(mgpu_mod, "num_splits"): lambda *a, **k: 1})
    if name == "q_in_kernel":
        op = dsa_jax.attend.sparse_attend_op
        tuning = attend_mod.AttendTuning(mosaic=mgpu_mod.MgpuTuning(q_in_kernel=True))

        def kernel(*args, **kwargs):
            return attend_mod.sparse_attend_pallas(*args, tuning=tuning, **kwargs)
        return _patched({(dsa_jax.attend, "sparse_attend_op"):
                         dataclasses.replace(op, kernel=kernel)})
    raise ValueError(f"unknown glue patch {name!r}")


def compiled(fn, opts, *args):
    """`fn(*args)` jitted, lowered and compiled with XLA `opts` (None: the defaults)."""
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile(compiler_options=opts) if opts else lowered.compile()


def per_layer_reference(mcfg: ModelConfig):
    """The model as a Python loop over one jitted function per layer kind."""
    cfg = mcfg.dsa

    @jax.jit
    def layer_fn(norm, lw, st, h, n_new, shared):
        y, st, sel = step(cfg, lw, st, rms_norm(h, norm, cfg.rms_norm_eps), n_new, shared)
        return h + y, st, sel  # h: [B, R, D]

    head = jax.jit(lambda fin, w, h: lm_head(mcfg, fin, w, h))

    def run(weights, states, tokens, n_new):
        h = weights.embed[tokens]  # [B, R, D]
        out, sel, sel0 = [], None, None
        for i, (lw, st) in enumerate(zip(weights.layers, states, strict=True)):
            h, st, sel = layer_fn(weights.norms[i], lw, st, h, n_new,
                                  None if lw.has_indexer else sel)
            sel0 = sel if sel0 is None else sel0
            out.append(st)
        return head(weights.final_norm, weights.lm_head, h), tuple(out), sel0
    return run


def leaf_diff(a, b) -> dict | None:
    """None when `a` and `b` are the same bits; else how they differ."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"mismatch": f"{a.shape} {a.dtype} vs {b.shape} {b.dtype}"}
    if a.tobytes() == b.tobytes():
        return None
    if a.dtype.kind in "iub":
        ne = a != b
        return {"n_diff": int(ne.sum()), "of": int(a.size),
                "first_index": [int(i) for i in np.argwhere(ne)[0]]}
    af, bf = a.astype(np.float64), b.astype(np.float64)
    ne = a.view(np.uint8).reshape(*a.shape, -1) != b.view(np.uint8).reshape(*b.shape, -1)
    ne = ne.any(axis=-1)  # bitwise, so +0/-0 and NaN payloads count
    d = np.abs(af - bf)[ne]
    rel = d / np.maximum(np.abs(bf[ne]), np.finfo(np.float32).tiny)
    finite = np.isfinite(d)
    return {"n_diff": int(ne.sum()), "of": int(a.size),
            "max_abs": float(d[finite].max()) if finite.any() else None,
            "max_rel": float(rel[finite].max()) if finite.any() else None,
            "nonfinite": int((~finite).sum()),
            "first_index": [int(i) for i in np.argwhere(ne)[0]]}


def compare(mcfg, got, want) -> dict | None:
    """got: (logits, ModelState or states, sel0); want likewise. None when equal bitwise."""
    def layers(states):
        return unfold_state(mcfg, states) if isinstance(states, ModelState) else states
    out = {}
    for name, a, b in (("logits", got[0], want[0]), ("sel0", got[2], want[2])):
        if (d := leaf_diff(a, b)) is not None:
            out[name] = d
    per_layer = {}
    for l, (sa, sb) in enumerate(zip(layers(got[1]), layers(want[1]), strict=True)):
        ds = {f: d for f in STATE_LEAVES
              if (d := leaf_diff(getattr(sa, f), getattr(sb, f))) is not None}
        if ds:
            per_layer[str(l)] = ds
    if per_layer:
        out["layers"] = per_layer
        out["first_layer"] = min(int(k) for k in per_layer)
    if len(got) > 3:  # every layer's input rows [L, B, R, D]
        hs = {str(l): d for l in range(got[3].shape[0])
              if (d := leaf_diff(got[3][l], want[3][l])) is not None}
        if hs:
            out["hidden"] = hs
            # The first layer whose output differs (its successor's input rows).
            out["first_hidden_layer"] = min(int(k) for k in hs) - 1
    if not out:
        return None
    out["sel0_equal"] = "sel0" not in out
    return out


def setup(cfg, vocab: int, b: int = 2, seed: int = 0):
    """Model, stacked weights, and a model state with random caches at about half the context
    (its per-layer form is `unfold_state` of it)."""
    mcfg = ModelConfig(cfg, vocab_size=vocab)
    weights = init_model(mcfg, jax.random.key(seed))
    nb, mb = b * cfg.blocks_per_seq, cfg.blocks_per_seq
    rng = np.random.default_rng(seed)
    # One shuffled pool split between the sequences: no physical block mapped twice.
    tables = rng.permutation(nb)[:b * mb].reshape(b, mb).astype(np.int32)
    ms = init_model_state(mcfg, b, nb, tables)
    k = jax.random.split(jax.random.key(seed + 1), 4)
    ctx = cfg.max_context // 2
    ms = random_caches(ms, k)._replace(
        lengths=jnp.asarray(ctx - 3 * (np.arange(b) % 2), jnp.int32))
    return mcfg, weights, stack_weights(mcfg, weights), ms


def run_candidate(cfg, vocab: int, name: str, steps: int, b: int = 2) -> dict:
    with glue_patch(candidate(name)[0][3]):
        return _run_candidate(cfg, vocab, name, steps, b)


def _run_candidate(cfg, vocab: int, name: str, steps: int, b: int) -> dict:
    (barrier, ref_kind, opts, _), hidden = candidate(name)
    mcfg, weights, stacked, ms = setup(cfg, vocab, b)
    r, b = cfg.max_verify, ms.num_seqs
    rng = np.random.default_rng(7)
    n_news = [[r, r - 1], [1, r], [r - 1, 0], [1, 1], [r, 2]][:steps]
    tokens0 = jnp.zeros((b, r), jnp.int32)
    n0 = jnp.ones((b,), jnp.int32)
    t0 = time.perf_counter()
    scan = compiled(lambda w, s, t, n: forward(mcfg, w, s, t, n, layer_barrier=barrier,
                                               hidden=hidden),
                    opts, stacked, ms, tokens0, n0)
    states = tuple(unfold_state(mcfg, ms))
    if ref_kind == "unrolled":
        ref = compiled(lambda w, s, t, n: forward_unrolled(mcfg, w, s, t, n,
                                                           layer_barrier=barrier,
                                                           hidden=hidden),
                       opts, weights, states, tokens0, n0)
    elif ref_kind == "per_layer_jit":
        ref = per_layer_reference(mcfg)
    res = {"compile_s": time.perf_counter() - t0, "equal": True, "steps": len(n_news)}
    ref_state = ms if ref_kind == "repeat" else states
    for i, n_new in enumerate(n_news):
        tokens = jnp.asarray(rng.integers(0, vocab, (b, r)), jnp.int32)
        n = jnp.asarray(np.resize(n_new, b), jnp.int32)
        got = scan(stacked, ms, tokens, n)
        want = (scan(stacked, ref_state, tokens, n) if ref_kind == "repeat"
                else ref(weights, ref_state, tokens, n))
        d = compare(mcfg, got, want)
        if d is not None:
            res.update(equal=False, first_step=i, n_new=n_new, diff=d)
            break
        ms, ref_state = got[1], want[1]
    # The scanned program's step time (same state each call: no donation).
    jax.block_until_ready(scan(stacked, ms, tokens, n))
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(scan(stacked, ms, tokens, n))
        ts.append((time.perf_counter() - t) * 1e6)
    res["scan_step_us"] = float(np.median(ts))
    return res


def configs(smoke: bool, impls) -> dict:
    if smoke:
        return {"tiny-xla": tiny(implementation="xla", max_context=64,
                                 indexer_types=("full", "shared") * 2)}
    out = {}
    for impl in impls:
        out[f"tiny-{impl}"] = tiny(implementation=impl, indexer_types=("full", "shared") * 2)
        out[f"glm8-ctx1024-{impl}"] = glm53_flash(implementation=impl, max_context=1024,
                                                  indexer_types=("full", "shared") * 4)
        # 64 sequences at 16K (the loop-b64-l8 shape): run with --configs glm8b64
        out[f"glm8b64-ctx16384-{impl}"] = glm53_flash(implementation=impl,
                                                      indexer_types=("full", "shared") * 4)
    return out


def short(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:60]
    if r["equal"]:
        return f"equal ({r['steps']} steps, scan {r['scan_step_us']:.0f} us)"
    d = r["diff"]
    worst = max((v.get("max_abs") or 0.0 for v in [d.get("logits", {})]
                 + [x for lay in d.get("layers", {}).values() for x in lay.values()]),
                default=0.0)
    hid = (f" first hidden diff after layer {d['first_hidden_layer']}"
           if "first_hidden_layer" in d else "")
    return (f"DIFF step {r['first_step']} layer {d.get('first_layer')}{hid} "
            f"sel0={'eq' if d['sel0_equal'] else 'DIFF'} max_abs={worst:.3g}")


def table(res: dict) -> str:
    lines = [f"scan-vs-reference bit checks ({res['backend']}, jax {res['jax_version']})"]
    for cfg_name, cands in res["results"].items():
        lines.append(f"{cfg_name}")
        lines += [f"  {name:<24}{short(r)}" for name, r in cands.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = json_parser(__doc__)
    ap.add_argument("--impls", nargs="*", default=["pallas", "xla"])
    ap.add_argument("--candidates", nargs="*", choices=candidate_names(),
                    default=list(CANDIDATES))
    ap.add_argument("--configs", nargs="*", choices=("tiny", "glm8", "glm8b64"),
                    default=["tiny", "glm8"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    args = ap.parse_args(argv)
    res = {**header("h200_scan_check.py", argv),
           "candidates": {k: {"layer_barrier": v[0], "reference": v[1], "options": v[2],
                              "glue": v[3]}
                          for k, v in CANDIDATES.items()},
           "results": {}}
    for cfg_name, cfg in configs(args.smoke, args.impls).items():
        if not args.smoke and cfg_name.split("-")[0] not in args.configs:
            continue
        for name in args.candidates:
            try:
                r = run_candidate(cfg, 64 if args.smoke else args.vocab, name, args.steps,
                                  64 if cfg_name.startswith("glm8b64") else 2)
            except Exception as e:  # recorded (a refused compiler option); the rest still run
                r = {"error": f"{type(e).__name__}: {e}"[:500]}
            res["results"].setdefault(cfg_name, {})[name] = r
            write_json(res, args.out)
    print(table(res))
    ok = all(r.get("equal") for c in res["results"].values()
             for n, r in c.items() if n in ("repeat", "barrier"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
