"""`dsa-jax parity`: the implementations against their definitions, on this backend.

Three kinds of check, each a row of a pass/fail table:
- kernels: every op's implementation against its jnp definition (`dsa_jax/pallas/*_xla`);
- layer: `prefill` + `decode` through the paged cache against `dsa_jax.reference` (fp32);
- hf: the layer against Hugging Face `glm5_next` (when torch and transformers import).
On a GPU the kernels run compiled ("pallas"); elsewhere in interpret mode ("pallas-interpret").
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from dsa_jax import reference
from dsa_jax.implementation import pallas_kernels_present
from dsa_jax.pallas import index_write as index_op
from dsa_jax.pallas import latent_write as latent_op
from dsa_jax.pallas import pool_scores as pool_op
from dsa_jax.pallas import pool_topk as topk_op
from dsa_jax.pallas import sparse_attend as attend_op
from dsa_jax.shapes import ODD

LAYER_RTOL = 1e-4  # fp32 weights, fp32 caches: the foundation issue's bound
# fp32 operands, reductions over <= ~2K terms: |error| ~ sqrt(n) * 2^-24 relative, well under.
KERNEL_RTOL_FP32 = 1e-5
# bf16 dot operands (fp8 / bf16 caches): q is rounded to bf16 (2^-9 relative), so logits move
# by ~2^-9 * |logit| and outputs by a few 1e-3 relative.
KERNEL_RTOL_BF16 = 1e-2


class Check(NamedTuple):
    kind: str
    name: str
    implementation: str
    error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.error)) and self.error <= self.tolerance


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / denom) if denom > 0 else float(np.linalg.norm(a))


def kernel_implementations() -> list[str]:
    if not pallas_kernels_present():
        return []
    return ["pallas" if jax.default_backend() == "gpu" else "pallas-interpret"]


def kernel_checks(impl: str, seed: int = 0) -> list[Check]:
    interpret = impl == "pallas-interpret"
    keys = jax.random.split(jax.random.key(seed), 8)
    b, r, h, c, w, bs, nb = 2, 3, 5, 24, 37, 8, 12
    checks = []
    q = jax.random.normal(keys[0], (b, r, h, c))
    tables = jax.random.permutation(keys[1], nb)[: 2 * 6].reshape(2, 6).astype(jnp.int32)
    sel = jax.random.randint(keys[2], (b, r, w), -1, 6 * bs).astype(jnp.int32)
    sel = sel.at[0, 0].set(-1)  # one empty row: must give exactly 0
    for dtype in ("float32", "bfloat16", "float8_e4m3fn"):
        latent = (jax.random.normal(keys[3], (nb, bs, c)) * 4).astype(dtype)
        args = (q, latent, jnp.float32(0.5), tables, sel)
        want = attend_op.sparse_attend_xla(*args, softmax_scale=c ** -0.5)
        got = attend_op.sparse_attend_pallas(*args, softmax_scale=c ** -0.5,
                                             interpret=interpret)
        tol = KERNEL_RTOL_FP32 if dtype == "float32" else KERNEL_RTOL_BF16
        err = _rel(got, want) if bool(jnp.all(got[0, 0] == 0)) else float("inf")
        checks.append(Check("kernel", f"sparse_attend {dtype} (5 heads, 37 slots)", impl, err,
                            tol))
    hi, di, p = 3, 12, 29
    qi = jax.random.normal(keys[4], (b, r, hi, di))
    wts = jax.random.normal(keys[5], (b, r, hi))
    pool_keys = jax.random.normal(keys[6], (b, p, di))
    n_cand = jax.random.randint(keys[7], (b, r), 0, p + 1).astype(jnp.int32)
    want = pool_op.pool_scores_xla(qi, wts, pool_keys, n_cand)
    got = pool_op.pool_scores_pallas(qi, wts, pool_keys, n_cand, interpret=interpret)
    same_inf = bool(jnp.all(jnp.isinf(got) == jnp.isinf(want)))
    finite = jnp.isfinite(want)
    err = _rel(jnp.where(finite, got, 0), jnp.where(finite, want, 0)) if same_inf else np.inf
    checks.append(Check("kernel", "pool_scores (3 heads, 29 pools)", impl, err,
                        KERNEL_RTOL_FP32))
    # Top-k: ties (scores on a 1/4 grid), -inf past each row's candidates; error = how many
    # indices differ from lax.top_k (must be none).
    scores = jnp.round(jax.random.normal(keys[7], (b * r, 300)) * 4) / 4
    live = jnp.array([300, 200, 40, 37, 10, 0])[:, None]
    scores = jnp.where(jnp.arange(300)[None, :] < live, scores, -jnp.inf)
    want = topk_op.pool_topk_xla(scores, 37)
    got = topk_op.pool_topk_pallas(scores, 37, interpret=interpret)
    checks.append(Check("kernel", "pool_topk == lax.top_k (300 pools, k 37, ties)", impl,
                        float(jnp.sum(got != want)), 0.0))
    return checks + write_kernel_checks(impl, keys)


def _stored_err(got, want) -> float:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    return _rel(got, want)


def write_kernel_checks(impl: str, keys) -> list[Check]:
    """The cache writes: stored values within a rounding step of the cache dtype (a value on a
    rounding boundary may land on the neighbouring code), pool keys in fp32."""
    interpret = impl == "pallas-interpret"
    checks = []
    b, r, c, nb, bs, mb = 3, 4, 24, 14, 8, 4
    pos = (jnp.asarray([5, 13, 2])[:, None] + jnp.arange(r)).astype(jnp.int32)
    valid = jnp.arange(r)[None, :] < jnp.asarray([4, 3, 0])[:, None]
    kv_raw = jax.random.normal(keys[0], (b, r, c)) * 3
    tables = jax.random.permutation(keys[1], nb)[: b * mb].reshape(b, mb).astype(jnp.int32)
    for dtype, tol in (("float32", 1e-6), ("bfloat16", 2.0 ** -8), ("float8_e4m3fn", 2 ** -3)):
        cache = jnp.full((nb, bs, c), 300.0, dtype)
        args = (kv_raw, 1 + 0.3 * kv_raw[0, 0], cache, jnp.float32(0.02), tables, pos, valid)
        want = latent_op.latent_write_xla(*args, eps=1e-5)
        got = latent_op.latent_write_pallas(*args, eps=1e-5, interpret=interpret)
        checks.append(Check("kernel", f"latent_write {dtype}", impl, _stored_err(got, want),
                            tol))
    di, tmax, kp = 12, 24, 4
    args = (jax.random.normal(keys[2], (b, r, di)), jax.random.normal(keys[3], (b, r, di)),
            1 + 0.3 * jax.random.normal(keys[4], (di,)), 0.3 * jax.random.normal(keys[5], (di,)),
            0.5 * jax.random.normal(keys[6], (kp, di)),
            jax.random.normal(keys[7], (b, tmax, di)).astype(jnp.bfloat16),
            jax.random.normal(keys[0], (b, tmax, di)).astype(jnp.bfloat16),
            jnp.zeros((b, tmax // kp, di), jnp.float32), pos, valid)
    want = index_op.index_write_xla(*args)
    got = index_op.index_write_pallas(*args, interpret=interpret)
    checks.append(Check("kernel", "index_write k, g (bf16 cache)", impl,
                        max(_stored_err(got[0], want[0]), _stored_err(got[1], want[1])),
                        2.0 ** -8))
    checks.append(Check("kernel", "index_write pool keys (KP 4)", impl,
                        _rel(got[2], want[2]), KERNEL_RTOL_FP32))
    return checks


def _paged_run(cfg, weights, x, prompt_len):
    state = dsa_jax.init_state(cfg, x.shape[0])
    y0, state, s0 = dsa_jax.prefill(cfg, weights, state, x[:, :prompt_len])
    ys, sels = [y0], [s0]
    for t in range(prompt_len, x.shape[1]):
        y, state, s = dsa_jax.decode(cfg, weights, state, x[:, t])
        ys.append(y[:, None])
        sels.append(s[:, None])
    return np.concatenate(ys, 1), np.concatenate(sels, 1)


def layer_checks(impl: str, seed: int = 0) -> list[Check]:
    cfg = ODD.replace(implementation=impl)
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(seed))
    weights = dsa_jax.fold_weights(cfg, hf)
    x = jax.random.normal(jax.random.key(seed + 1), (2, 50, cfg.hidden_size))
    y, sel = _paged_run(cfg, weights, x, 30)
    err, sel_ok = 0.0, True
    for s in range(2):
        ref = reference.forward(cfg, hf, x[s])
        err = max(err, _rel(y[s], ref.y))
        sel_ok &= bool(np.array_equal(sel[s], np.asarray(ref.sel)))
    return [Check("layer", "paged prefill+decode vs fp32 reference (y)", impl, err, LAYER_RTOL),
            Check("layer", "paged selection == reference selection (slots)", impl,
                  0.0 if sel_ok else 1.0, 0.0)]


def hf_checks(impl: str, seed: int = 100) -> list[Check]:
    from dsa_jax import hf_oracle as oracle

    config = oracle.make_config(index_topk=16, index_kpool=4)
    checks = []
    with tempfile.TemporaryDirectory() as folder:
        for attempt in range(20):  # a draw with no score tie at a top-k boundary
            layers = oracle.make_attention_layers(config, seed + attempt)
            path = oracle.save_checkpoint(config, layers, folder)
            cfg = dsa_jax.DsaConfig.from_hf_config(
                os.path.join(folder, "config.json"), max_context=96, block_size=8,
                cache_dtype="float32", index_cache_dtype="float32", param_dtype="float32",
                implementation=impl)
            x = np.asarray(jax.random.normal(jax.random.key(seed + attempt),
                                             (2, 70, cfg.hidden_size)))
            tensors = dsa_jax.read_hf_tensors(path, cfg, 0)
            refs = [reference.forward(cfg, tensors, x[s]) for s in range(2)]
            if min(oracle.boundary_gaps(np.asarray(r.pool_scores), cfg.select_k).min()
                   for r in refs) > 1e-4:
                break
        weights = dsa_jax.load_hf_layer(path, cfg, 0)
        y, sel = _paged_run(cfg, weights, x, 40)
        run = oracle.run_hf(config, layers, x, 40)
    err = max(_rel(y[s, t], run.y[0][s, t]) for s in range(2) for t in range(70))
    ours = oracle.selection_sets(sel)
    theirs = oracle.selection_sets(run.sel[0])
    checks.append(Check("hf", "prefill+decode vs HF glm5_next, worst row (y)", impl, err,
                        LAYER_RTOL))
    checks.append(Check("hf", "selected token sets == HF's, every row", impl,
                        0.0 if ours == theirs else 1.0, 0.0))
    return checks


def hf_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers.models.glm5_next  # noqa: F401
    except ImportError:
        return False
    return True


def _guarded(kind: str, impl: str, fn) -> list[Check]:
    """Run one group of checks; an exception becomes a failed row, not the end of the table."""
    try:
        return fn(impl)
    except Exception as err:
        print(f"{kind} checks for {impl} raised {type(err).__name__}: {err}")
        return [Check(kind, f"raised {type(err).__name__}", impl, float("inf"), 0.0)]


def run_checks(include_hf: bool = True) -> list[Check]:
    impls = ["xla", *kernel_implementations()]
    checks = []
    for impl in impls[1:]:
        checks += _guarded("kernel", impl, kernel_checks)
    for impl in impls:
        checks += _guarded("layer", impl, layer_checks)
        if include_hf and hf_available():
            checks += _guarded("hf", impl, hf_checks)
    return checks


def format_table(checks: list[Check]) -> str:
    lines = [f"{'kind':<7}{'implementation':<18}{'error':>10}{'tolerance':>11}  result  check"]
    for c in checks:
        lines.append(f"{c.kind:<7}{c.implementation:<18}{c.error:>10.2e}{c.tolerance:>11.1e}  "
                     f"{'PASS' if c.passed else 'FAIL':<6}  {c.name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsa-jax parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face checks")
    args = parser.parse_args(argv)
    hf = "off" if args.no_hf else ("on" if hf_available() else
                                   "unavailable (torch/transformers not installed)")
    print(f"backend {jax.default_backend()}, jax {jax.__version__}; HF checks: {hf}")
    checks = run_checks(include_hf=not args.no_hf)
    print(format_table(checks))
    failed = sum(not c.passed for c in checks)
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0
