"""The Pallas kernels (interpret mode, any backend) against their jnp twins.

Inputs are random (never zeros), shapes are not powers of two (odd head counts, odd widths,
partial last tiles and splits), block tables are permuted. Interpret mode starts every output
as NaN (Pallas' uninitialized value), so "no NaN" checks that every element was written.

Tolerances, derived (u = unit roundoff of the dot operands: bf16 2^-9, fp32 2^-24; e = 2^-24
for fp32 accumulation):

sparse_attend, per row, with s = softmax_scale * kv_scale, c_j the stored latent row and
L_j = s * sum_c |q_c| |c_jc| (the largest a logit's rounding can be relative to):
  * the kernel rounds q to the operand dtype (latents are exact: e4m3 and bf16 values fit in
    bf16; fp32 stays fp32): logit error <= u L_j; fp32 dot accumulation over C terms, in both
    the kernel and the twin: <= C e L_j each. So the logits differ by at most
    D = max_j (u + 2 C e) L_j.
  * logits off by <= D move every softmax weight by a factor within exp(+-2D), so the weighted
    mean of the rows moves by <= (exp(2D) - 1) M, M = max_j |s_kv c_j|_inf (dequantized).
  * the kernel rounds p to the operand dtype before the PV dot: <= u M.
  * fp32 sums over W slots of the numerator and denominator (and the split merge), in both:
    <= 4 (W + 8) e M.
  => |out - twin| <= [(exp(2D) - 1) + u + 4 (W + 8) e] M, per row and element; we assert it
  with a factor 2 of margin. With q rounded to bf16 before the twin too, D shrinks to
  2 C e max_j L_j (the "tight" check). Also ||out - twin|| / ||twin|| < 1e-2 for bf16 operands
  (METHOD.md's range for bf16 dot operands), 1e-5 for fp32.

pool_scores, per element, with A_p = sum_h |w_h| sum_d |qi_hd K_pd|: the head dots (Di terms)
and the weighted head sum (Hi terms) in fp32 in both kernel (IEEE fp32 in interpret mode) and
twin: |kernel - twin| <= 2 (Di + Hi + 2) e A_p (relu is 1-Lipschitz, so it adds nothing).
-inf must match exactly, and no -0.0 may appear.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_topk as pt
from dsa_jax.pallas import sparse_attend as sa
from dsa_jax.shapes import tiny

U = {"bfloat16": 2.0 ** -9, "float32": 2.0 ** -24}
E32 = 2.0 ** -24
CACHE_DTYPES = ["float8_e4m3fn", "bfloat16", "float32"]


# ------------------------------------------------------------------------------ sparse attend

def _attend_inputs(seed, b, r, h, c, w, bs, mb, dtype, kv_scale=0.05):
    """q [B,R,H,C], cache [NB,bs,C] (NB > B*MB: spare blocks), permuted tables, sel with -1s."""
    ks = jax.random.split(jax.random.key(seed), 5)
    nb = b * mb + 2
    q = jax.random.normal(ks[0], (b, r, h, c))
    lat = jax.random.normal(ks[1], (nb, bs, c))
    if dtype == "float8_e4m3fn":
        lat = jnp.clip(lat / kv_scale, -448, 448)
    lat = lat.astype(dtype)
    tables = jax.random.permutation(ks[2], nb)[: b * mb].reshape(b, mb).astype(jnp.int32)
    assert not np.array_equal(np.asarray(tables).ravel(), np.arange(b * mb))
    sel = jax.random.randint(ks[3], (b, r, w), 0, mb * bs).astype(jnp.int32)
    sel = jnp.where(jax.random.uniform(ks[4], sel.shape) < 0.2, -1, sel)
    return q, lat, jnp.float32(kv_scale), tables, sel


def _dequant_rows(lat, kv_scale, tables, sel):
    """Selected rows, dequantized, as float64: [B, R, W, C]; -1 slots are NaN-free zeros."""
    nb, bs, c = lat.shape
    flat = np.asarray(lat.astype(jnp.float32), np.float64).reshape(nb * bs, c)
    if lat.dtype == jnp.float8_e4m3fn:
        flat = flat * float(kv_scale)
    sel, tables = np.asarray(sel), np.asarray(tables)
    b_idx = np.arange(sel.shape[0])[:, None, None]
    slots = tables[b_idx, np.clip(sel, 0, None) // bs] * bs + np.clip(sel, 0, None) % bs
    return np.where((sel >= 0)[..., None], flat[slots], 0.0)


def _attend_bound(q, lat, kv_scale, tables, sel, scale, u, splits=8):
    """The derived elementwise bound on |kernel - twin|, per row: [B, R, 1, 1]."""
    rows = _dequant_rows(lat, kv_scale, tables, sel)  # [B, R, W, C] dequantized
    c_dim, w = rows.shape[-1], rows.shape[-2]
    l_j = scale * np.einsum("brhc,brwc->brhw", np.abs(np.asarray(q, np.float64)), np.abs(rows))
    d = (u + 2 * c_dim * E32) * l_j.max(axis=(2, 3))  # [B, R]
    m = np.abs(rows).max(axis=(2, 3))  # [B, R]
    bound = (np.expm1(2 * d) + u + 4 * (w + splits) * E32) * m
    return 2.0 * bound[..., None, None]


def _check_attend(out, ref, bound, rel_limit):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(out).any(), "an output element was never written"
    err = np.abs(out - ref)
    assert (err <= bound).all(), f"max err/bound {np.max(err / np.maximum(bound, 1e-30)):.3g}"
    assert np.linalg.norm(out - ref) <= rel_limit * np.linalg.norm(ref)


# (B, R, H, C, W, block size, blocks per seq, kernel kwargs, cache dtypes): odd heads, odd
# widths, partial last tiles, a split count that leaves empty tiles, H > 16 (two head blocks
# at block_h=16). Every cache dtype runs on the first; one each on the others (CPU time).
ATTEND_CASES = [
    (2, 3, 5, 24, 37, 8, 6, {}, CACHE_DTYPES),
    (1, 2, 3, 40, 70, 16, 5, dict(block_w=16, num_splits=3), ["float8_e4m3fn"]),
    (2, 1, 20, 16, 19, 4, 7, dict(block_h=16, num_splits=2), ["bfloat16"]),
]
ATTEND_PARAMS = [(i, dt) for i, case in enumerate(ATTEND_CASES) for dt in case[-1]]


@pytest.mark.parametrize("case,dtype", ATTEND_PARAMS)
def test_sparse_attend_matches_xla_twin(case, dtype):
    b, r, h, c, w, bs, mb, kw, _ = ATTEND_CASES[case]
    args = _attend_inputs(10 * case + len(dtype), b, r, h, c, w, bs, mb, dtype)
    scale = 0.3
    out = sa.sparse_attend_pallas(*args, softmax_scale=scale, interpret=True, **kw)
    ref = sa.sparse_attend_xla(*args, softmax_scale=scale)
    op = sa.default_compute_dtype(args[1].dtype).name
    u = U[op]
    _check_attend(out, ref, _attend_bound(*args, scale, u), 1e-2 if op == "bfloat16" else 1e-5)
    if op == "bfloat16":  # tight: the twin sees the same bf16-rounded q
        q16 = args[0].astype(jnp.bfloat16).astype(jnp.float32)
        ref16 = sa.sparse_attend_xla(q16, *args[1:], softmax_scale=scale)
        tight = _attend_bound(q16, *args[1:], scale, 0.0) + 2 * u * np.abs(
            _dequant_rows(*args[1:])).max(axis=(2, 3))[..., None, None]
        _check_attend(out, ref16, tight, 1e-2)


def test_sparse_attend_empty_rows_are_exactly_zero():
    q, lat, kv, tables, sel = _attend_inputs(3, 2, 3, 5, 24, 37, 8, 6, "float8_e4m3fn")
    sel = sel.at[0, 1].set(-1).at[1, 2].set(-1)
    out = np.asarray(sa.sparse_attend_pallas(q, lat, kv, tables, sel, softmax_scale=0.3,
                                             interpret=True, block_w=16, num_splits=2))
    assert not np.isnan(out).any()
    assert (out[0, 1] == 0).all() and (out[1, 2] == 0).all()
    assert (np.abs(out[0, 0]) > 0).any()
    # A whole batch with nothing selected.
    none = sa.sparse_attend_pallas(q, lat, kv, tables, jnp.full_like(sel, -1), softmax_scale=0.3,
                                   interpret=True)
    assert (np.asarray(none) == 0).all()


def test_sparse_attend_split_counts_agree():
    """Splitting a row's slots across programs only reorders fp32 sums (merge included)."""
    args = _attend_inputs(4, 1, 2, 3, 40, 70, 16, 5, "float32")
    outs = [np.asarray(sa.sparse_attend_pallas(*args, softmax_scale=0.3, interpret=True,
                                               block_w=16, num_splits=k)) for k in (1, 5)]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())


