"""The selection kernels' variants (`PoolScoresTuning`, `PoolTopkTuning` fields added for issue
#14) against the definitions: the same checks as tests/test_kernels.py, on odd shapes, under
"pallas-interpret" (any backend) and "pallas" (compiled; `gpu` marker).

Pool scores within the derived bound (`testing.pool_scores_bound`), -inf exactly past each
row's candidates; a variant that runs the same dots and sums in the same order as the default
(`bounded_loop`, chunk counts) equal to the default with `==`. Top-k: the indices of the total
order with `==`, ties, -inf tails, rows with fewer candidates than k and rows with none.
"""

import functools

import chex
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_topk as pt


def _scores(impl, args, **kw):
    out = np.asarray(T.run_op("pool_scores", impl, *args, kernel_options=kw))
    bound = T.pool_scores_bound(*args[:3], T.pool_scores_roundoff(impl))
    T.assert_pool_scores_close(out, T.pool_scores_definition(*args), bound)
    return out


# B 2, R 5 (a partial row group at 2 and 4 rows per program), Hi 3, Di 12 (padded to 16),
# P 100 (a partial last tile at block_p 16 and 32).
ARGS = (11, 2, 5, 3, 12, 100)


def _n_cand():
    """Candidate counts on, before and after tile edges (16, 32), 0 (a padded row), all."""
    return np.array([[0, 15, 16, 17, 100], [31, 32, 33, 99, 0]], np.int32)


@pytest.mark.parametrize("kw", [
    dict(pools_as_m=True, block_p=16),  # keys x qi^T, one tile per program
    dict(pools_as_m=True, block_p=16, precision="bf16x6"),  # compiled: 6 bf16 products
    dict(pools_as_m=True, block_p=32, rows_per_program=1, num_chunks=2),  # a partial chunk
    dict(pools_as_m=True, block_p=16, rows_per_program=4, bounded_loop=True,
         target_programs=9),  # rows padded to 8 per sequence: the second group has no row
])
def test_pool_scores_pools_as_m(kernel_impl, kw):
    qi, w, keys, _ = T.pool_inputs(*ARGS)
    out = _scores(kernel_impl, (qi, w, keys, _n_cand()), **kw)
    assert np.isneginf(out[0, 0]).all() and np.isneginf(out[1, 4]).all()


@pytest.mark.parametrize("kw", [
    dict(block_p=16, num_chunks=3),  # 7 tiles in 3 chunks of 3: the last one past P
    dict(block_p=32, target_programs=5, rows_per_program=2),  # 6 groups: one chunk each
    dict(block_p=16, target_programs=40, rows_per_program=1),  # 10 groups x 4 chunks
])
def test_pool_scores_bounded_loop_equals_the_branching_loop(kernel_impl, kw):
    """Looping over the live tiles only runs the same dots in the same order: `==`."""
    qi, w, keys, _ = T.pool_inputs(*ARGS)
    args = (qi, w, keys, _n_cand())
    chex.assert_trees_all_equal(_scores(kernel_impl, args, bounded_loop=True, **kw),
                                _scores(kernel_impl, args, **kw))


def test_pool_scores_bf16x6_heads_as_m(kernel_impl):
    qi, w, keys, _ = T.pool_inputs(*ARGS)
    _scores(kernel_impl, (qi, w, keys, _n_cand()), block_p=32, precision="bf16x6")


