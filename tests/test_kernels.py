"""The cache ops' implementations against their definitions: one body per check, run under
"xla" (the jnp twin), "pallas-interpret" (the kernels in interpret mode, any backend) and
"pallas" (compiled; `gpu` marker, skipped off a GPU).

The H200 correctness run is `pytest -m gpu` on the GPU machine, from the repository root
(`python -m pytest -m gpu tests/test_kernels.py tests/test_write_kernels.py
tests/test_serving_paths.py tests/test_gpu_serving.py`): every "pallas" case below,
the kernels at GLM-5.3-Flash shapes (per rank at TP 8, and TP 1), the layer through the
compiled kernels, the cache writes, and decode_k == serial decodes bit for bit at GLM per-rank
shapes with an fp8 cache (tests/test_serving_paths.py), the engine's speculation and
`dsa-jax parity` compiled (tests/test_gpu_serving.py). Off a GPU those cases are skipped.

Inputs are random (never zeros), shapes are not powers of two (odd head counts, odd widths,
partial last tiles and splits), block tables are permuted. Interpret mode starts every output
as NaN (Pallas' uninitialized value), so "no NaN" checks that every element was written.
The references are float64 definitions (`dsa_jax.testing`), independent of every
implementation; the tolerances are derived there (`attend_bound`, `pool_scores_bound`) from
the dot operands' unit roundoff u (bf16 2^-8, fp32 2^-24, 3-pass tf32 2^-18), e = 2^-24 for
fp32 accumulation and the reduction lengths. The top-k is exact: the same indices as the
total order (score descending, then index), ties and -0.0 included.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import testing as T
from dsa_jax.pallas.sparse_attend import AttendTuning, live_extent, sparse_attend_xla
from dsa_jax.pallas.sparse_attend_mgpu import row_scales
from dsa_jax.shapes import glm53_flash, tiny

CACHE_DTYPES = ["float8_e4m3fn", "bfloat16", "float32"]
BF16_U = T.unit_roundoff(jnp.bfloat16)


# ------------------------------------------------------------------------------ sparse attend

def _check_attend(impl, args, scale, backend="triton", splits=8, **kernel_options):
    """`impl` against the float64 definition within the derived bound; the Triton kernel with
    bf16 operands also against the twin fed the same bf16-rounded q (the "tight" check: only
    accumulation, p's rounding and the merge remain). `backend` "mosaic": the Mosaic GPU
    kernel, asked for by name, held to its f16 bound."""
    if impl != "xla" and backend == "mosaic":
        kernel_options["tuning"] = AttendTuning("mosaic")
    out = T.run_op("sparse_attend", impl, *args, softmax_scale=scale,
                   kernel_options=kernel_options)
    u = T.attend_roundoff(impl, args[1].dtype, backend)
    floors = {}
    if impl != "xla" and backend == "mosaic":
        b, r, h, c = args[0].shape
        down = np.asarray(row_scales(args[0].reshape(b * r, h, c))[1]).reshape(b, r)
        # The row's scale bounds its head groups' (each group's amax is at most the row's).
        floors = dict(q_floor=2.0 ** -25 * down, p_floor=2.0 ** -25)
        # f16 partials: 4 rows at GLM's shapes are split over many programs each.
        floors.update(partial_u=T.unit_roundoff(jnp.float16),
                      partial_floor=2.0 ** -25 * float(args[2]))
    want = T.attend_definition(*args, scale)
    T.assert_attend_close(out, want, T.attend_bound(*args, scale, u, splits, **floors),
                          T.attend_rel_limit(u))
    if impl != "xla" and u == BF16_U:
        q16 = args[0].astype(jnp.bfloat16).astype(jnp.float32)
        ref16 = T.run_op("sparse_attend", "xla", q16, *args[1:], softmax_scale=scale)
        tight = T.attend_bound(q16, *args[1:], scale, 0.0, splits) + 2 * u * np.abs(
            T.dequant_rows(*args[1:])).max(axis=(2, 3))[..., None, None]
        T.assert_attend_close(out, ref16, tight, 1e-2)
    return np.asarray(out)


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
def test_sparse_attend_matches_definition(impl, case, dtype):
    b, r, h, c, w, bs, mb, kw, _ = ATTEND_CASES[case]
    args = T.attend_inputs(10 * case + len(dtype), b, r, h, c, w, bs, mb, dtype)
    _check_attend(impl, args, 0.3, **kw)


# GLM-5.3-Flash on the GPU: the twin, the Triton kernel, and (fp8 caches) the Mosaic GPU one.
GLM_ATTEND = [(impl, backend, heads, dtype) for heads in (8, 64) for dtype in CACHE_DTYPES
              for impl, backend in (("xla", "triton"), ("pallas", "triton"),
                                    ("pallas", "mosaic"))
              if backend == "triton" or dtype == "float8_e4m3fn"]


@pytest.mark.gpu
@pytest.mark.parametrize("impl,backend,heads,dtype", GLM_ATTEND)
def test_sparse_attend_at_glm53_flash_shapes(impl, backend, heads, dtype):
    """C 512, W 2051 (top-k 2048 + tail 3), 64-token blocks, a 4K context; 8 heads per rank
    at TP 8 and 64 at TP 1; split counts planned for the GPU (at most 16)."""
    cfg = glm53_flash(max_context=4096)
    args = T.attend_inputs(heads + len(dtype), 2, 2, heads, cfg.kv_lora_rank, cfg.sel_width,
                           cfg.block_size, cfg.blocks_per_seq, dtype, empty=[(1, 1)])
    options = {"tuning": AttendTuning("triton")} if backend == "triton" else {}
    out = _check_attend(impl, args, cfg.qk_nope_head_dim ** -0.5, backend, splits=16,
                        **(options if impl != "xla" else {}))
    assert (out[1, 1] == 0).all()


# (B, R attended, Rt rows per sequence, H, C, W, bs, blocks per seq): the Mosaic case at the
# kernel's shapes (64 heads, C 512, fp8), both with split counts that run the merge and not.
PADDED_CASES = {"triton": (3, 2, 4, 5, 24, 37, 8, 6), "mosaic": (3, 1, 4, 64, 512, 300, 16, 24)}


@pytest.mark.parametrize("backend,splits", [("triton", 2), ("triton", 1),
                                            pytest.param("mosaic", 2, marks=pytest.mark.gpu),
                                            pytest.param("mosaic", 1, marks=pytest.mark.gpu)])
def test_sparse_attend_writes_a_decodes_padded_block(impl, backend, splits):
    """`rows`, `fill` and `out_dtype` (a decode's attend: the first rows of its max_verify rows,
    in a block padded with fill rows, in the output projection's dtype): the attended rows are
    the plain call's output on those rows alone, rounded, bit for bit; the others exactly fill
    (0, or NaN for a real row past the caller's promise), whatever q and sel hold there."""
    if backend == "mosaic" and impl != "pallas":
        pytest.skip("the Mosaic GPU kernel compiles for a GPU only")
    b, r, rt, h, c, w, bs, mb = PADDED_CASES[backend]
    q, lat, kv, tables, sel = T.attend_inputs(5 + splits, b, rt, h, c, w, bs, mb,
                                              "float8_e4m3fn")
    sel = sel.at[1, 0].set(-1)  # an empty row: 0 in the block too
    fill = jnp.zeros((b, rt)).at[2, r].set(jnp.nan)  # [B, R]
    opts = dict(num_splits=splits, tuning=AttendTuning(backend))
    if impl == "xla":
        run = jax.jit(functools.partial(sparse_attend_xla, softmax_scale=0.3),
                      static_argnames=("out_dtype", "rows"))
    else:
        run = functools.partial(dsa_jax.implementation.OPS["sparse_attend"].kernel,
                                softmax_scale=0.3, interpret=impl == "pallas-interpret", **opts)
    plain = run(q[:, :r], lat, kv, tables, sel[:, :r])  # those rows alone
    plain = np.asarray(plain.astype(jnp.bfloat16), np.float32)
    got = run(q, lat, kv, tables, sel, out_dtype=jnp.bfloat16, rows=r, fill=fill)
    assert got.shape == (b, rt, h, c) and got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    assert np.array_equal(got[:, :r], plain) and not np.isnan(plain).any()
    assert (got[1, 0] == 0).all() and (np.abs(got[0, 0]) > 0).any()
    assert (got[:2, r:] == 0).all() and (got[2, r + 1:] == 0).all()
    assert np.isnan(got[2, r]).all()


def test_sparse_attend_rows_need_a_fill():
    q, lat, kv, tables, sel = T.attend_inputs(3, 2, 3, 5, 24, 37, 8, 6, "float8_e4m3fn")
    for rows, fill, msg in ((1, None, "needs fill"), (1, jnp.zeros((2, 2)), "needs fill"),
                            (4, jnp.zeros((2, 3)), "rows=4")):
        with pytest.raises(ValueError, match=msg):
            sparse_attend_xla(q, lat, kv, tables, sel, softmax_scale=0.3, rows=rows, fill=fill)


def test_sparse_attend_empty_rows_are_exactly_zero(impl):
    q, lat, kv, tables, sel = T.attend_inputs(3, 2, 3, 5, 24, 37, 8, 6, "float8_e4m3fn")
    sel = sel.at[0, 1].set(-1).at[1, 2].set(-1)
    out = np.asarray(T.run_op("sparse_attend", impl, q, lat, kv, tables, sel, softmax_scale=0.3,
                              kernel_options=dict(block_w=16, num_splits=2)))
    assert not np.isnan(out).any()
    assert (out[0, 1] == 0).all() and (out[1, 2] == 0).all()
    assert (np.abs(out[0, 0]) > 0).any()
    # A whole batch with nothing selected.
    none = T.run_op("sparse_attend", impl, q, lat, kv, tables, jnp.full_like(sel, -1),
                    softmax_scale=0.3)
    assert (np.asarray(none) == 0).all()


def test_sparse_attend_split_counts_agree(kernel_impl):
    """Splitting a row's slots across programs only reorders fp32 sums (merge included)."""
    args = T.attend_inputs(4, 1, 2, 3, 40, 70, 16, 5, "float32")
    outs = [np.asarray(T.run_op("sparse_attend", kernel_impl, *args, softmax_scale=0.3,
                                kernel_options=dict(block_w=16, num_splits=k)))
            for k in (1, 5)]
    for o in outs[1:]:
        chex.assert_trees_all_close(o, outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())


def test_sparse_attend_live_rows_hint_only_moves_the_split(kernel_impl):
    """Planning the split for fewer live rows (a padded decode) gives more splits: the same
    result up to fp32 reordering, and the padded rows stay exactly 0."""
    q, lat, kv, tables, sel = T.attend_inputs(6, 4, 4, 20, 24, 70, 8, 10, "float32")
    sel = sel.at[:, 1:].set(-1)  # rows padded as decode pads them
    args = (q, lat, kv, tables, sel)

    def run(**kw):
        return np.asarray(T.run_op("sparse_attend", kernel_impl, *args, softmax_scale=0.3,
                                   kernel_options=dict(block_w=16, **kw)))

    outs = [run(live_rows=lr) for lr in (None, 4)]
    # 2 head blocks of 16; 5 tiles of 16 slots: 16 rows plan 4 splits, 4 live rows plan 5
    # (the plan is the only thing the hint changes: the same bits as those split counts).
    T.assert_trees_bitwise_equal(outs, [run(num_splits=4), run(num_splits=5)])
    chex.assert_trees_all_close(outs[1], outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())
    assert (outs[1][:, 1:] == 0).all() and (np.abs(outs[1][:, 0]) > 0).any()


def test_sparse_attend_stops_at_each_rows_live_extent(impl):
    """Selections laid out as the selection writes them (a prefix of slots, then -1): prefixes
    ending before, on and after tile (16) and split boundaries, and rows with nothing; the
    kernel stops at each row's last slot and must still match the definition."""
    q, lat, kv, tables, sel = T.attend_inputs(5, 2, 4, 5, 24, 70, 8, 10, "float8_e4m3fn")
    ends = jnp.array([[0, 1, 15, 16], [17, 33, 69, 70]], jnp.int32)  # [B, R] prefix lengths
    sel = jnp.where(jnp.arange(70)[None, None, :] < ends[..., None], jnp.abs(sel), -1)
    out = _check_attend(impl, (q, lat, kv, tables, sel), 0.3, block_w=16, num_splits=3)
    assert (out[0, 0] == 0).all()
    chex.assert_trees_all_equal(live_extent(sel.reshape(8, 70)),
                                  ends.reshape(8))


# ------------------------------------------------------------------------------- pool scores

def _check_pool(impl, args, **kernel_options):
    out = T.run_op("pool_scores", impl, *args, kernel_options=kernel_options)
    bound = T.pool_scores_bound(*args[:3], T.pool_scores_roundoff(impl))
    T.assert_pool_scores_close(out, T.pool_scores_definition(*args), bound)
    return np.asarray(out)


@pytest.mark.parametrize("shape", [
    (2, 3, 3, 12, 37),  # odd Hi, Di, P; one partial tile
    (3, 2, 5, 20, 100),  # a partial tile past P; 2 rows per sequence
    (1, 4, 32, 128, 70),  # GLM Hi, Di
])
def test_pool_scores_matches_definition(impl, shape):
    _check_pool(impl, T.pool_inputs(sum(shape), *shape))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_pool_scores_at_glm53_flash_shapes(impl):
    """Hi 32, Di 128, P 4096 (a 16K context in pools of 4); 3 rows per sequence."""
    cfg = glm53_flash()
    _check_pool(impl, T.pool_inputs(7, 2, 3, cfg.index_n_heads, cfg.index_head_dim,
                                    cfg.num_pools))


def test_pool_scores_tiles_past_the_candidates(kernel_impl):
    """Candidate counts on, before and after 64-pool tile edges, and 0 (a padded row): the
    kernel skips the tiles with no candidate; scores and -inf must still match."""
    qi, w, keys, _ = T.pool_inputs(8, 2, 4, 5, 20, 200)
    n_cand = jnp.array([[0, 63, 64, 65], [128, 129, 199, 200]], jnp.int32)
    out = _check_pool(kernel_impl, (qi, w, keys, n_cand))
    assert np.isneginf(out[0, 0]).all()


def test_pool_scores_negative_zero_is_normalized(impl):
    """Keys opposite every query: all dots < 0, relu gives 0, w < 0 makes -0.0 naively."""
    qi, w, keys, n_cand = T.pool_inputs(7, 2, 3, 3, 12, 37)  # a shape above: no recompile
    qi = jnp.abs(qi)
    keys = -jnp.abs(keys)
    w = -jnp.abs(w)
    n_cand = jnp.full_like(n_cand, 37)
    out = np.asarray(T.run_op("pool_scores", impl, qi, w, keys, n_cand))
    assert (out == 0).all() and not np.signbit(out).any()


# ---------------------------------------------------------------------------------- pool top-k

def _check_topk(impl, s, k):
    out = np.asarray(T.run_op("pool_topk", impl, s, k))
    chex.assert_trees_all_equal(out, T.topk_definition(s, k), strict=True)
    assert all(len(set(row)) == k for row in out.reshape(-1, k))  # distinct pools


@pytest.mark.parametrize("n,p,k,live", [
    (4, 4096, 512, [4096, 0, 0, 0]),  # a decode row padded to max_verify, GLM's P and k
    (3, 300, 37, [300, 150, 37]),  # P, k not powers of two; live == k
    (3, 1000, 200, [1000, 511, 3]),  # live < k
    (2, 64, 64, [64, 33]),  # k == P
    (2, 70, 1, [70, 0]),  # k == 1
])
@pytest.mark.parametrize("ties", [False, True])
def test_pool_topk_equals_the_total_order(impl, n, p, k, live, ties):
    """The indices of the total order, bit for bit: ties (lower index first), -inf tails,
    -0.0 below +0.0, rows with fewer candidates than k. Under "xla" this is lax.top_k, whose
    documented tie rule the selection relies on."""
    _check_topk(impl, T.topk_scores(n + p + k, n, p, live, ties), k)


def _exit_cases(p: int, k: int) -> np.ndarray:
    """Rows that stop the radix select at different passes, or never: [4, P] f32.
    0: exactly k positive scores (the first 2-bit pass, on the sign, finds k keys >= 0);
    1: the k-th and (k+1)-th largest scores one ulp apart (a pass near the last separates them);
    2: the (k-1)-th, k-th and (k+1)-th equal (no threshold has exactly k: the tie rule);
    3: random distinct scores (an exit somewhere in the middle)."""
    rng = np.random.default_rng(31)
    rows = np.empty((4, p), np.float32)
    rows[0] = -rng.random(p).astype(np.float32) - 1.0
    rows[0, rng.permutation(p)[:k]] = rng.random(k).astype(np.float32) + 0.5
    base = rng.random(p).astype(np.float32)
    order = np.argsort(-base, kind="stable")
    kth = base[order[k - 1]]
    rows[1] = base
    rows[1, order[k]] = np.nextafter(kth, np.float32(-1.0))  # one ulp below the k-th
    rows[2] = base
    rows[2, order[k - 2:k + 1]] = kth
    rows[3] = rng.standard_normal(p).astype(np.float32)
    return rows


def test_pool_topk_radix_early_exit(impl):
    """The radix select stops where a threshold has exactly k keys at or above it (rows 0, 3),
    at the last pass (1), or runs every pass and breaks the tie by index (2): the same
    indices as the total order in each case, with `==`."""
    p, k = 1000, 200
    _check_topk(impl, jnp.asarray(_exit_cases(p, k)), k)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_pool_topk_at_glm53_flash_shapes(impl):
    """k 512 of P 4096, as the layer feeds it: a padded decode, a 3-row verify, ties."""
    cfg = glm53_flash()
    p, k = cfg.num_pools, cfg.select_k
    for ties in (False, True):
        live = [p, 0, 0, 0, p, p, p, 0, p // 2 + 1, k, k - 1, 3]
        _check_topk(impl, T.topk_scores(11 + ties, len(live), p, live, ties), k)
    _check_topk(impl, jnp.asarray(_exit_cases(p, k)), k)  # the radix select's exits


def test_pool_topk_batch_dims_and_bad_k(kernel_impl):
    s = T.topk_scores(3, 6, 50, [50, 40, 30, 20, 10, 0], ties=True).reshape(2, 3, 50)
    out = T.run_op("pool_topk", kernel_impl, s, 20)
    chex.assert_shape(out, (2, 3, 20))
    chex.assert_type(out, jnp.int32)
    chex.assert_trees_all_equal(out, T.topk_definition(s, 20))
    with pytest.raises(ValueError, match="k=51"):
        T.run_op("pool_topk", kernel_impl, s, 51)


# ------------------------------------------------------------------------------- the layer

def test_layer_kernels_match_xla(kernel_impl):
    """Prefill past the selection budget, then decode, on the tiny config (fp8 cache): same
    selections, outputs within the attention kernel's bf16 operand error (rel 1e-2)."""
    base = tiny()
    weights = dsa_jax.init_random_weights(base, jax.random.key(0))
    b, prompt, steps = 2, 70, 2
    x = T.random_rows(1, b, prompt + steps, base.hidden_size)
    tables = T.permuted_block_tables(base, b, 2)
    results = {}
    for impl in ("xla", kernel_impl):
        cfg = base.replace(implementation=impl)
        state = dsa_jax.init_state(cfg, b, kv_scale=0.05, block_tables=tables)
        results[impl] = T.prefill_then_decode(cfg, weights, state, x, prompt)[:2]
    (y_x, sel_x), (y_p, sel_p) = results["xla"], results[kernel_impl]
    chex.assert_trees_all_equal(sel_p, sel_x, strict=True)
    assert ((sel_x[:, -1] >= 0).sum(-1) < prompt + steps).all()  # the selection bites
    assert not np.isnan(y_p).any()
    T.assert_rel_close(y_p, y_x, 1e-2, "layer output")