def test_sparse_attend_live_rows_hint_only_moves_the_split():
    """Planning the split for fewer live rows (a padded decode) gives more splits: the same
    result up to fp32 reordering, and the padded rows stay exactly 0."""
    q, lat, kv, tables, sel = _attend_inputs(6, 4, 4, 20, 24, 70, 8, 10, "float32")
    sel = sel.at[:, 1:].set(-1)  # rows padded as decode pads them
    # 2 head blocks of 16; 5 tiles of 16 slots: 16 rows plan 4 splits, 4 live rows plan 5.
    assert [sa._num_splits(n * 2, 1, 5) for n in (16, 4)] == [4, 5]
    outs = [np.asarray(sa.sparse_attend_pallas(q, lat, kv, tables, sel, softmax_scale=0.3,
                                               interpret=True, block_w=16, live_rows=lr))
            for lr in (None, 4)]
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())
    assert (outs[1][:, 1:] == 0).all() and (np.abs(outs[1][:, 0]) > 0).any()


def test_sparse_attend_stops_at_each_rows_live_extent():
    """Selections laid out as the selection writes them (a prefix of slots, then -1): prefixes
    ending before, on and after tile (16) and split boundaries, and rows with nothing; the
    kernel stops at each row's last slot and must still match the twin."""
    q, lat, kv, tables, sel = _attend_inputs(5, 2, 4, 5, 24, 70, 8, 10, "float8_e4m3fn")
    ends = jnp.array([[0, 1, 15, 16], [17, 33, 69, 70]], jnp.int32)  # [B, R] prefix lengths
    sel = jnp.where(jnp.arange(70)[None, None, :] < ends[..., None], jnp.abs(sel), -1)
    args = (q, lat, kv, tables, sel)
    out = sa.sparse_attend_pallas(*args, softmax_scale=0.3, interpret=True, block_w=16,
                                  num_splits=3)
    ref = sa.sparse_attend_xla(*args, softmax_scale=0.3)
    _check_attend(out, ref, _attend_bound(*args, 0.3, U["bfloat16"]), 1e-2)
    assert (np.asarray(out)[0, 0] == 0).all()
    np.testing.assert_array_equal(np.asarray(sa.live_extent(sel.reshape(8, 70))),
                                  np.asarray(ends).reshape(8))