@pytest.mark.parametrize("first,count,kw", [
    (0, 2, dict(block_p=16)),
    (3, 2, dict(block_p=32, num_chunks=2)),  # a partial chunk; fewer programs than the batch's
    (4, 1, dict(block_p=16, rows_per_program=2)),  # the last sequence, a padded row group
    (1, 3, dict(block_p=16, rows_per_program=4, bounded_loop=True, target_programs=9)),
])
def test_pool_scores_seq_range_is_those_rows_of_the_whole_batch(impl, first, count, kw):
    """`seqs=(first, count)` (a tp rank's share, `sharding.split_select`): `[count, R, P]`,
    equal with `==` to rows first .. first + count - 1 of the whole batch's result, whether
    first is static or traced (a rank's `axis_index * share`)."""
    import jax
    qi, w, keys, n_cand = T.pool_inputs(13, 5, 5, 3, 12, 100)
    opts = None if impl == "xla" else kw
    whole = np.asarray(T.run_op("pool_scores", impl, qi, w, keys, n_cand, kernel_options=opts))
    got = T.run_op("pool_scores", impl, qi, w, keys, n_cand, kernel_options=opts,
                   seqs=(first, count))
    chex.assert_trees_all_equal(np.asarray(got), whole[first:first + count], strict=True)
    if impl == "xla":
        def traced(f, *args):  # operands as arguments: XLA would fold constants otherwise
            return ps.pool_scores_xla(*args, seqs=(f, count))
    else:
        def traced(f, *args):
            return ps.pool_scores_pallas(*args, seqs=(f, count),
                                         interpret=impl == "pallas-interpret", **kw)
    got = jax.jit(traced)(np.int32(first), qi, w, keys, n_cand)
    chex.assert_trees_all_equal(np.asarray(got), whole[first:first + count], strict=True)
    assert np.isfinite(whole[first:first + count]).any()  # the rows compared hold scores


@pytest.mark.parametrize("kw", [
    dict(block_p=16),
    dict(block_p=32, rows_per_program=2, bounded_loop=True, target_programs=9),
])
def test_pool_scores_of_bf16_keys(impl, kw):
    """Pool keys as a bf16 index cache stores them, read in place and widened exactly: within
    the derived bound of the definition on the stored values; the twin and interpret mode
    (IEEE fp32 dots) `==` to the same path given those values widened to fp32 beforehand. The
    compiled Triton kernel is held to the bound only: its 3-pass tf32 dot of a widened bf16
    operand gave other last bits than of the same values in fp32 (11% of the elements on the
    H200, benchmarks/results/h200-gpu-tests-20261201-s10-call1.log)."""
    import jax.numpy as jnp
    qi, w, keys, _ = T.pool_inputs(*ARGS)
    keys16 = keys.astype(jnp.bfloat16)
    opts = None if impl == "xla" else kw
    args = (qi, w, keys16, _n_cand())
    out = np.asarray(T.run_op("pool_scores", impl, *args, kernel_options=opts))
    bound = T.pool_scores_bound(qi, w, keys16, T.pool_scores_roundoff(impl))
    T.assert_pool_scores_close(out, T.pool_scores_definition(*args), bound)
    if impl != "pallas":
        wide = T.run_op("pool_scores", impl, qi, w, keys16.astype(jnp.float32), _n_cand(),
                        kernel_options=opts)
        chex.assert_trees_all_equal(out, np.asarray(wide))


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["auto", "triton"])  # auto: the Mosaic kernel on a GPU
@pytest.mark.parametrize("rows", [4, 32])  # a decode padded to max_verify; a prompt chunk
def test_pool_scores_seq_range_bits_at_glm53_flash_shapes(rows, backend, key_dtype):
    """The compiled kernel over a tp=2 rank's half of 64 sequences (first traced) against the
    same rows of the whole batch's kernel, `==`: what `sharding.split_select` relies on for
    `sel` to stay bitwise that of one device (GLM-5.3-Flash indexer, 16K context)."""
    import jax
    import jax.numpy as jnp

    from dsa_jax.shapes import glm53_flash
    cfg = glm53_flash()
    qi, w, keys, n_cand = T.pool_inputs(23, 64, rows, cfg.index_n_heads, cfg.index_head_dim,
                                        cfg.num_pools)
    keys = keys.astype(key_dtype)
    tuning = ps.PoolScoresTuning(backend=backend)
    whole = np.asarray(jax.jit(lambda *a: ps.pool_scores_pallas(*a, tuning=tuning))(
        qi, w, keys, n_cand))
    ranged = jax.jit(lambda f, *a: ps.pool_scores_pallas(*a, seqs=(f, 32), tuning=tuning))
    for first in (0, 32, 17):
        got = np.asarray(ranged(jnp.int32(first), qi, w, keys, n_cand))
        np.testing.assert_array_equal(got, whole[first:first + 32])


