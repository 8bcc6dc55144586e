"""The selection kernels on odd shapes against the definitions: the same checks as
tests/test_kernels.py, under "pallas-interpret" (any backend) and "pallas" (compiled; `gpu`
marker).

Pool scores within the derived bound (`testing.pool_scores_bound`), -inf exactly past each
row's candidates, and a row's scores the same bits however the kernel schedules it: alone or
with its sequence's other rows (a decode's one row per program branching past the dead tiles,
a prompt's two rows per program looping over the live tiles only), over a range of sequences
or of pools. Top-k: the indices of the total order with `==`, ties, -inf tails, rows with
fewer candidates than k and rows with none.
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


# Hi 3, Di 12 (padded to 16), P 150 (tiles of 64: the last one partial).
HI, DI, P = 3, 12, 150
# Candidate counts on, before and after the tile edges (64, 128), 0 (a padded row), all.
COUNTS = [0, 1, 63, 64, 65, 100, 127, 128, 129, 150]


def _n_cand(b, r, seed=0):
    """[B, R] int32: COUNTS in a different order for each sequence, cycled over R."""
    rng = np.random.default_rng(seed)
    return np.stack([np.resize(rng.permutation(COUNTS), r) for _ in range(b)]).astype(np.int32)


@pytest.mark.parametrize("b,r", [
    (3, 1),  # decode rows: one per program
    (2, 4),  # a verify's rows
    (2, 5),  # two per program, one tile per program: the last row group padded
    (2, 10),  # a prompt's rows: two per program, over their live tiles only
])
def test_pool_scores_row_schedules(kernel_impl, b, r):
    """Every row schedule the kernel picks by rows per sequence, within the bound, -inf past
    the candidates (rows with none: all -inf); compiled, each row's bits those of the row
    scored alone (one row per program, branching past the dead tiles). In interpret mode the
    program's head sum is an XLA:CPU reduce over its [tile, rows, heads] block, whose
    vectorization (so its order) follows the block's shape: there a row scored alone is
    within the kernels' bound of it, not its bits."""
    qi, w, keys, _ = T.pool_inputs(11 + r, b, r, HI, DI, P)
    n_cand = _n_cand(b, r)
    out = _scores(kernel_impl, (qi, w, keys, n_cand))
    assert np.isneginf(out[n_cand == 0]).all()
    alone = np.concatenate([_scores(kernel_impl, (qi[:, i:i + 1], w[:, i:i + 1], keys,
                                                  n_cand[:, i:i + 1])) for i in range(r)], 1)
    if kernel_impl == "pallas":
        chex.assert_trees_all_equal(out, alone)
    else:
        T.assert_pool_scores_close(out, alone, T.pool_scores_bound(qi, w, keys))


def test_pool_scores_schedule_rules():
    """Rows per program, the loop and the chunks per row group follow from the shape: a
    prompt's rows (more than PROMPT_ROWS per sequence) loop over their live tiles in about
    PROMPT_PROGRAMS_PER_SM programs per multiprocessor; decode and verify rows take two tiles
    per program where MIN_PROGRAMS_PER_SM programs per multiprocessor remain, else one."""
    assert [ps.default_rows_per_program(r) for r in (1, 4, 5, 9000)] == [1, 1, 2, 2]
    assert not ps.prompt_shaped(ps.PROMPT_ROWS) and ps.prompt_shaped(ps.PROMPT_ROWS + 1)
    split = ps.chunk_split
    assert split(64, 64, False, 132) == (32, 2)  # 2048 programs: two tiles each
    assert split(2, 64, False, 132) == (64, 1)  # 64 programs: one tile each
    assert split(64, 32, True, 132) == (8, 4)  # 528 programs in all
    assert split(2, 32, True, 132) == (32, 1)  # at most one chunk per tile
    assert split(4500, 64, True, 132) == (1, 64)  # a 9000-row prompt: one chunk per group
    assert split(3, 7, True, 2) == (3, 3)  # 3 chunks of 3 tiles: the last holds one
    assert ps.chunk_split(2, 64, False) == split(2, 64, False, ps.sm_count())