# ------------------------------------------------------------------------------- pool scores

def _pool_inputs(seed, b, r, hi, di, p):
    ks = jax.random.split(jax.random.key(seed), 4)
    qi = jax.random.normal(ks[0], (b, r, hi, di))
    w = jax.random.normal(ks[1], (b, r, hi)) * (hi * di) ** -0.5
    keys = jax.random.normal(ks[2], (b, p, di))
    n_cand = jax.random.randint(ks[3], (b, r), 0, p + 1).astype(jnp.int32)
    n_cand = n_cand.at[0, 0].set(0).at[-1, -1].set(p)  # no candidate; every pool a candidate
    return qi, w, keys, n_cand


def _pool_bound(qi, w, keys):
    a = np.einsum("brh,brhp->brp", np.abs(np.asarray(w, np.float64)),
                  np.einsum("brhd,bpd->brhp", np.abs(np.asarray(qi, np.float64)),
                            np.abs(np.asarray(keys, np.float64))))
    hi, di = qi.shape[2], qi.shape[3]
    return 2 * (di + hi + 2) * E32 * a


def _check_pool(out, ref, bound):
    out, ref = np.asarray(out), np.asarray(ref)
    assert not np.isnan(out).any(), "an output element was never written"
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    assert not np.isinf(out[~np.isneginf(ref)]).any()
    assert not (np.signbit(out) & (out == 0)).any(), "-0.0 in the scores"
    fin = ~np.isneginf(ref)
    assert (np.abs(out[fin] - ref[fin]) <= bound[fin]).all()


