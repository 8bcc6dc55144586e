"""The indexer ring (dsa_jax.state, "The indexer ring"; docs/decisions.md).

Op level, over step sequences the layout before the ring allowed (prompt chunks longer than
the ring, pools completed inside a chunk, K-row verifies, rewinds within the reach): the
ring's jnp twin against the write before the ring (every raw row kept,
tests/old_index_write.py): pool keys bit for bit, and every row the ring claims to hold equal
to the old cache's row; the Pallas kernel (interpret mode here, compiled under the `gpu`
marker) with a ring of RING rows against the same kernel with a ring of every position (the
same bits), and against the jnp twin (within a bound derived from KP and the cache dtype).
Layer level: rewinds within the reach, past it (refused, before anything changes), to a pool
boundary (allowed at any depth), and a mark that a rewind kept.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from old_index_write import index_write_xla as old_twin

import dsa_jax
from dsa_jax import testing as T
from dsa_jax.shapes import ODD, glm53_flash
from dsa_jax.state import (
    ring_from_rows,
    ring_holds,
    ring_reach,
    ring_rows,
    state_bytes_breakdown,
    state_bytes_per_seq,
)

KP, RING, POOLS, DI = 4, 8, 16, 12  # op-level geometry: a ring of 8 rows, 64 positions
EPS32 = float(np.finfo(np.float32).eps)

# (rows per sequence of the step, real rows per sequence, rewind after it to lengths - drop)
STEPS = [(5, [5, 3, 0], [0, 0, 0]),
         (19, [19, 19, 7], [0, 0, 0]),  # longer than the ring: pools complete inside it
         (4, [4, 4, 4], [3, 1, 0]),  # a verify, partly rejected
         (4, [4, 2, 4], [0, 2, 4]),
         (1, [1, 1, 0], [0, 0, 0]),
         (13, [13, 9, 13], [1, 0, 3])]


def _run(impl: str, dtype, seed: int, nan_seq: int | None = None, layers: int = 1,
         layer: int = 0, ring_rows: int = RING):
    """Apply STEPS to a ring state of `ring_rows` rows per layer and to an old full-row state
    (its jnp twin). Returns per step (ring, keys, lengths, marks) of the ring run and (cache,
    keys) of the old one. The steps' rows depend on the seed alone, not on the ring's size."""
    rng = np.random.default_rng(seed)
    b = 3
    ape = jnp.asarray(0.5 * rng.standard_normal((KP, DI)), jnp.float32)
    norm_w = jnp.asarray(1 + 0.3 * rng.standard_normal(DI), jnp.float32)
    norm_b = jnp.asarray(0.3 * rng.standard_normal(DI), jnp.float32)
    junk = np.random.default_rng(seed + 1000)  # the ring's rows before any step: never read
    ring = [jnp.asarray(junk.standard_normal((b, layers * ring_rows, DI))).astype(dtype)
            for _ in range(2)]
    keys = jnp.full((b, layers * POOLS, DI), T.POISON, jnp.float32)
    full = [jnp.zeros((b, POOLS * KP, DI), dtype) for _ in range(2)]
    old_keys = jnp.full((b, POOLS, DI), T.POISON, jnp.float32)
    lengths, marks = np.zeros(b, np.int64), np.zeros(b, np.int64)
    out = []
    for r, counts, drop in STEPS:
        k_raw = rng.standard_normal((b, r, DI)) * 2 + 0.5
        g = rng.standard_normal((b, r, DI))
        if nan_seq is not None:
            k_raw[nan_seq, :, 3] = np.nan
            g[nan_seq, :, 5] = np.inf
        k_raw, g = jnp.asarray(k_raw, jnp.float32), jnp.asarray(g, jnp.float32)
        pos = jnp.asarray(lengths[:, None] + np.arange(r), jnp.int32)
        valid = jnp.asarray(np.arange(r)[None, :] < np.asarray(counts)[:, None])
        *ring, keys = T.run_op("index_write", impl, k_raw, g, norm_w, norm_b, ape, *ring, keys,
                               pos, valid, jnp.int32(layer), layers=layers)
        *full, old_keys = jax.jit(old_twin)(k_raw, g, norm_w, norm_b, ape, *full, old_keys,
                                            pos, valid)
        marks = np.maximum(np.minimum(marks, lengths + ring_rows),
                           lengths + np.asarray(counts))
        lengths = lengths + np.asarray(counts) - np.asarray(drop)
        out.append((ring, keys, lengths.copy(), marks.copy(), full, old_keys))
    return out


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.long), "bfloat16"])
def test_the_kernel_with_a_ring_of_every_position_gives_the_same_bits(kernel_impl, dtype):
    """The ring kernel with a ring of RING rows and with a ring of every position (the layout
    before the ring: every raw row kept, no late-rows launch): the same programs at the same
    warps on the same rows, so the same pool keys bit for bit, and every row the small ring
    claims to hold equal to that position's row. (The kernel before the ring computed the same
    keys with another reduction layout, one warp where the ring kernel runs a decode's rows
    at four, and so could differ from these in the last bit: it is no reference for bits.)"""
    every = POOLS * KP
    small, whole = _run(kernel_impl, dtype, 4), _run(kernel_impl, dtype, 4, ring_rows=every)
    for (ring, keys, lengths, marks, *_), (rows, rows_keys, *_) in zip(small, whole,
                                                                       strict=True):
        T.assert_trees_bitwise_equal(keys, rows_keys)
        for s, p in _held(lengths, marks):
            for a, c in zip(ring, rows, strict=True):
                T.assert_trees_bitwise_equal(a[s, p % RING], c[s, p])


def _held(lengths, marks):
    """(sequence, position) pairs the ring holds: [mark - RING, lengths)."""
    return [(s, p) for s in range(len(lengths))
            for p in range(max(int(marks[s]) - RING, 0), int(lengths[s]))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_write_equals_the_full_row_write_bit_for_bit(dtype):
    """The ring's jnp twin against the twin before the ring: the same keys, the held rows."""
    for ring, keys, lengths, marks, full, old_keys in _run("xla", dtype, 1):
        T.assert_trees_bitwise_equal(keys, old_keys)  # every key, written or still poison
        for s, p in _held(lengths, marks):
            for a, c in zip(ring, full, strict=True):
                T.assert_trees_bitwise_equal(a[s, p % RING], c[s, p])
        # Within the reach the ring holds what every later step of those runs reads.
        assert ring_holds_op(lengths, marks).all()