def _stacked(keys, layers, seed):
    """`keys [B, P, Di]` as layer 1 of `layers` stacked along the pool axis (the model's
    `[B, L*P, Di]`), every other layer's keys random: a read off the range shows."""
    rng = np.random.default_rng(seed)
    b, p, di = keys.shape
    stack = rng.standard_normal((b, layers, p, di)).astype(np.float32) * 3.0
    stack[:, 1] = np.asarray(keys)
    return stack.reshape(b, layers * p, di)


@pytest.mark.parametrize("kw", [
    dict(block_p=16),
    dict(block_p=32, num_chunks=2),  # a partial last tile: its pools past P are the next layer's
    dict(block_p=16, rows_per_program=4, bounded_loop=True, target_programs=9),
])
def test_pool_scores_pool_range_is_the_layers_keys(impl, kw):
    """`pools=(base, P)` on keys stacked along the pool axis (the scanned model's full layers)
    gives, with `==`, the scores of that layer's keys alone, base static or traced, for every
    implementation; with `seqs` too."""
    import jax
    qi, w, keys, n_cand = T.pool_inputs(17, 3, 5, 3, 12, 100)
    stack = _stacked(keys, 3, 5)
    opts = None if impl == "xla" else kw
    alone = np.asarray(T.run_op("pool_scores", impl, qi, w, keys, n_cand, kernel_options=opts))
    got = T.run_op("pool_scores", impl, qi, w, stack, n_cand, kernel_options=opts,
                   pools=(100, 100))
    chex.assert_trees_all_equal(np.asarray(got), alone, strict=True)
    fn = (ps.pool_scores_xla if impl == "xla" else functools.partial(
        ps.pool_scores_pallas, interpret=impl == "pallas-interpret", **kw))
    traced = jax.jit(lambda base, *a: fn(*a, pools=(base, 100)))
    chex.assert_trees_all_equal(np.asarray(traced(np.int32(100), qi, w, stack, n_cand)),
                                alone, strict=True)
    both = jax.jit(lambda base, *a: fn(*a, pools=(base, 100), seqs=(1, 2)))
    chex.assert_trees_all_equal(np.asarray(both(np.int32(100), qi, w, stack, n_cand)),
                                alone[1:3], strict=True)
    assert np.isfinite(alone).any() and np.isneginf(alone).any()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])  # auto: the Mosaic kernel on a GPU
@pytest.mark.parametrize("rows", [4, 32])
def test_pool_scores_pool_range_bits_at_glm53_flash_shapes(rows, backend):
    """The compiled kernels reading full layer 1's keys in place from a stack of 3 (the scanned
    model's `[B, Lf*P, Di]`, base traced) against the same layer's keys alone, `==`."""
    import jax
    import jax.numpy as jnp

    from dsa_jax.shapes import glm53_flash
    cfg = glm53_flash()
    p = cfg.num_pools
    qi, w, keys, n_cand = T.pool_inputs(29, 8, rows, cfg.index_n_heads, cfg.index_head_dim, p)
    stack = jnp.asarray(_stacked(keys, 3, 7))
    tuning = ps.PoolScoresTuning(backend=backend)
    alone = np.asarray(jax.jit(lambda *a: ps.pool_scores_pallas(*a, tuning=tuning))(
        qi, w, keys, n_cand))
    ranged = jax.jit(lambda base, *a: ps.pool_scores_pallas(*a, pools=(base, p), tuning=tuning))
    np.testing.assert_array_equal(np.asarray(ranged(jnp.int32(p), qi, w, stack, n_cand)), alone)


@pytest.mark.parametrize("fn", [ps.pool_scores_xla, ps.pool_scores_pallas])
@pytest.mark.parametrize("kw,msg", [
    (dict(seqs=(0, 6)), r"seqs count=6 must be a static int in \[1, B=5\]"),
    (dict(seqs=(4, 2)), r"seqs first=4 with count=2 must lie in \[0, B - count = 3\]"),
    (dict(pools=(0, 41)), r"pools count=41 must be a static int in \[1, 40\]"),
    (dict(pools=(30, 20)),
     r"pools base=30 with count=20 must lie in \[0, 20\] \(the keys' pool axis holds 40\)"),
])
def test_pool_scores_range_errors(fn, kw, msg):
    qi, w, keys, n_cand = T.pool_inputs(13, 5, 2, 3, 12, 40)
    with pytest.raises(ValueError, match=msg):
        fn(qi, w, keys, n_cand, **kw)


