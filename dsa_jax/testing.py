"""What the tests, `dsa-jax parity` and the device scripts share: random inputs, definitions to
check against, error measures, tolerances derived from dtypes and reduction lengths, and
bitwise comparison of pytrees (on chex).

- Random inputs (numpy normal draws from a seed, never zeros): `random_rows`,
  `permuted_block_tables`, `random_state`, and the cache ops' operands (`attend_inputs`,
  `pool_inputs`, `topk_scores`, `latent_write_inputs`, `index_write_inputs`). Random HF
  tensors have one recipe, `dsa_jax.weights.random_hf_value`, drawn by
  `dsa_jax.init_random_hf_tensors` (and by the HF oracle's own generator).
- Running: `copy_tree` (a second state: the steps donate theirs), `prefill_then_decode`,
  `run_op` (one op of `dsa_jax.implementation.OPS` under "xla", "pallas-interpret" or
  "pallas").
- Definitions of the compute ops in float64 numpy, independent of every implementation:
  `attend_definition`, `pool_scores_definition`, `topk_definition`.
- Errors and tolerances: `rel_err`, `unit_roundoff`, `storage_step`, the dot operand
  roundings of each implementation, and the derived bounds `attend_bound`,
  `pool_scores_bound` with the assertions that apply them.
- Bitwise: `assert_trees_bitwise_equal` (-0.0 != 0.0, NaN payloads count, fp8 included).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from dsa_jax.implementation import OPS, default_compute_dtype
from dsa_jax.weights import hf_shapes, random_hf_value

IMPLEMENTATIONS = ("xla", "pallas-interpret", "pallas")
# A fill no write produces: a slot still holding it was not written (fp8 caches use 400.0).
POISON = 1234.5

# ------------------------------------------------------------------------------ random inputs


def _normal(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.standard_normal(shape, np.float32)


def random_rows(seed: int, *shape: int, dtype=jnp.float32) -> jax.Array:
    """Standard normal `shape` (e.g. x rows `[B, S, D]`), drawn by numpy from `seed`.

    Inputs here are numpy draws: a jax.random draw compiles a program per shape (about a
    second of CPU each), which the many shapes of a test suite pay again and again."""
    return jnp.asarray(_normal(np.random.default_rng(seed), shape), dtype)


def permuted_block_tables(cfg, num_seqs: int, seed: int, num_blocks: int | None = None
                          ) -> np.ndarray:
    """`[B, MB]` int32 block tables over a shuffled pool of `num_blocks` physical blocks
    (default exactly `B * MB`): never the identity map."""
    n = num_seqs * cfg.blocks_per_seq
    perm = np.random.default_rng(seed).permutation(num_blocks or n).astype(np.int32)
    if np.array_equal(perm[:n], np.arange(n)):
        perm[:2] = perm[1::-1].copy()
    return perm[:n].reshape(num_seqs, cfg.blocks_per_seq)


def random_hf_numpy(cfg, rng: np.random.Generator, has_indexer: bool = True
                     ) -> dict[str, np.ndarray]:
    """One layer's HF tensors drawn with numpy (no per-shape compile) through the one recipe,
    `dsa_jax.weights.random_hf_value`: `{name: [out, in] f32}`."""
    return {name: random_hf_value(name, rng.standard_normal(shape)).astype(np.float32)
            for name, shape in hf_shapes(cfg, has_indexer).items()}


def copy_tree(tree):
    """An independent copy of every array (the steps donate the state they are given)."""
    return jax.tree_util.tree_map(jnp.copy, tree)


def random_state(cfg, weights, num_seqs: int, length: int, seed: int, *, dtype=jnp.float32,
                 **init):
    """A state holding `length` random rows per sequence (prefilled; `init` goes to
    `init_state`: kv_scale, block_tables, ...)."""
    state = dsa_jax.init_state(cfg, num_seqs, has_indexer=weights.has_indexer, **init)
    x = random_rows(seed, num_seqs, length, cfg.hidden_size, dtype=dtype)
    return dsa_jax.prefill(cfg, weights, state, x)[1]


def prefill_then_decode(cfg, weights, state, x, prompt_len: int, shared_sel=None):
    """Prefill `x[:, :prompt_len]`, then decode the rest of `x [B, S, D]` one row at a time.
    `shared_sel [B, S, W]`: the selections a "shared" layer is handed. Returns `y [B, S, D]`,
    `sel [B, S, W]` (numpy) and the final state."""
    shared = (lambda lo, hi: None) if shared_sel is None else (
        lambda lo, hi: jnp.asarray(shared_sel)[:, lo:hi])
    y, state, sel = dsa_jax.prefill(cfg, weights, state, x[:, :prompt_len],
                                    shared_sel=shared(0, prompt_len))
    ys, sels = [np.asarray(y)], [np.asarray(sel)]
    for t in range(prompt_len, x.shape[1]):
        s_t = None if shared_sel is None else shared(t, t + 1)[:, 0]
        y, state, sel = dsa_jax.decode(cfg, weights, state, x[:, t], shared_sel=s_t)
        ys.append(np.asarray(y)[:, None])
        sels.append(np.asarray(sel)[:, None])
    return np.concatenate(ys, 1), np.concatenate(sels, 1), state


def attend_inputs(seed: int, b: int, r: int, h: int, c: int, w: int, bs: int, mb: int,
                  dtype, kv_scale: float = 0.05, empty=()):
    """Gather-attend operands: q `[B, R, H, C]`, a cache `[NB, bs, C]` (NB > B*MB: spare
    blocks; fp8 values spread over e4m3's range), permuted tables `[B, MB]`, `sel [B, R, W]`
    with ~20% -1 slots, and every slot -1 in the `(b, r)` rows of `empty`."""
    rng = np.random.default_rng(seed)
    nb = b * mb + 2
    q = _normal(rng, (b, r, h, c))
    lat = _normal(rng, (nb, bs, c))
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        lat = np.clip(lat / kv_scale, -448, 448)
    tables = rng.permutation(nb)[: b * mb].reshape(b, mb).astype(np.int32)
    assert not np.array_equal(tables.ravel(), np.arange(b * mb))
    sel = rng.integers(0, mb * bs, (b, r, w), dtype=np.int32)
    sel = np.where(rng.random(sel.shape) < 0.2, -1, sel).astype(np.int32)
    for bi, ri in empty:
        sel[bi, ri] = -1
    return (jnp.asarray(q), jnp.asarray(lat).astype(dtype), jnp.float32(kv_scale),
            jnp.asarray(tables), jnp.asarray(sel))


def pool_inputs(seed: int, b: int, r: int, hi: int, di: int, p: int):
    """Pool-score operands: qi `[B, R, Hi, Di]`, head weights `[B, R, Hi]`, keys `[B, P, Di]`,
    candidate counts `[B, R]` (one row with none, one with every pool)."""
    rng = np.random.default_rng(seed)
    qi = _normal(rng, (b, r, hi, di))
    w = _normal(rng, (b, r, hi)) * np.float32((hi * di) ** -0.5)
    keys = _normal(rng, (b, p, di))
    n_cand = rng.integers(0, p + 1, (b, r), dtype=np.int32)
    n_cand[0, 0], n_cand[-1, -1] = 0, p
    return tuple(jnp.asarray(a) for a in (qi, w, keys, n_cand))


def topk_scores(seed: int, n: int, p: int, live, ties: bool) -> jax.Array:
    """Scores `[n, P]`, -inf from `live[i]` on in row i (0: a padded row); with `ties`,
    quantized to quarters: many equal scores, and -0.0 from small negatives."""
    x = _normal(np.random.default_rng(seed), (n, p))
    if ties:
        x = np.round(x * 4) / 4
    x[np.arange(p)[None, :] >= np.asarray(live)[:, None]] = -np.inf
    return jnp.asarray(x, jnp.float32)


def write_positions(b: int, r: int, lengths, max_pos: int):
    """`pos, valid [B, R]`: rows from `lengths[b]` on; sequences take r, r - 1, 0, ... rows
    (the first is full, the last writes nothing), never past `max_pos`."""
    pos = np.asarray(lengths)[:, None] + np.arange(r)
    counts = np.asarray([r, r - 1, 0][:b])
    valid = (np.arange(r)[None, :] < counts[:, None]) & (pos < max_pos)
    return jnp.asarray(pos, jnp.int32), jnp.asarray(valid)


def latent_write_inputs(seed: int, dtype, c: int, b: int = 3, r: int = 4, nb: int = 14,
                        bs: int = 8, mb: int = 4):
    """`latent_write_*` operands: raw rows `[B, R, C]`, norm `[C]`, a poisoned cache
    `[NB, bs, C]`, kv_scale, permuted tables `[B, MB]`, `pos, valid [B, R]`."""
    rng = np.random.default_rng(seed)
    kv_raw = _normal(rng, (b, r, c)) * 3
    norm_w = 1 + 0.3 * _normal(rng, (c,))
    tables = rng.permutation(nb)[: b * mb].reshape(b, mb).astype(np.int32)
    fill = 400.0 if jnp.dtype(dtype) == jnp.float8_e4m3fn else POISON
    cache = jnp.full((nb, bs, c), fill, dtype)
    pos, valid = write_positions(b, r, [5, 13, 2], mb * bs)
    return (jnp.asarray(kv_raw), jnp.asarray(norm_w), cache, jnp.float32(0.02),
            jnp.asarray(tables), pos, valid)


def index_write_inputs(seed: int, kpool: int, dtype, b: int = 3, r: int = 4, di: int = 12,
                       tmax: int = 24):
    """`index_write_*` operands: raw k and gate `[B, R, Di]`, LayerNorm weight and bias, ape
    `[KP, Di]`, rings `[B, T, Di]` holding earlier random rows (a ring of T = tmax rows: every
    position its own slot; completed pools mix old and new members), poisoned pool keys
    `[B, P, Di]`, `pos, valid [B, R]`. Smaller rings: tests/test_index_ring.py."""
    rng = np.random.default_rng(seed)
    k_raw = _normal(rng, (b, r, di)) * 2 + 0.5
    g = _normal(rng, (b, r, di))
    norm_w = 1 + 0.3 * _normal(rng, (di,))
    norm_b = 0.3 * _normal(rng, (di,))
    ape = 0.5 * _normal(rng, (kpool, di))
    index_k = jnp.asarray(_normal(rng, (b, tmax, di))).astype(dtype)
    index_g = jnp.asarray(_normal(rng, (b, tmax, di))).astype(dtype)
    pool_keys = jnp.full((b, tmax // kpool, di), POISON, dtype)
    pos, valid = write_positions(b, r, [5, 13, 2], tmax)
    return (*(jnp.asarray(a) for a in (k_raw, g, norm_w, norm_b, ape)), index_k, index_g,
            pool_keys, pos, valid)


# ---------------------------------------------------------------------------------- running

@functools.cache
def _jitted_reference(name: str, static: tuple):
    return jax.jit(functools.partial(OPS[name].reference, **dict(static)),
                   static_argnames=("k",) if name == "pool_topk" else ())


def run_op(name: str, impl: str, *args, kernel_options: dict | None = None, **kwargs):
    """Op `name` of `dsa_jax.implementation.OPS` under `impl`, as the layer calls it:
    "xla" runs the jnp definition under `jax.jit`; "pallas-interpret" and "pallas" the kernel,
    with `kernel_options` (its tuning keywords). Unlike the layer, no shape is routed to the
    definition (`Op.kernel_covers`): the kernel is what is asked for."""
    if impl == "xla":
        return _jitted_reference(name, tuple(sorted(kwargs.items())))(*args)
    if impl not in ("pallas", "pallas-interpret"):
        raise ValueError(f"implementation {impl!r} is not one of {IMPLEMENTATIONS}")
    return OPS[name].kernel(*args, interpret=impl == "pallas-interpret",
                            **(kernel_options or {}), **kwargs)


# ------------------------------------------------------------------------------ definitions


def dequant_rows(lat, kv_scale, tables, sel) -> np.ndarray:
    """Selected rows, dequantized, as float64: `[B, R, W, C]`; -1 slots are zeros."""
    nb, bs, c = lat.shape
    flat = np.asarray(jnp.asarray(lat).astype(jnp.float32), np.float64).reshape(nb * bs, c)
    if lat.dtype == jnp.float8_e4m3fn:
        flat = flat * float(kv_scale)
    sel, tables = np.asarray(sel), np.asarray(tables)
    b_idx = np.arange(sel.shape[0])[:, None, None]
    tok = np.clip(sel, 0, None)
    slots = tables[b_idx, tok // bs] * bs + tok % bs
    return np.where((sel >= 0)[..., None], flat[slots], 0.0)


def attend_definition(q, lat, kv_scale, tables, sel, softmax_scale: float) -> np.ndarray:
    """The gather-attend in float64: `[B, R, H, C]`, 0 for a row with no selected slot."""
    rows = dequant_rows(lat, kv_scale, tables, sel)  # [B, R, W, C]
    live = (np.asarray(sel) >= 0)[:, :, None, :]  # [B, R, 1, W]
    logits = softmax_scale * np.matmul(np.asarray(q, np.float64),
                                       rows.transpose(0, 1, 3, 2))  # [B, R, H, W]
    logits = np.where(live, logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.where(live, np.exp(logits - np.where(np.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(-1, keepdims=True)
    return np.matmul(p, rows) / np.where(denom > 0, denom, 1.0)


def pool_scores_definition(qi, w, keys, n_cand) -> np.ndarray:
    """`sum_h w_h relu(qi_h . K_p)` in float64, `-inf` for pools past `n_cand`: `[B, R, P]`."""
    qi, w, keys = (np.asarray(a, np.float64) for a in (qi, w, keys))
    dots = np.einsum("brhd,bpd->brhp", qi, keys, optimize=True)
    s = np.einsum("brh,brhp->brp", w, np.maximum(dots, 0), optimize=True)
    return np.where(np.arange(keys.shape[1]) < np.asarray(n_cand)[..., None], s, -np.inf)


def topk_definition(scores, k: int) -> np.ndarray:
    """The selection's total order by sorting: score descending (+0.0 before -0.0), then
    pool index ascending; the first `k` indices of each row `[..., k]`."""
    s = np.asarray(scores, np.float32)
    idx = np.broadcast_to(np.arange(s.shape[-1]), s.shape)
    return np.lexsort((idx, np.signbit(s), -s), axis=-1)[..., :k].astype(np.int32)


# ------------------------------------------------------------------------ errors, tolerances


def rel_err(a, b) -> float:
    """`||a - b|| / ||b||` in float64; where `b` is all zeros: 0 if `a` is too, else inf."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    denom, diff = np.linalg.norm(b), np.linalg.norm(a - b)
    if denom > 0:
        return float(diff / denom)
    return 0.0 if diff == 0 else float("inf")


def assert_rel_close(a, b, rtol: float, what: str = "") -> None:
    err = rel_err(a, b)
    assert err <= rtol, f"{what}: ||a - b|| / ||b|| = {err:.3g} > {rtol:.3g}"


def unit_roundoff(dtype) -> float:
    """u = 2^-p for a p-bit significand (round to nearest): bf16 2^-8, fp32 2^-24,
    e4m3 2^-4."""
    return float(jnp.finfo(dtype).eps) / 2


def storage_step(dtype) -> float:
    """Relative size of one step between neighbouring codes of a stored dtype (at most eps:
    bf16 2^-7, e4m3 2^-3); 0 for fp32, which stores the computed value itself."""
    return 0.0 if jnp.dtype(dtype) == jnp.float32 else float(jnp.finfo(dtype).eps)


E32 = unit_roundoff(jnp.float32)
# fp32 dots compiled for the GPU run as 3-pass tf32 (TF32_TF32_F32_X3): each operand is split
# a = hi + lo into tf32 values (11-bit significands), and hi*hi + hi*lo + lo*hi is summed.
# With truncating splits (the worst case), |a - hi| <= 2^-10 |a| and lo misses a - hi by
# <= 2^-20 |a|; the dropped lo*lo and the two lo errors leave <= 3 * 2^-20 |ab| per product
# (plus terms of 2^-30): 2^-18 bounds it.
TF32X3_ROUNDOFF = 2.0 ** -18


def attend_roundoff(impl: str, cache_dtype, backend: str = "triton") -> float:
    """u of the gather-attend's dot operands under `impl`. The twin ("xla") dots fp32
    operands at HIGHEST; its one operand rounding is the fp8 dequantization product (E32).
    The Triton kernel feeds bf16 operands for fp8 / bf16 caches; fp32 ones for an fp32 cache:
    IEEE in interpret mode, 3-pass tf32 compiled. The Mosaic GPU kernel (`backend`
    "mosaic", fp8 caches) feeds f16 operands (see `attend_bound` for its absolute floors)."""
    compute = default_compute_dtype(jnp.dtype(cache_dtype))
    if impl == "xla":
        return E32
    if backend == "mosaic":
        return unit_roundoff(jnp.float16)
    if compute == jnp.float32 and impl == "pallas":
        return TF32X3_ROUNDOFF
    return unit_roundoff(compute)


def attend_rel_limit(u: float) -> float:
    """||out - definition|| / ||definition|| allowed: 1e-2 with 16-bit dot operands (METHOD.md's
    range for bf16 operands; f16, the Mosaic GPU kernel's, rounds finer and stays inside it),
    1e-5 with fp32-class ones (tf32 x3, IEEE fp32)."""
    return 1e-2 if u >= unit_roundoff(jnp.float16) else 1e-5


def pool_scores_roundoff(impl: str) -> float:
    """u of the pool-score dots' operands: IEEE fp32 in the twin and in interpret mode (no
    operand rounding), 3-pass tf32 compiled for the GPU."""
    return TF32X3_ROUNDOFF if impl == "pallas" else 0.0


def attend_bound(q, lat, kv_scale, tables, sel, scale: float, u: float, splits: int = 8,
                 q_floor=None, p_floor: float = 0.0, partial_u: float = 0.0,
                 partial_floor: float = 0.0) -> np.ndarray:
    """The derived elementwise bound on |out - twin| (and on |out - definition|), per row:
    `[B, R, 1, 1]`.

    Per row, with s = softmax_scale * kv_scale, c_j the stored latent row and
    L_j = s * sum_c |q_c| |c_jc| (the largest a logit's rounding can be relative to):
      * the kernel rounds q to the operand dtype (latents are exact: e4m3 and bf16 values fit
        in bf16; fp32 stays fp32): logit error <= u L_j; fp32 dot accumulation over C terms,
        in both the kernel and the twin: <= C e L_j each (e = E32). So the logits differ by at
        most D = max_j (u + 2 C e) L_j.
      * logits off by <= D move every softmax weight by a factor within exp(+-2D), so the
        weighted mean of the rows moves by <= (exp(2D) - 1) M, M = max_j |s_kv c_j|_inf
        (dequantized).
      * the kernel rounds p to the operand dtype before the PV dot: <= u M.
      * fp32 sums over W slots of the numerator and denominator (and the split merge), in
        both: <= 4 (W + splits) e M.
      => |out - twin| <= [(exp(2D) - 1) + u + 4 (W + splits) e] M, per row and element,
      asserted with a factor 2 of margin. The float64 definition has none of the twin's
      errors, so the same bound holds against it. On the GPU, Triton's exp may be an
      approximation (a few ulps, plus |x| 2^-24 from scaling its argument by log2 e): a
      logit perturbation well inside the C e L_j term.
    Operands rounded with an absolute floor as well (f16 subnormals, the Mosaic GPU kernel:
    u = 2^-11): q_floor `[B, R]`, the absolute error of a row's q (its scale 2^k brings
    max |q| into [2^13, 2^14) before the f16 rounding: 2^-25 2^-k), adds s q_floor
    max_j sum_c |c_jc| to D; p_floor, the absolute error of a rounded p (2^-25 below 2^-14,
    against an fp32 denominator >= 1), adds W p_floor to the bracket.
    Partials rounded before the merge (f16 in the cache's units, `MgpuTuning.half_partials`):
    each split's partial moves by <= partial_u |o_s| + partial_floor (dequantized: the f16
    floor 2^-25 times kv_scale) with |o_s| <= M, and the merge is a convex combination, so
    the result moves by <= partial_u M + partial_floor.
    """
    rows = dequant_rows(lat, kv_scale, tables, sel)  # [B, R, W, C]
    c_dim, w = rows.shape[-1], rows.shape[-2]
    l_j = scale * np.matmul(np.abs(np.asarray(q, np.float64)),
                            np.abs(rows).transpose(0, 1, 3, 2))  # [B, R, H, W]
    d = (u + 2 * c_dim * E32) * l_j.max(axis=(2, 3))  # [B, R]
    if q_floor is not None:
        d = d + scale * np.asarray(q_floor) * np.abs(rows).sum(axis=3).max(axis=2)
    m = np.abs(rows).max(axis=(2, 3))  # [B, R]
    bound = ((np.expm1(2 * d) + u + w * p_floor + partial_u + 4 * (w + splits) * E32) * m
             + partial_floor)
    return 2.0 * bound[..., None, None]


def assert_attend_close(out, ref, bound, rel_limit: float | None = None) -> None:
    """Every element written (interpret mode starts outputs as NaN), within `bound`
    elementwise and (when given) within `rel_limit` normwise."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(out).any(), "an output element was never written (or a NaN leaked)"
    err = np.abs(out - ref)
    assert (err <= bound).all(), f"max err/bound {np.max(err / np.maximum(bound, 1e-30)):.3g}"
    if rel_limit is not None:
        assert rel_err(out, ref) <= rel_limit, f"relative error {rel_err(out, ref):.3g}"


def pool_scores_bound(qi, w, keys, u: float = 0.0) -> np.ndarray:
    """The derived elementwise bound on |out - twin| (and on |out - definition|):
    `[B, R, P]`.

    With A_p = sum_h |w_h| sum_d |qi_hd K_pd|: the head dots (Di terms) and the weighted head
    sum (Hi terms) run in fp32 in both the kernel and the twin: |kernel - twin| <=
    2 (Di + Hi + 2) e A_p (relu is 1-Lipschitz, so it adds nothing). Dots whose operands are
    rounded (u: 3-pass tf32 on the GPU, for the head dots and the head sum) add <= 2 u A_p.
    Asserted as is (the 2 is the margin)."""
    a = np.einsum("brh,brhp->brp", np.abs(np.asarray(w, np.float64)),
                  np.einsum("brhd,bpd->brhp", np.abs(np.asarray(qi, np.float64)),
                            np.abs(np.asarray(keys, np.float64)), optimize=True),
                  optimize=True)
    hi, di = qi.shape[2], qi.shape[3]
    return 2 * ((di + hi + 2) * E32 + 2 * u) * a


def assert_pool_scores_close(out, ref, bound) -> None:
    """Every element written, -inf exactly where the reference has it, no -0.0, finite
    scores within `bound`."""
    out, ref = np.asarray(out), np.asarray(ref)
    assert not np.isnan(out).any(), "an output element was never written"
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    fin = ~np.isneginf(ref)
    assert not np.isinf(out[fin]).any()
    assert not (np.signbit(out) & (out == 0)).any(), "-0.0 in the scores"
    assert (np.abs(out[fin] - ref[fin]) <= bound[fin]).all()


def assert_stored_close(got, want, dtype) -> None:
    """Stored cache values of `dtype`: the same fp32 formulas with other reduction orders
    differ by a few ulps (rtol 1e-6 over these short reductions); a value on a rounding
    boundary may then land on the neighbouring code: allowed for under 1% of the elements,
    and never by more than one `storage_step(dtype)`."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    want = np.asarray(jnp.asarray(want).astype(jnp.float32))
    diff = np.abs(got - want)
    off = diff > 1e-6 * np.abs(want) + 1e-30
    assert off.mean() < 0.01, off.mean()
    assert np.all(diff <= storage_step(dtype) * np.abs(want) + 1e-6), diff.max()


# ------------------------------------------------------------------------------------ bitwise


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


def _bits_message(a, b) -> str:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    ua = np.ascontiguousarray(a).reshape(a.size, -1).view(np.uint8)  # [N, itemsize]
    ub = np.ascontiguousarray(b).reshape(b.size, -1).view(np.uint8)
    bad = np.flatnonzero((ua != ub).any(axis=-1))
    first = np.unravel_index(bad[0], a.shape)
    return (f"{len(bad)} of {a.size} elements differ in their bits; the first at "
            f"{tuple(int(i) for i in first)}: {a[first]!r} vs {b[first]!r}")


def assert_trees_bitwise_equal(*trees) -> None:
    """Same structure, and every leaf the same dtype, shape and bytes (so -0.0 != 0.0 and
    NaN payloads count; fp8 included). `chex.assert_trees_all_equal` compares values
    (-0.0 == 0.0, NaN == NaN, dtypes unchecked), hence this comparator."""
    chex.assert_trees_all_equal_comparator(_same_bits, _bits_message, *trees)