def ring_holds_op(lengths, marks):
    first = lengths // KP * KP
    return (first == lengths) | (first >= marks - RING)


def _key_bounds(dtype, m: float) -> tuple[float, float]:
    """How far the kernel's pool key may lie from the twin's, both fp32 keys of KP members
    whose largest |k| is at most m: (tight, loose). Both compute K = sum_j e_j k_j / sum_j e_j
    (e_j = exp(g_j + ape_j - max), g the same stored values on both sides) in other orders
    (the twin normalizes the weights first, XLA's exp is not the GPU's): each side's sums of
    KP terms carry at most KP roundings relative to sum e|k| (<= m sum e) and sum e, the
    products, the exp (4 ulps allowed) and the division a few more: within (2 KP + 8) eps32 m
    of the exact key per side. The members k are each side's LayerNorm stored in `dtype`: a
    few fp32 ulps apart (1e-6 relative, as `assert_stored_close`), or a neighbouring code (one
    `storage_step`) where a value sits on a rounding boundary (the loose bound); the key, a
    convex combination of them, moves by at most as much."""
    tight = 2 * (2 * KP + 8) * EPS32 * m + 1e-6 * m
    return tight, tight + T.storage_step(dtype) * m


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.long), "bfloat16"])
def test_ring_kernel_matches_twin(kernel_impl, dtype):
    """Kernel vs jnp twin on every step: the rows as `assert_stored_close`, the keys within
    `_key_bounds` (the loose one for under 1% of them); a second layer's rows of shared
    arrays (the model's scan) written at their offsets, the first layer's left as they
    were."""
    want = _run("xla", dtype, 2, layers=2, layer=1)
    got = _run(kernel_impl, dtype, 2, layers=2, layer=1)
    first = _run("xla", dtype, 2, layers=2, layer=1)[0][0]
    m = max(float(np.abs(np.asarray(full[0].astype(jnp.float32))).max())
            for *_, full, _ in want)  # the largest |k| any step stored
    tight, loose = _key_bounds(dtype, m)
    for (g_ring, g_keys, *_), (w_ring, w_keys, *_) in zip(got, want, strict=True):
        for a, c in zip(g_ring, w_ring, strict=True):
            T.assert_stored_close(a[:, RING:], c[:, RING:], dtype)
        diff = np.abs(np.asarray(g_keys) - np.asarray(w_keys))
        assert (diff <= loose).all(), diff.max()
        assert (diff > tight).mean() < 0.01, (diff > tight).mean()
        assert (np.asarray(g_keys[:, :POOLS]) == T.POISON).all()
    for a, c in zip(got[-1][0], first, strict=True):
        T.assert_trees_bitwise_equal(a[:, :RING], c[:, :RING])