def test_pool_scores_unknown_precision_raises():
    qi, w, keys, n_cand = T.pool_inputs(*ARGS)
    with pytest.raises(ValueError, match="precision='tf32'"):
        ps.pool_scores_pallas(qi, w, keys, n_cand, interpret=True, precision="tf32")


def test_pool_scores_prompt_rows_take_the_bounded_loop(kernel_impl):
    """A prompt chunk (10 rows of one sequence, causal candidate counts): the default loops over
    live tiles only; the same dots as one tile per program, so `==`."""
    qi, w, keys, _ = T.pool_inputs(12, 1, 10, 3, 12, 100)
    n_cand = np.array([[0, 1, 15, 16, 17, 40, 63, 64, 65, 100]], np.int32)
    args = (qi, w, keys, n_cand)
    chex.assert_trees_all_equal(_scores(kernel_impl, args, block_p=16),
                                _scores(kernel_impl, args, block_p=16, bounded_loop=False))


def test_pool_scores_resolve_tuning():
    """bounded_loop None: a prompt's rows (more than PROMPT_ROWS per sequence) loop over their
    live tiles, PROMPT_PROGRAMS_PER_SM programs per multiprocessor; decode and verify rows run
    one tile per program; explicit fields are kept."""
    from dsa_jax.pallas.common import sm_count
    auto = ps.PoolScoresTuning()
    assert ps.resolve_tuning(auto, 4) == ps.PoolScoresTuning(bounded_loop=False)
    assert auto.pools_as_m and auto.block_p == 64
    prompt = ps.resolve_tuning(auto, ps.PROMPT_ROWS + 1)
    assert prompt.bounded_loop and prompt.target_programs == ps.PROMPT_PROGRAMS_PER_SM * sm_count()
    assert ps.resolve_tuning(ps.PoolScoresTuning(num_chunks=3), 100).target_programs is None
    fixed = ps.PoolScoresTuning(bounded_loop=False)
    assert ps.resolve_tuning(fixed, 9000) == fixed


def test_pool_scores_chunk_split():
    """target_programs -> chunks per row group; an explicit num_chunks wins; none is empty."""
    split = ps.chunk_split
    assert split(ps.PoolScoresTuning(), 64, 64) == (32, 2)  # 2048 programs: two tiles each
    assert split(ps.PoolScoresTuning(), 2, 64) == (64, 1)  # 64 programs: one tile each
    assert split(ps.PoolScoresTuning(tiles_per_program=3), 2, 64) == (22, 3)
    assert split(ps.PoolScoresTuning(target_programs=528), 64, 32) == (8, 4)
    assert split(ps.PoolScoresTuning(target_programs=528), 2, 32) == (32, 1)
    assert split(ps.PoolScoresTuning(target_programs=528, num_chunks=3), 64, 7) == (3, 3)
    assert split(ps.PoolScoresTuning(num_chunks=5), 1, 7) == (4, 2)  # 2+2+2+1 tiles


# ---------------------------------------------------------------------------------- top-k

TOPK_CASES = [
    (4, 300, 37, [300, 0, 150, 37]),  # P, k not powers of two; a padded row; live == k
    (3, 300, 60, [300, 200, 3]),  # live < k: the -inf key is the k-th
    (2, 64, 64, [64, 0]),  # k == P
]


@pytest.mark.parametrize("kw", [
    dict(short_rows=True),  # (rank "sort", the winners sorted by a bitonic network)
    dict(rank="compare"),  # each winner's rank counted against the k
    dict(rank="compare", rank_splits=3),  # 37 winners in 2 blocks of 32: the third ranks none
    dict(rank="compare", fused_compare=True, rank_block=16),
    dict(rank="compare", short_rows=True, rank_splits=4, fused_compare=True, rank_block=16),
    dict(radix_bits=3),  # a 2-bit pass, then 10 passes of 3 bits
    dict(early_exit=False),  # every radix pass
    dict(rank_splits=3, short_rows=False),  # each program sorts and stores a share
    dict(select="sample"),  # candidates from the block maxima, sorted whole
    dict(select="sample", rank="compare", rank_splits=2),  # (the radix path: compares)
])
def test_pool_topk_variants_equal_the_total_order(kernel_impl, kw):
    for i, (n, p, k, live) in enumerate(TOPK_CASES):
        for ties in ((False, True) if i == 0 else (True,)):  # rounded scores: many ties
            s = T.topk_scores(7 * i + ties, n, p, live, ties)
            out = np.asarray(T.run_op("pool_topk", kernel_impl, s, k,
                                      kernel_options=dict(backend="pallas", **kw)))
            chex.assert_trees_all_equal(out, T.topk_definition(s, k), strict=True)


