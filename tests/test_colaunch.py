"""Kernels sharing one launch (`pallas/colaunch.py`): each part's programs compute what its
own kernel computes; the decode's top-k with the q_b GEMM (`pallas/topk_matmul.py`) gives the
two kernels' results bit for bit, and a step with the shared launch gives the step's bits
without it. One test body for interpret mode and the GPU (`kernel_impl`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import layer, shapes
from dsa_jax import testing as T
from dsa_jax import weights as W
from dsa_jax.pallas import matmul as mm
from dsa_jax.pallas import pool_topk as tk
from dsa_jax.pallas import topk_matmul as tm
from dsa_jax.pallas.colaunch import Part, colaunch, unravel
from dsa_jax.step import shares_q_launch


def test_unravel_is_row_major():
    for pid in range(2 * 3 * 5):
        ids = [int(i) for i in unravel(jnp.int32(pid), (2, 3, 5))]
        assert ids == list(np.unravel_index(pid, (2, 3, 5)))


def _fill_ids(ids, o_ref):  # writes its program ids where only it writes
    i, j = ids
    o_ref[i, j] = i * 100 + j


def _scaled_rows(ids, x_ref, o_ref):  # row r of x times (r + 1)
    (r,) = ids
    o_ref[r, :] = x_ref[r, :] * (r + 1).astype(jnp.float32)


def test_each_part_runs_its_own_programs_on_its_own_operands(kernel_impl):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((7, 16)), jnp.float32)
    parts = [Part(_fill_ids, (3, 5), (), (jax.ShapeDtypeStruct((3, 5), jnp.int32),)),
             Part(_scaled_rows, (7,), (x,), (jax.ShapeDtypeStruct((7, 16), jnp.float32),))]
    (ids,), (scaled,) = colaunch(parts, num_warps=4, num_stages=1,
                                 interpret=kernel_impl == "pallas-interpret")
    np.testing.assert_array_equal(np.asarray(ids),
                                  np.arange(3)[:, None] * 100 + np.arange(5)[None, :])
    np.testing.assert_array_equal(np.asarray(scaled),
                                  np.asarray(x) * np.arange(1, 8, dtype=np.float32)[:, None])
    with pytest.raises(ValueError, match="at least one program"):
        colaunch([Part(_fill_ids, (0, 5), (), parts[0].out_shape)], num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="no parts"):
        colaunch([], num_warps=4, num_stages=1)


def _bump(ids, x_ref, o_ref):  # o (x's buffer) = x + 1, read before written
    del ids
    o_ref[...] = x_ref[...] + 1


def test_a_parts_alias_writes_its_output_in_its_inputs_buffer(kernel_impl):
    interpret = kernel_impl == "pallas-interpret"
    out = jax.ShapeDtypeStruct((16,), jnp.int32)

    def fn(x, interpret=interpret):
        parts = [Part(_fill_ids, (3, 5), (), (jax.ShapeDtypeStruct((3, 5), jnp.int32),)),
                 Part(_bump, (1,), (x,), (out,), aliases={0: 0})]
        return colaunch(parts, num_warps=4, num_stages=1, interpret=interpret)

    x = jnp.arange(16, dtype=jnp.int32)
    # the launch's second output (the part's first) in the operand's buffer
    text = jax.jit(lambda x: fn(x, False)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "output_tuple_indices = [1], operand_index = 0" in text
    (ids,), (bumped,) = jax.jit(fn)(x)
    np.testing.assert_array_equal(np.asarray(bumped), np.arange(1, 17))
    np.testing.assert_array_equal(np.asarray(ids),
                                  np.arange(3)[:, None] * 100 + np.arange(5)[None, :])
    with pytest.raises(ValueError, match="alias 1 -> 0"):
        colaunch([Part(_bump, (1,), (x,), (out,), aliases={1: 0})], num_warps=4, num_stages=1)


def _scores(rng, lead, p, ties=True):
    s = rng.standard_normal((*lead, p)).astype(np.float32)
    if ties:  # repeated values (the tie rule), -inf pools and a row of -inf only
        s.reshape(-1, p)[0, : p // 3] = 0.25
        s.reshape(-1, p)[-1, p // 2:] = -np.inf
        if s.reshape(-1, p).shape[0] > 2:
            s.reshape(-1, p)[1] = -np.inf
    return jnp.asarray(s)


@pytest.mark.parametrize("lead, p, k, m_lead, n, kdim", [
    ((1, 1), 300, 40, (1, 1), 160, 96),  # one decode row; P padded to a power of two
    pytest.param((3, 2), 257, 64, (3, 4), 48, 128,  # a verify's rows; a short GEMM
                 marks=pytest.mark.long),
    pytest.param((2, 1), 64, 64, (2, 1), 2336 // 16, 256, marks=pytest.mark.long),  # k = P
])
def test_topk_matmul_is_the_two_kernels_bit_for_bit(kernel_impl, lead, p, k, m_lead, n, kdim):
    interpret = kernel_impl == "pallas-interpret"
    rng = np.random.default_rng(p + k)
    scores = _scores(rng, lead, p)
    v = jnp.asarray(rng.standard_normal((*m_lead, kdim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, kdim)) * 0.05, jnp.bfloat16)
    assert tm.shares_launch(scores.shape, v.shape, w.shape, interpret)
    fn = jax.jit(lambda s, v, w: tm.topk_matmul_pallas(s, k, v, w, interpret=interpret))
    pools, q = fn(scores, v, w)
    np.testing.assert_array_equal(np.asarray(pools), np.asarray(tk.pool_topk_xla(scores, k)))
    alone = mm.matmul_pallas(v, w, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(alone))
    # and the definition's pair: the same pools, the GEMM within fp32 accumulation over K
    ref_pools, ref_q = tm.topk_matmul_xla(scores, k, v, w)
    np.testing.assert_array_equal(np.asarray(pools), np.asarray(ref_pools))
    mag = np.abs(np.asarray(v, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
    bound = kdim * np.finfo(np.float32).eps * mag
    assert (np.abs(np.asarray(q, np.float64) - np.asarray(ref_q, np.float64)) <= bound).all()
    # with the expansion written by the top-k's programs: the expand kernel's slots
    pos = jnp.asarray(rng.integers(0, 4 * p, lead), jnp.int32)  # [...] rows' positions
    valid = jnp.asarray(rng.random(lead) < 0.8)
    ex = tk.Expansion(4, 4 * k + 3, True)
    fn_ex = jax.jit(lambda s, v, w, pos, valid: tm.topk_matmul_pallas(
        s, k, v, w, expand=ex, pos=pos, valid=valid, interpret=interpret))
    slots, q_ex = fn_ex(scores, v, w, pos, valid)
    np.testing.assert_array_equal(np.asarray(q_ex), np.asarray(alone))
    np.testing.assert_array_equal(np.asarray(slots), np.asarray(tk.pool_topk_expand_pallas(
        scores, k, pos, valid, ex, interpret=interpret)))
    np.testing.assert_array_equal(np.asarray(slots), np.asarray(
        tm.topk_matmul_xla(scores, k, v, w, expand=ex, pos=pos, valid=valid)[0]))
    assert (np.asarray(slots) >= 0).any()
    # q_b as a stack's layer read in place (the model's scan): the same bits as that layer's
    stack = jnp.stack([w * 3, w, -w])  # [3, N, K]: this weight at index 1
    _, q_st = jax.jit(lambda s, v, st, at: tm.topk_matmul_pallas(
        s, k, v, st, at, interpret=interpret))(scores, v, stack, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(q_st), np.asarray(alone))
    if not interpret:  # one launch of both in the compiled program (the kernels' names)
        text = jax.jit(fn).lower(scores, v, w).as_text().replace('\\"', '"')
        assert 'name = "topk_matmul"' in text
        assert 'name = "pool_topk"' not in text and 'name = "matmul"' not in text


def test_where_the_two_cannot_share_a_launch_they_run_apart_with_the_same_results():
    s1, v1, w1 = (1, 1, 300), (1, 1, 96), (160, 96)
    assert tm.shares_launch(s1, v1, w1, True)
    assert not tm.shares_launch((1, 1, 8192), v1, w1, True)  # past tk.KERNEL_MAX_P
    assert not tm.shares_launch((0, 1, 300), v1, w1, True)  # no rows
    assert not tm.shares_launch(s1, (0, 96), w1, True)
    triton = tk.PoolTopkTuning(backend="triton")
    assert not tm.shares_launch(s1, v1, w1, False, topk_tuning=triton)
    many = (tk.AUTO_TRITON_MIN_ROWS, 300)  # a compiled prompt's rows: the raw Triton top-k
    assert not tm.shares_launch(many, v1, w1, False) and tm.shares_launch(many, v1, w1, True)
    eight = mm.MatmulTuning(num_warps=8, block_m=16, block_n=64, block_k=32)
    assert not tm.shares_launch(s1, v1, w1, True, matmul_tuning=eight)
    rng = np.random.default_rng(3)
    scores = _scores(rng, (1, 1), 300)
    v = jnp.asarray(rng.standard_normal(v1), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(w1) * 0.05, jnp.bfloat16)
    pools, q = tm.topk_matmul_pallas(scores, 40, v, w, interpret=True, matmul_tuning=eight)
    np.testing.assert_array_equal(np.asarray(pools), np.asarray(tk.pool_topk_xla(scores, 40)))
    np.testing.assert_array_equal(
        np.asarray(q), np.asarray(mm.matmul_pallas(v, w, interpret=True, tuning=eight)))
    long = _scores(rng, (1, 1), 8192)  # rows past the kernels: lax.top_k, as the layer runs
    pools, _ = tm.topk_matmul_pallas(long, 40, v, w, interpret=True)
    np.testing.assert_array_equal(np.asarray(pools), np.asarray(tk.pool_topk_xla(long, 40)))


def _block(impl):
    cfg = shapes.tiny(implementation=impl, param_dtype="bfloat16")
    return cfg, W.fold_weights(cfg, T.random_hf_numpy(cfg, np.random.default_rng(0)))


def test_a_decode_and_a_verify_with_the_shared_launch_keep_their_bits(layer_kernel_impl):
    """`cfg.colaunch` moves the q_b GEMM into the top-k's launch and changes no bit: y, the
    state and the selection of a decode and of a verify, with and without it; the serial
    decodes still equal the verify."""
    cfg, w = _block(layer_kernel_impl)
    assert cfg.colaunch and cfg.replace(colaunch=False).colaunch is False
    state = T.random_state(cfg, w, 2, 70, seed=1)
    x = T.random_rows(2, 2, 3, cfg.hidden_size, dtype=jnp.bfloat16)  # [B, 3, D]
    assert shares_q_launch(cfg, w, x)
    assert not shares_q_launch(cfg.replace(colaunch=False), w, x)
    assert not shares_q_launch(cfg, w, jnp.zeros((2, cfg.max_verify + 1, 1)))
    ones = jnp.ones((2,), jnp.int32)
    for c, want in ((cfg, 1), (cfg.replace(colaunch=False), 0)):  # a decode's one row
        text = str(jax.make_jaxpr(lambda s, x, c=c: layer.step(c, w, s, x, ones))(
            state, x[:, :1])).replace("'", "")
        assert text.count("name=topk_matmul") == want
        assert text.count("name=pool_topk") == 1 - want
        # `step.decode_front`: the rows' metadata beside the x projection's GEMM, its three
        # readers in one launch, the pool keys beside the indexer query's GEMM
        for name in ("meta_matmul", "x_readers", "pool_keys_matmul"):
            assert text.count(f"name={name}") == want, name
        for name in ("rms_norm", "latent_write", "index_write_rows", "index_write_pool_keys"):
            assert text.count(f"name={name}") == 1 - want, name
        assert text.count("name=matmul") == 6 - 3 * want  # x, q_b and qi beside the others
    outs = {}
    for on in (True, False):
        c = cfg.replace(colaunch=on)
        y_k, s_k, sel_k = dsa_jax.decode_k(c, w, T.copy_tree(state), x)
        serial, s = [], T.copy_tree(state)
        for t in range(3):
            y, s, sel = dsa_jax.decode(c, w, s, x[:, t])
            serial.append((np.asarray(y), np.asarray(sel)))
        for t in range(3):
            np.testing.assert_array_equal(serial[t][0], np.asarray(y_k)[:, t])
            np.testing.assert_array_equal(serial[t][1], np.asarray(sel_k)[:, t])
        outs[on] = (np.asarray(y_k), np.asarray(sel_k), jax.tree.map(np.asarray, s_k),
                    serial, jax.tree.map(np.asarray, s))
    assert not np.array_equal(outs[True][0], np.zeros_like(outs[True][0]))
    for a, b in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_readers_of_a_split_gemms_parts_give_the_summed_results(kernel_impl):
    """`matmul_part(summed=False)`'s K parts, read by kernels that add them in split order
    (`common.load_parts`): the norm, the latent write, the index write and the summed
    columns give, bit for bit, what they give on `matmul_pallas`'s summed result (the decode
    front reads the x projection so, `step.decode_front`)."""
    from dsa_jax.pallas import index_write as iw
    from dsa_jax.pallas import latent_write as lw
    from dsa_jax.pallas import rms_norm as rn

    interpret = kernel_impl == "pallas-interpret"
    rng = np.random.default_rng(3)
    b, r, k, n = 2, 3, 2048, 600  # 4 K parts (`splits_for`)
    x = jnp.asarray(rng.standard_normal((b, r, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.03, jnp.bfloat16)
    part, finish = mm.matmul_part(x, w, summed=False)
    assert part.out_shape[0].shape[0] == 4
    (outs,) = colaunch([part], num_warps=4, num_stages=3, interpret=interpret)
    parts = finish(outs)  # [4, B, R, N]
    xw = mm.matmul_pallas(x, w, interpret=interpret)  # [B, R, N]
    np.testing.assert_array_equal(np.asarray(mm.summed_columns_xla(parts, 0, n)), np.asarray(xw))

    def run(p):
        (o,) = colaunch([p[0]], num_warps=4, num_stages=1, interpret=interpret)
        return p[1](o)

    nw = jnp.asarray(rng.standard_normal(256), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(run(rn.rms_norm_part(parts, nw, 1e-6, cols=(10, 256), parts=4))),
        np.asarray(rn.rms_norm_pallas(xw, nw, 1e-6, cols=(10, 256), interpret=interpret)))
    np.testing.assert_array_equal(np.asarray(run(mm.summed_columns_part(parts, 500, 37))),
                                  np.asarray(xw[..., 500:537]))
    cache = jnp.zeros((8, 16, 64), jnp.float8_e4m3fn)
    table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    pos = jnp.asarray([[5, 6, 7], [30, 31, 32]], jnp.int32)
    valid = jnp.asarray([[True, True, False], [True, True, True]])
    lw_args = (jnp.ones(64), cache, jnp.float32(0.05), table, pos, valid)
    np.testing.assert_array_equal(
        np.asarray(run(lw.latent_write_part(parts, *lw_args, eps=1e-6, col=100,
                                            parts=4))).view(np.uint8),
        np.asarray(lw.latent_write_pallas(xw, *lw_args, eps=1e-6, col=100,
                                          interpret=interpret)).view(np.uint8))
    di, kp = 128, 4
    rings = [jnp.asarray(rng.standard_normal((b, 16, di)), jnp.bfloat16) for _ in range(2)]
    keys = jnp.asarray(rng.standard_normal((b, 16, di)), jnp.bfloat16)
    ln = (jnp.ones(di), jnp.zeros(di), jnp.asarray(rng.standard_normal((kp, di)), jnp.float32))
    want = iw.index_write_pallas(xw, xw, *ln, *rings, keys, pos, valid, cols=(200, 330),
                                 interpret=interpret)
    ix = iw.index_write_parts(parts, parts, *ln, *rings, keys, pos, valid, cols=(200, 330),
                              parts=4)
    (rows_outs,) = colaunch([ix.rows], num_warps=4, num_stages=1, interpret=interpret)
    (pool_outs,) = colaunch([ix.pool(rows_outs)], num_warps=4, num_stages=1,
                            interpret=interpret)
    for a, g in zip(want, ix.finish(rows_outs, pool_outs), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(g.astype(jnp.float32)))