def test_nan_rows_stay_in_their_sequence(layer_impl):
    clean, dirty = _run(layer_impl, "float32", 3), _run(layer_impl, "float32", 3, nan_seq=0)
    for (c_ring, c_keys, *_), (d_ring, d_keys, *_) in zip(clean, dirty, strict=True):
        T.assert_trees_bitwise_equal([a[1:] for a in d_ring], [a[1:] for a in c_ring])
        T.assert_trees_bitwise_equal(d_keys[1:], c_keys[1:])
    assert np.isnan(np.asarray(dirty[-1][1][0, 0])).any()


def test_ring_geometry_refuses_a_ring_smaller_than_a_pool():
    args = list(T.index_write_inputs(0, 4, "float32"))
    args[5], args[6] = args[5][:, :3], args[6][:, :3]
    with pytest.raises(ValueError, match="a ring of 3 rows cannot hold a pool of index_kpool 4"):
        T.run_op("index_write", "xla", *args)


# ------------------------------------------------------------------------------ layer level

def _weights(cfg, seed):
    return dsa_jax.fold_weights(cfg, dsa_jax.init_random_hf_tensors(cfg, jax.random.key(seed)))


def _prefill(cfg, w, x, chunks):
    state, ys = dsa_jax.init_state(cfg, x.shape[0]), []
    at = 0
    for n in chunks:
        y, state, _ = dsa_jax.prefill(cfg, w, state, x[:, at:at + n])
        ys.append(y)
        at += n
    return ys, state