@pytest.mark.parametrize("n", [2, 8, 512])
def test_sort_winners_is_the_total_order(n):
    """The bitonic network alone (jnp, as the kernel traces it): keys descending, then indices
    ascending, on random keys over the whole int32 range (wrapping pair sums) and on keys
    with many ties."""
    import jax
    rng = np.random.default_rng(n)
    for wide in (True, False):
        key = (rng.integers(-2 ** 31, 2 ** 31 - 1, n) if wide
               else rng.integers(-3, 3, n)).astype(np.int32)
        idx = rng.permutation(n).astype(np.int32)
        got_k, got_i = jax.jit(pt.sort_winners)(key, idx)
        order = np.lexsort((idx, -key.astype(np.int64)))
        chex.assert_trees_all_equal((np.asarray(got_k), np.asarray(got_i)),
                                    (key[order], idx[order]), strict=True)


@pytest.mark.parametrize("rank", ["compare", "sort"])
def test_pool_topk_sample_fallback(kernel_impl, rank):
    """`select="sample"` where the candidates at or above the block maxima's k-th outnumber
    its scratch (2 Kp): each block's other keys just below its maximum (a row of 512 lanes, k
    37: 145 candidates > 128), and where they fit (a plain random row); both paths `==`."""
    rng = np.random.default_rng(3)
    blocks = np.arange(128, dtype=np.float32)
    crowded = (1000 + blocks[:, None] - np.array([0, 0.5, 0.5, 0.5], np.float32))
    crowded = crowded[rng.permutation(128)].reshape(512)  # [512]: block maxima in one order
    plain = T.topk_scores(11, 1, 512, [512], ties=False)[0]
    s = np.stack([crowded, np.asarray(plain)])  # [2, 512]
    out = T.run_op("pool_topk", kernel_impl, s, 37,
                   kernel_options=dict(select="sample", rank=rank, backend="pallas"))
    chex.assert_trees_all_equal(np.asarray(out), T.topk_definition(s, 37), strict=True)


def test_pool_topk_chunked_row_with_splits(kernel_impl):
    """A row walked in chunks (chunk 256 of 1000), with the ranking split over programs."""
    s = T.topk_scores(5, 3, 1000, [1000, 700, 0], ties=True)
    out = T.run_op("pool_topk", kernel_impl, s, 200,
                   kernel_options=dict(chunk=256, rank_splits=2, short_rows=True,
                                       fused_compare=True, rank="compare", backend="pallas"))
    chex.assert_trees_all_equal(np.asarray(out), T.topk_definition(s, 200), strict=True)


def test_pool_topk_bad_radix_bits(kernel_impl):
    s = T.topk_scores(3, 2, 50, [50, 10], ties=False)
    with pytest.raises(ValueError, match="radix_bits=5"):
        T.run_op("pool_topk", kernel_impl, s, 20,
                 kernel_options=dict(radix_bits=5, backend="pallas"))


@pytest.mark.parametrize("field,value", [("rank", "bubble"), ("select", "guess")])
def test_pool_topk_tuning_names_its_choices(field, value):
    with pytest.raises(ValueError, match=f"{field}='{value}' must be one of"):
        pt.PoolTopkTuning(**{field: value})


def test_pool_topk_default_rank_splits():
    """~128 programs, 2..16 splits up to SPLIT_MAX_ROWS rows, one program per row beyond."""
    got = {n: pt.default_rank_splits(n) for n in (1, 4, 32, 64, 256, 1024, 1025, 9000)}
    assert got == {1: 16, 4: 16, 32: 4, 64: 2, 256: 2, 1024: 2, 1025: 1, 9000: 1}