@pytest.mark.parametrize("first,count,r", [
    (0, 2, 1),
    (3, 2, 4),  # fewer programs than the batch's
    (4, 1, 5),  # the last sequence, a padded row group
    (1, 3, 10),  # a prompt's rows
])
def test_pool_scores_seq_range_is_those_rows_of_the_whole_batch(impl, first, count, r):
    """`seqs=(first, count)` (a tp rank's share, `sharding.split_select`): `[count, R, P]`,
    equal with `==` to rows first .. first + count - 1 of the whole batch's result, whether
    first is static or traced (a rank's `axis_index * share`)."""
    import jax
    qi, w, keys, _ = T.pool_inputs(13, 5, r, HI, DI, P)
    n_cand = _n_cand(5, r, 1)
    whole = np.asarray(T.run_op("pool_scores", impl, qi, w, keys, n_cand))
    got = T.run_op("pool_scores", impl, qi, w, keys, n_cand, seqs=(first, count))
    chex.assert_trees_all_equal(np.asarray(got), whole[first:first + count], strict=True)
    if impl == "xla":
        def traced(f, *args):  # operands as arguments: XLA would fold constants otherwise
            return ps.pool_scores_xla(*args, seqs=(f, count))
    else:
        def traced(f, *args):
            return ps.pool_scores_pallas(*args, seqs=(f, count),
                                         interpret=impl == "pallas-interpret")
    got = jax.jit(traced)(np.int32(first), qi, w, keys, n_cand)
    chex.assert_trees_all_equal(np.asarray(got), whole[first:first + count], strict=True)
    assert np.isfinite(whole[first:first + count]).any()  # the rows compared hold scores


@pytest.mark.parametrize("r", [4, 10])
def test_pool_scores_of_bf16_keys(impl, r):
    """Pool keys as a bf16 index cache stores them, read in place and widened exactly: within
    the derived bound of the definition on the stored values; the twin and interpret mode
    (IEEE fp32 dots) `==` to the same path given those values widened to fp32 beforehand. The
    compiled Triton kernel is held to the bound only: its 3-pass tf32 dot of a widened bf16
    operand gave other last bits than of the same values in fp32 (on the H200)."""
    import jax.numpy as jnp
    qi, w, keys, _ = T.pool_inputs(11, 2, r, HI, DI, P)
    keys16 = keys.astype(jnp.bfloat16)
    args = (qi, w, keys16, _n_cand(2, r))
    out = np.asarray(T.run_op("pool_scores", impl, *args))
    bound = T.pool_scores_bound(qi, w, keys16, T.pool_scores_roundoff(impl))
    T.assert_pool_scores_close(out, T.pool_scores_definition(*args), bound)
    if impl != "pallas":
        wide = T.run_op("pool_scores", impl, qi, w, keys16.astype(jnp.float32), _n_cand(2, r))
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