def test_long_chunks_verifies_and_rewinds_equal_plain_decodes():
    """A prompt chunk longer than the ring, then verifies with rejected drafts rewound to
    rows inside a pool: every accepted row, the pool keys and the ring equal plain decodes of
    the same tokens bit for bit."""
    cfg = ODD
    assert ring_rows(cfg) == 16 and ring_reach(cfg) == 10
    w = _weights(cfg, 3)
    x = T.random_rows(4, 2, 60, cfg.hidden_size)
    junk = T.random_rows(5, 2, 4, cfg.hidden_size)
    _, plain = _prefill(cfg, w, x, [37])
    plain_y = []
    for t in range(37, 51):
        y, plain, _ = dsa_jax.decode(cfg, w, plain, x[:, t])
        plain_y.append(y)
    _, spec = _prefill(cfg, w, x, [37])
    got_y, t = [], 37
    for keep, real in [(1, 1), (2, 2), (3, 4), (1, 2), (4, 4), (2, 3)]:
        rows = jnp.concatenate([x[:, t:t + real], junk[:, :4 - real]], axis=1)
        y, spec, _ = dsa_jax.decode_k(cfg, w, spec, rows)
        got_y += [y[:, j] for j in range(keep)]
        t += keep
        spec = dsa_jax.rewind(cfg, spec, [t, t])
    y, spec, _ = dsa_jax.decode(cfg, w, spec, x[:, t])
    got_y.append(y)
    assert t == 50
    T.assert_trees_bitwise_equal(got_y, plain_y)
    # Keys of the complete pools (a rejected verify may have written pool 12's, rewritten
    # when it completes again, as before the ring).
    T.assert_trees_bitwise_equal(spec.pool_keys[:, :51 // 4], plain.pool_keys[:, :51 // 4])
    marks = np.asarray(spec.index_lengths)
    for p in range(int(marks[0]) - 16, 51):  # what the ring holds: the very same rows
        T.assert_trees_bitwise_equal([spec.index_k[:, p % 16], spec.index_g[:, p % 16]],
                                     [plain.index_k[:, p % 16], plain.index_g[:, p % 16]])


def test_rewind_past_the_reach_is_refused_and_to_a_pool_boundary_allowed():
    cfg = ODD
    w = _weights(cfg, 6)
    x = T.random_rows(7, 1, 60, cfg.hidden_size)
    _, state = _prefill(cfg, w, x, [40])
    message = re.escape("cannot rewind to length 27: sequence 0: at length 27 the pool being "
                        "filled needs the indexer rows 24..26, but the indexer ring (16 rows, "
                        "mark 40, guard 3) holds raw rows only from position 27 on: a rewind "
                        "may drop at most 10 rows below the mark")
    with pytest.raises(dsa_jax.StepError, match=message):
        dsa_jax.rewind(cfg, state, [27])
    assert np.asarray(state.lengths).tolist() == [40]  # nothing changed: still usable
    y_after, _, _ = dsa_jax.decode(cfg, w, T.copy_tree(state), x[:, 40])
    ys, straight = _prefill(cfg, w, x, [40])
    y_ref, _, _ = dsa_jax.decode(cfg, w, straight, x[:, 40])
    T.assert_trees_bitwise_equal(y_after, y_ref)
    # Within the reach (29: pool 28's rows 28 are held) and to a boundary at any depth.
    dsa_jax.rewind(cfg, T.copy_tree(state), [29])
    back = dsa_jax.rewind(cfg, state, [24])
    y2, back, _ = dsa_jax.prefill(cfg, w, back, x[:, 24:40])
    ys2, ref = _prefill(cfg, w, x, [24, 16])
    T.assert_trees_bitwise_equal((y2, back.pool_keys), (ys2[1], ref.pool_keys))


def test_decoding_goes_on_after_a_rewind_to_a_far_pool_boundary():
    """A rewind to a pool boundary 24 rows below the mark (past Rr): the steps after it read
    only rows they wrote themselves, and must not be refused (they were, before the mark was
    bounded at the rewind: the second decode failed on its own row). Then a rewind below the
    boundary to a non-boundary length is still refused."""
    cfg = ODD
    w = _weights(cfg, 10)
    x = T.random_rows(11, 1, 60, cfg.hidden_size)
    _, state = _prefill(cfg, w, x, [40])
    state = dsa_jax.rewind(cfg, state, [16])
    _, ref = _prefill(cfg, w, x, [16])
    for t in (16, 17, 18):
        y, state, _ = dsa_jax.decode(cfg, w, state, x[:, t])
        y_ref, ref, _ = dsa_jax.decode(cfg, w, ref, x[:, t])
        T.assert_trees_bitwise_equal(y, y_ref)
    with pytest.raises(dsa_jax.StepError, match="holds raw rows only from position 16"):
        dsa_jax.rewind(cfg, state, [14])


def test_a_kept_mark_bounds_later_rewinds():
    """Rewind, decode one row, rewind again: the rows the first rewind rejected still sit in
    the ring, so the second rewind's reach counts from the kept mark, not the length."""
    cfg = ODD
    w = _weights(cfg, 8)
    x = T.random_rows(9, 1, 50, cfg.hidden_size)
    _, state = _prefill(cfg, w, x, [40])
    state = dsa_jax.rewind(cfg, state, [34])
    _, state, _ = dsa_jax.decode(cfg, w, state, x[:, 34])
    assert np.asarray(state.index_lengths).tolist() == [40]
    with pytest.raises(dsa_jax.StepError, match="mark 40, guard 3"):
        dsa_jax.rewind(cfg, state, [27])
    _, fresh = _prefill(cfg, w, x, [35])  # the same length, nothing rejected: allowed
    assert np.asarray(dsa_jax.rewind(cfg, fresh, [27]).lengths).tolist() == [27]


def test_a_step_refuses_a_length_lowered_past_the_reach():
    """A caller that lowers `lengths` itself (no `rewind`) past the reach: the next step
    raises before writing; within the reach it heals."""
    cfg = ODD
    w = _weights(cfg, 10)
    x = T.random_rows(11, 1, 50, cfg.hidden_size)
    _, state = _prefill(cfg, w, x, [40])
    lowered = state._replace(lengths=jnp.asarray([27], jnp.int32))
    with pytest.raises(dsa_jax.StepError, match="at length 27 the pool being filled"):
        dsa_jax.decode(cfg, w, lowered, x[:, 27])
    assert not ring_holds(cfg, np.asarray([27]), np.asarray([40])).any()
    assert ring_holds(cfg, np.asarray([29, 24]), np.asarray([40, 40])).all()


def test_state_bytes_at_16k():
    cfg = glm53_flash()
    parts = state_bytes_breakdown(cfg)
    assert cfg.max_context == 16384 and ring_rows(cfg) == 16
    assert parts["latent"] == 16384 * cfg.kv_lora_rank * 1  # fp8
    assert parts["index_ring_k_and_g"] == 2 * 16 * cfg.index_head_dim * 2  # bf16
    assert parts["pool_keys"] == 4096 * cfg.index_head_dim * 2  # bf16, the index dtype
    assert state_bytes_per_seq(cfg) == sum(parts.values()) <= 10 * 2 ** 20  # issue #14
    wide = cfg.replace(index_cache_dtype="float32")
    assert state_bytes_breakdown(wide)["pool_keys"] == 4096 * cfg.index_head_dim * 4
    one = dsa_jax.init_state(cfg.replace(max_context=1024), 1)
    small = cfg.replace(max_context=1024)
    arrays = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(one)
                 if a.shape != ())  # kv_scale is shared by every sequence
    assert arrays == state_bytes_per_seq(small)


def test_ring_from_rows_holds_the_marked_positions():
    cfg = ODD
    rows = jnp.asarray(T.random_rows(12, 2, cfg.max_context, 5)).astype(jnp.bfloat16)
    ring = ring_from_rows(cfg, rows, np.asarray([40, 9]))
    for s, mark in ((0, 40), (1, 9)):
        for p in range(max(mark - 16, 0), mark):
            T.assert_trees_bitwise_equal(ring[s, p % 16], rows[s, p])
    assert (np.asarray(ring[1, 9:].astype(jnp.float32)) == 0).all()


def test_old_state_checkpoint_is_converted_to_the_ring(tmp_path, monkeypatch):
    """A state checkpoint before format 4 holds every raw row: restore keeps the rows its
    mark says a ring holds, at their slots; the rest of the state as it was."""
    from dsa_jax import checkpoint

    cfg, b, di = ODD, 2, ODD.index_head_dim
    rng = np.random.default_rng(13)
    rows = [jnp.asarray(rng.standard_normal((b, cfg.max_context, di)), jnp.float32)
            for _ in range(2)]
    base = dsa_jax.init_state(cfg, b)
    old = base._replace(index_k=rows[0], index_g=rows[1],
                        pool_keys=jnp.asarray(rng.standard_normal(base.pool_keys.shape),
                                              jnp.float32),
                        lengths=jnp.asarray([40, 9], jnp.int32),
                        index_lengths=jnp.asarray([42, 9], jnp.int32))
    new_expected = checkpoint.expected_state

    def old_expected(cfg, num_seqs, num_blocks, has_indexer=True):
        e = new_expected(cfg, num_seqs, num_blocks, has_indexer)
        full = jax.ShapeDtypeStruct((num_seqs, cfg.max_context, di), e.index_k.dtype)
        return e._replace(index_k=full, index_g=full) if has_indexer else e

    path = str(tmp_path / "old")
    with monkeypatch.context() as m:  # write as format 3 did: every raw row
        m.setattr(checkpoint, "FORMAT_VERSION", 3)
        m.setattr(checkpoint, "expected_state", old_expected)
        checkpoint.save_state(path, cfg, [old])
    assert checkpoint.read_info(path)["version"] == 3
    (got,), extra = checkpoint.restore_state(path, cfg)
    assert extra is None and got.index_k.shape == (b, ring_rows(cfg), di)
    marks = np.asarray([42, 9])
    T.assert_trees_bitwise_equal([got.index_k, got.index_g],
                                 [ring_from_rows(cfg, r, marks) for r in rows])
    for name in ("latent", "pool_keys", "lengths", "index_lengths", "block_tables"):
        T.assert_trees_bitwise_equal(getattr(got, name), getattr(old, name))
    path_new = str(tmp_path / "new")
    checkpoint.save_state(path_new, cfg, [got])
    assert checkpoint.read_info(path_new)["version"] == checkpoint.FORMAT_VERSION
    (again,), _ = checkpoint.restore_state(path_new, cfg)
    T.assert_trees_bitwise_equal(again, got)


def test_old_state_checkpoint_pool_keys_are_rounded_to_the_index_dtype(tmp_path, monkeypatch):
    """A state checkpoint before format 5 holds fp32 pool keys: restore into a bf16 index
    cache rounds them once, which is what this version's write stores for the same fp32 key
    (the write kernels and XLA compute the key in fp32, then round); the rest as it was."""
    from dsa_jax import checkpoint

    cfg, b = ODD.replace(index_cache_dtype="bfloat16"), 2
    rng = np.random.default_rng(14)
    base = dsa_jax.init_state(cfg, b)
    keys32 = jnp.asarray(rng.standard_normal(base.pool_keys.shape), jnp.float32)
    old = base._replace(index_k=jnp.asarray(rng.standard_normal(base.index_k.shape),
                                            jnp.bfloat16),
                        lengths=jnp.asarray([40, 9], jnp.int32),
                        index_lengths=jnp.asarray([40, 9], jnp.int32))
    new_expected = checkpoint.expected_state

    def old_expected(cfg, num_seqs, num_blocks, has_indexer=True):
        e = new_expected(cfg, num_seqs, num_blocks, has_indexer)
        return e._replace(pool_keys=jax.ShapeDtypeStruct(e.pool_keys.shape, jnp.float32))

    path = str(tmp_path / "v4")
    with monkeypatch.context() as m:  # written as format 4 did: fp32 pool keys
        m.setattr(checkpoint, "FORMAT_VERSION", 4)
        m.setattr(checkpoint, "expected_state", old_expected)
        checkpoint.save_state(path, cfg, [old._replace(pool_keys=keys32)])
    assert checkpoint.read_info(path)["version"] == 4
    (got,), _ = checkpoint.restore_state(path, cfg)
    assert got.pool_keys.dtype == jnp.bfloat16
    T.assert_trees_bitwise_equal(got.pool_keys, keys32.astype(jnp.bfloat16))
    for name in ("latent", "index_k", "index_g", "lengths", "index_lengths", "block_tables"):
        T.assert_trees_bitwise_equal(getattr(got, name), getattr(old, name))


def test_serving_loop_rewinds_stay_within_the_ring():
    """The device loop rewinds rejected drafts with no check (one `lengths` for every layer):
    its rounds must stay within the ring. A speculative run with rejections ends with the
    plain run's pool keys and ring rows, bit for bit."""
    from dsa_jax import model as M
    from dsa_jax import serve
    from dsa_jax.sampling import Sampling

    mcfg = M.ModelConfig(ODD.replace(indexer_types=("full", "shared"),
                                     index_cache_dtype="bfloat16"), vocab_size=37)
    weights = M.stack_weights(mcfg, M.init_model(mcfg, jax.random.key(0)))
    rng = np.random.default_rng(3)
    prompts = [np.resize(rng.integers(0, 37, 5), n).tolist() for n in (13, 30, 6)]
    limits, sampling = [40, 25, 45], Sampling("sample", temperature=0.5, top_p=0.9)
    finals = []
    for speculate in (0, 3):
        prog = serve.Program(mcfg, sampling, speculate=speculate)
        sv, _ = serve.start(prog, weights, None, prompts, limits)
        sv, outs, _ = serve.run(prog, weights, None, sv, 64)
        finals.append((sv.model, np.asarray(outs.drafted), np.asarray(outs.count)))
    (plain, _, _), (spec, drafted, count) = finals
    assert (count[drafted > 0] < drafted[drafted > 0] + 1).any()  # rejections happened
    lengths = np.asarray(plain.lengths)
    assert lengths.tolist() == np.asarray(spec.lengths).tolist() == [52, 54, 50]
    rows, guard = ring_rows(mcfg.dsa), mcfg.dsa.max_verify - 1
    for b, n in enumerate(lengths):
        T.assert_trees_bitwise_equal(spec.pool_keys[b, :, :n // 4], plain.pool_keys[b, :, :n // 4])
        slots = np.arange(n - (rows - guard), n) % rows  # what a ring surely holds
        T.assert_trees_bitwise_equal([spec.index_k[b, :, slots], spec.index_g[b, :, slots]],
                                     [plain.index_k[b, :, slots], plain.index_g[b, :, slots]])