@pytest.mark.parametrize("op,tuning", [
    ("scores", ps.PoolScoresTuning(backend="triton")),  # (auto: the Mosaic kernel)
    ("scores-range", ps.PoolScoresTuning(backend="triton")),
    ("scores", ps.PoolScoresTuning(pools_as_m=True, bounded_loop=True, block_p=128,
                                   target_programs=528, precision="bf16x6")),
    ("topk", pt.PoolTopkTuning(backend="pallas")),  # (auto, compiled: the raw Triton kernel)
    ("topk", pt.PoolTopkTuning(rank="compare", short_rows=True, rank_splits=8,
                               fused_compare=True, radix_bits=3, num_warps=16,
                               backend="pallas")),
    ("expand", pt.PoolTopkTuning(short_rows=True, rank_splits=4)),
    ("topk", pt.PoolTopkTuning(rank="compare", backend="pallas")),
    ("expand", pt.PoolTopkTuning(rank="compare", rank_splits=2)),
    ("topk", pt.PoolTopkTuning(select="sample", rank="sort", backend="pallas")),
    ("expand", pt.PoolTopkTuning(select="sample", rank="sort")),
])
def test_kernels_lower_for_cuda(op, tuning):
    """The Triton lowering runs on any host (`lower(lowering_platforms=("cuda",))`), and
    refuses what interpret mode accepts (a loop or branch yielding a literal): lower the
    variants at GLM-5.3-Flash shapes here, so such a kernel fails before the device."""
    import functools

    import jax
    import jax.numpy as jnp
    f32, i32 = jnp.float32, jnp.int32
    if op in ("scores", "scores-range"):
        def fn(qi, w, keys, n_cand, first):  # a traced first sequence, as a tp rank's
            return ps.pool_scores_pallas(qi, w, keys, n_cand, tuning=tuning,
                                         seqs=None if op == "scores" else (first, 2))
        args = (jax.ShapeDtypeStruct((4, 4, 32, 128), f32), jax.ShapeDtypeStruct((4, 4, 32), f32),
                jax.ShapeDtypeStruct((4, 4096, 128), f32), jax.ShapeDtypeStruct((4, 4), i32),
                jax.ShapeDtypeStruct((), i32))
    elif op == "topk":
        fn = functools.partial(pt.pool_topk_pallas, k=512, tuning=tuning)
        args = (jax.ShapeDtypeStruct((4, 4096), f32),)
    else:
        def fn(scores, pos, valid):
            return pt.pool_topk_expand_pallas(scores, 512, pos, valid, pt.Expansion(4, 2051, True),
                                              tuning=tuning)

        args = (jax.ShapeDtypeStruct((1, 4, 4096), f32), jax.ShapeDtypeStruct((1, 4), i32),
                jax.ShapeDtypeStruct((1, 4), jnp.bool_))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text  # the kernel, as Triton IR


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("kw", [{}, dict(short_rows=True, rank_splits=3, fused_compare=True,
                                         rank_block=8, rank="compare"),
                                dict(rank_splits=3)])
def test_select_slots_equal_the_expanded_top_k(impl, tail, kw):
    """The top-k kernel writing the token slots (`select.select_slots`) against
    `expand_selection(top_pools(...))` under xla, with `==`: a padded row, positions on and
    off pool edges, rows with fewer complete pools than k, the full context; ties."""
    import jax.numpy as jnp

    from dsa_jax import select, shapes
    cfg = shapes.glm53_flash(max_context=448, index_topk=80, always_select_tail=tail)
    pos = np.array([[447, 0, 2], [40, 301, 447]], np.int32)  # [B, R]
    valid = np.array([[True, True, True], [False, True, True]])
    live = np.where(valid, (pos + 1) // cfg.index_kpool, 0).reshape(-1)
    scores = T.topk_scores(4, 6, cfg.num_pools, live, ties=True).reshape(2, 3, -1)
    want = select.expand_selection(cfg.replace(implementation="xla"),
                                   pt.pool_topk_xla(scores, cfg.select_k), jnp.asarray(pos),
                                   jnp.asarray(valid))
    got = select.select_slots(cfg.replace(implementation=impl), scores, jnp.asarray(pos),
                              jnp.asarray(valid),
                              tuning=pt.PoolTopkTuning(**kw, **(dict(backend="pallas") if kw
                                                               else {})))
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(want), strict=True)
    assert (np.asarray(got)[1, 0] == -1).all()