@pytest.mark.parametrize("shape,kw", [
    ((2, 3, 3, 12, 37), {}),  # odd Hi, Di, P; one partial tile
    ((3, 2, 5, 20, 100), dict(block_p=16, num_chunks=3)),  # partial chunk past P
    ((1, 4, 32, 128, 70), dict(block_p=32)),  # GLM Hi, Di
])
def test_pool_scores_matches_xla_twin(shape, kw):
    args = _pool_inputs(sum(shape), *shape)
    out = ps.pool_scores_pallas(*args, interpret=True, **kw)
    ref = ps.pool_scores_xla(*args)
    _check_pool(out, ref, _pool_bound(*args[:3]))


def test_pool_scores_tiles_past_the_candidates():
    """Candidate counts on, before and after tile edges (block_p 16), and 0 (a padded row):
    the kernel skips the tiles with no candidate; scores and -inf must still match."""
    qi, w, keys, _ = _pool_inputs(8, 2, 4, 5, 20, 100)  # the shape of the chunked case above
    n_cand = jnp.array([[0, 15, 16, 17], [32, 33, 99, 100]], jnp.int32)
    args = (qi, w, keys, n_cand)
    out = ps.pool_scores_pallas(*args, interpret=True, block_p=16, num_chunks=3)
    _check_pool(out, ps.pool_scores_xla(*args), _pool_bound(*args[:3]))
    assert np.isneginf(np.asarray(out)[0, 0]).all()


@pytest.mark.parametrize("rows_per_program", [1, 2, 8])
def test_pool_scores_row_groups(rows_per_program):
    """Rows of one sequence scored together (R = 5: the last group is padded; 8 > R: one
    group holds every row of a sequence plus padding)."""
    args = _pool_inputs(9, 2, 5, 3, 12, 37)
    out = ps.pool_scores_pallas(*args, interpret=True, block_p=16,
                                rows_per_program=rows_per_program)
    _check_pool(out, ps.pool_scores_xla(*args), _pool_bound(*args[:3]))
    with pytest.raises(ValueError, match="rows_per_program 3"):
        ps.pool_scores_pallas(*args, interpret=True, rows_per_program=3)


def test_pool_scores_negative_zero_is_normalized():
    """Keys opposite every query: all dots < 0, relu gives 0, w < 0 makes -0.0 naively."""
    qi, w, keys, n_cand = _pool_inputs(7, 2, 3, 3, 12, 37)  # test above's shape: no recompile
    qi = jnp.abs(qi)
    keys = -jnp.abs(keys)
    w = -jnp.abs(w)
    n_cand = jnp.full_like(n_cand, 37)
    out = np.asarray(ps.pool_scores_pallas(qi, w, keys, n_cand, interpret=True))
    assert (out == 0).all() and not np.signbit(out).any()


# ---------------------------------------------------------------------------------- pool top-k