@pytest.mark.parametrize("r", [5, 10])  # two rows per program; a prompt's live-tile loop
def test_pool_scores_pool_range_is_the_layers_keys(impl, r):
    """`pools=(base, P)` on keys stacked along the pool axis (the scanned model's full layers)
    gives, with `==`, the scores of that layer's keys alone, base static or traced, for every
    implementation; with `seqs` too. A partial last tile's pools past P are the next layer's."""
    import jax
    qi, w, keys, _ = T.pool_inputs(17, 3, r, HI, DI, P)
    n_cand = _n_cand(3, r, 2)
    stack = _stacked(keys, 3, 5)
    alone = np.asarray(T.run_op("pool_scores", impl, qi, w, keys, n_cand))
    got = T.run_op("pool_scores", impl, qi, w, stack, n_cand, pools=(P, P))
    chex.assert_trees_all_equal(np.asarray(got), alone, strict=True)
    fn = (ps.pool_scores_xla if impl == "xla" else functools.partial(
        ps.pool_scores_pallas, interpret=impl == "pallas-interpret"))
    traced = jax.jit(lambda base, *a: fn(*a, pools=(base, P)))
    chex.assert_trees_all_equal(np.asarray(traced(np.int32(P), qi, w, stack, n_cand)),
                                alone, strict=True)
    both = jax.jit(lambda base, *a: fn(*a, pools=(base, P), seqs=(1, 2)))
    chex.assert_trees_all_equal(np.asarray(both(np.int32(P), qi, w, stack, n_cand)),
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


# ---------------------------------------------------------------------------------- top-k

TOPK_CASES = [
    (4, 300, 37, [300, 0, 150, 37]),  # P, k not powers of two; a padded row; live == k
    (3, 300, 60, [300, 200, 3]),  # live < k: the -inf key is the k-th
    (2, 64, 64, [64, 0]),  # k == P
    (2, 1000, 200, [1000, 511]),  # P padded to 1024
]


def test_pool_topk_equals_the_total_order_on_ties(kernel_impl):
    """The kernel's indices are the total order's, `==`: ties (rounded scores), -inf tails,
    rows with fewer candidates than k and rows with none."""
    for i, (n, p, k, live) in enumerate(TOPK_CASES):
        for ties in ((False, True) if i == 0 else (True,)):  # rounded scores: many ties
            s = T.topk_scores(7 * i + ties, n, p, live, ties)
            out = np.asarray(T.run_op("pool_topk", kernel_impl, s, k,
                                      kernel_options=dict(backend="pallas")))
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


def test_pool_topk_rows_past_the_kernel_raise():
    """A row is held in registers: rows of more than KERNEL_MAX_P pools are refused (the
    library runs lax.top_k for them: `implementation.pool_topk_op`)."""
    import jax.numpy as jnp
    s = jnp.zeros((1, pt.KERNEL_MAX_P + 1))
    with pytest.raises(ValueError, match="KERNEL_MAX_P=4096"):
        pt.pool_topk_pallas(s, 8, interpret=True)
    with pytest.raises(ValueError, match="KERNEL_MAX_P=4096"):
        pt.topk_part(s, 8, interpret=True)


@pytest.mark.parametrize("op,tuning", [
    ("scores", ps.PoolScoresTuning(backend="triton")),  # (auto: the Mosaic kernel)
    ("scores-range", ps.PoolScoresTuning(backend="triton")),
    ("scores-prompt", ps.PoolScoresTuning(backend="triton")),
    ("topk", pt.PoolTopkTuning(backend="pallas")),  # (auto, compiled: the raw Triton kernel)
    ("topk", pt.PoolTopkTuning()),  # 4 rows: the Pallas kernel
    ("expand", pt.PoolTopkTuning()),
])
def test_kernels_lower_for_cuda(op, tuning):
    """The Triton lowering runs on any host (`lower(lowering_platforms=("cuda",))`), and
    refuses what interpret mode accepts (a loop or branch yielding a literal): lower the
    kernels at GLM-5.3-Flash shapes here, so such a kernel fails before the device."""
    import functools

    import jax
    import jax.numpy as jnp
    f32, i32 = jnp.float32, jnp.int32
    if op.startswith("scores"):
        r = 50 if op == "scores-prompt" else 4  # a prompt's rows: the live-tile loop

        def fn(qi, w, keys, n_cand, first):  # a traced first sequence, as a tp rank's
            return ps.pool_scores_pallas(qi, w, keys, n_cand, tuning=tuning,
                                         seqs=(first, 2) if op == "scores-range" else None)
        args = (jax.ShapeDtypeStruct((4, r, 32, 128), f32),
                jax.ShapeDtypeStruct((4, r, 32), f32),
                jax.ShapeDtypeStruct((4, 4096, 128), f32), jax.ShapeDtypeStruct((4, r), i32),
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
def test_select_slots_equal_the_expanded_top_k(impl, tail):
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
                              jnp.asarray(valid))
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