def test_lone_selection_runs_no_pass_before_its_kernels():
    """`indexer.pool_scores_at` + `select.select_slots` (a lone selection call, as the bench's
    selection points make it) at GLM-5.3-Flash shapes: the Mosaic scores kernel takes each
    row's candidate count and the expanding top-k each row's position from pos and valid
    themselves, so the program is the two kernels and nothing computed before them (the
    counts' pass was a launch of its own)."""
    import jax
    import jax.numpy as jnp

    from dsa_jax import select
    from dsa_jax.shapes import glm53_flash

    cfg = glm53_flash().replace(implementation="pallas")
    b, r = 64, 4
    hi, di, p = cfg.index_n_heads, cfg.index_head_dim, cfg.num_pools

    def lone(qi, w, keys, pos, valid):  # what the two library calls run with "pallas"
        scores = ps.pool_scores_pallas(qi, w, keys, None,
                                       positions=(pos, valid, cfg.index_kpool))
        return pt.pool_topk_expand_pallas(scores, min(cfg.select_k, p), pos, valid,
                                          select.expansion(cfg))

    args = (jax.ShapeDtypeStruct((b, r, hi, di), jnp.float32),
            jax.ShapeDtypeStruct((b, r, hi), jnp.float32),
            jax.ShapeDtypeStruct((b, p, di), cfg.index_cache_dtype),
            jax.ShapeDtypeStruct((b, r), jnp.int32), jax.ShapeDtypeStruct((b, r), jnp.bool_))
    text = jax.jit(lone).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1
    for op in ("stablehlo.select", "stablehlo.divide", "stablehlo.add", "stablehlo.compare"):
        assert op not in text, op


@pytest.mark.parametrize("impl", ["xla", "pallas-interpret",
                                  pytest.param("pallas", marks=pytest.mark.gpu)])
def test_pool_scores_at_is_pool_scores_of_the_candidate_pools(impl):
    """`indexer.pool_scores_at(pos, valid)` == `pool_scores(layer.candidate_pools(pos,
    valid))`, bit for bit, and so is the selection after it (rows with none, invalid rows,
    rows with every pool); on the GPU at GLM-5.3-Flash's indexer shapes (the Mosaic kernel
    taking the counts itself) and the 4-row decode padding."""
    import jax
    import jax.numpy as jnp

    from dsa_jax import indexer, layer, select
    from dsa_jax.shapes import glm53_flash, tiny

    cfg = (glm53_flash() if impl == "pallas" else tiny()).replace(implementation=impl)
    kp, p = cfg.index_kpool, cfg.num_pools
    b, r = (64, 4) if impl == "pallas" else (3, 4)
    qi, w, keys, _ = T.pool_inputs(21, b, r, cfg.index_n_heads, cfg.index_head_dim, p)
    keys = keys.astype(cfg.index_cache_dtype)
    rng = np.random.default_rng(22)
    pos = rng.integers(0, p * kp + kp, (b, r)).astype(np.int32)
    pos[0, 0], pos[-1, -1] = kp - 2, p * kp - 1
    valid = rng.random((b, r)) < 0.6
    valid[0, 0] = valid[-1, -1] = True
    pos, valid = jnp.asarray(pos), jnp.asarray(valid)

    @jax.jit
    def both(qi, w, keys, pos, valid):
        at = indexer.pool_scores_at(cfg, qi, w, keys, pos, valid)
        given = indexer.pool_scores(cfg, qi, w, keys, layer.candidate_pools(cfg, pos, valid))
        return (at, given, select.select_slots(cfg, at, pos, valid),
                select.expand_selection(cfg, select.top_pools(cfg, given), pos, valid))

    at, given, slots, want = both(qi, w, keys, pos, valid)
    np.testing.assert_array_equal(np.asarray(at), np.asarray(given))
    np.testing.assert_array_equal(np.asarray(slots), np.asarray(want))
    assert (np.asarray(slots)[~np.asarray(valid)] == -1).all()