def _topk_scores(seed, n, p, live, ties):
    """Random scores [n, p] (quantized to ties when asked, -0.0 included), -inf from `live`
    per row on (a row's candidates end there; 0: a padded row)."""
    x = np.array(jax.random.normal(jax.random.key(seed), (n, p)))
    if ties:
        x = np.round(x * 4) / 4  # many equal scores, and -0.0 from small negatives
    x[np.arange(p)[None, :] >= np.asarray(live)[:, None]] = -np.inf
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("n,p,k,live,kw", [
    (4, 4096, 512, [4096, 0, 0, 0], {}),  # a decode row padded to max_verify, GLM's P and k
    (3, 300, 37, [300, 150, 37], {}),  # P, k not powers of two; live == k
    (3, 1000, 200, [1000, 511, 3], dict(chunk=256)),  # several chunks, live < k
    (2, 64, 64, [64, 33], dict(rank_block=16)),  # k == P
    (2, 70, 1, [70, 0], {}),  # k == 1
    (3, 300, 37, [300, 150, 37], dict(radix_bits=1)),  # 32 passes of 2 thresholds
    (3, 1000, 200, [1000, 511, 3], dict(chunk=256, radix_bits=4)),  # 8 passes of 16
])
@pytest.mark.parametrize("ties", [False, True])
def test_pool_topk_equals_lax_top_k(n, p, k, live, kw, ties):
    """The same indices as lax.top_k, bit for bit: ties (lower index first), -inf tails,
    -0.0 below +0.0, rows with fewer candidates than k."""
    s = _topk_scores(n + p + k, n, p, live, ties)
    ref = np.asarray(pt.pool_topk_xla(s, k))
    out = np.asarray(pt.pool_topk_pallas(s, k, interpret=True, **kw))
    np.testing.assert_array_equal(out, ref)
    assert all(len(set(row)) == k for row in out.reshape(-1, k))  # distinct pools


def test_pool_topk_batch_dims_and_bad_k():
    s = _topk_scores(3, 6, 50, [50, 40, 30, 20, 10, 0], ties=True).reshape(2, 3, 50)
    out = pt.pool_topk_pallas(s, 20, interpret=True)
    assert out.shape == (2, 3, 20) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out, pt.pool_topk_xla(s, 20))
    with pytest.raises(ValueError, match="k=51"):
        pt.pool_topk_pallas(s, 51, interpret=True)


# ------------------------------------------------------------------------------- the layer

def test_layer_pallas_interpret_matches_xla():
    """Prefill past the selection budget, then decode, on the tiny config (fp8 cache): same
    selections, outputs within the attention kernel's bf16 operand error (rel 1e-2)."""
    base = tiny()
    weights = dsa_jax.init_random_weights(base, jax.random.key(0))
    b, prompt, steps = 2, 70, 2
    x = jax.random.normal(jax.random.key(1), (b, prompt + steps, base.hidden_size))
    perm = np.asarray(jax.random.permutation(jax.random.key(2), b * base.blocks_per_seq),
                      np.int32).reshape(b, base.blocks_per_seq)
    results = {}
    for impl in ("xla", "pallas-interpret"):
        cfg = base.replace(implementation=impl)
        state = dsa_jax.init_state(cfg, b, kv_scale=0.05, block_tables=perm)
        y, state, sel = dsa_jax.prefill(cfg, weights, state, x[:, :prompt])
        ys, sels = [y], [sel]
        for t in range(prompt, prompt + steps):
            y, state, sel = dsa_jax.decode(cfg, weights, state, x[:, t])
            ys.append(y[:, None])
            sels.append(sel[:, None])
        results[impl] = (np.concatenate(ys, 1), np.concatenate(sels, 1))
    (y_x, sel_x), (y_p, sel_p) = results["xla"], results["pallas-interpret"]
    np.testing.assert_array_equal(sel_p, sel_x)
    assert ((sel_x[:, -1] >= 0).sum(-1) < prompt + steps).all()  # the selection bites
    assert not np.isnan(y_p).any()
    assert np.linalg.norm(y_p - y_x) <= 1e-2 * np.linalg.norm(y_x)
