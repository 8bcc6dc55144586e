"""The step's row metadata in one program (`pallas/row_meta.py`): the kernel's integers equal
the definition's (`==`) on odd batch and row counts, rows past the block table, at pool
boundaries, across the ring's wrap, with marks ahead of and behind the lengths; the definition
is what each consumer computes for itself; beside the x projection's GEMM the GEMM keeps its
bits. One test body for interpret mode and the GPU (`kernel_impl`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import layer, shapes
from dsa_jax import state as S
from dsa_jax.pallas import index_write as iw
from dsa_jax.pallas import latent_write as lw
from dsa_jax.pallas import matmul as mm
from dsa_jax.pallas import pool_topk as tk
from dsa_jax.pallas import row_meta as rm

# (rows, attended, block_size, kpool, ring_rows, ring_len, num_pools, keys_len, layer)
GEOMETRIES = [
    rm.RowGeometry(1, 1, 64, 4, 16, 16, 64, 64),  # a decode
    rm.RowGeometry(4, 3, 16, 4, 16, 16, 16, 16),  # a padded verify attending 3 rows
    rm.RowGeometry(3, 3, 16, 8, 16, 32, 8, 16, layer=1),  # a second layer of shared arrays
]


def _inputs(g: rm.RowGeometry, b: int, nblocks: int, seed: int):
    """Lengths across the table (the last ones past its end), at pool boundaries and 0; marks
    behind, equal and far ahead; n_new from 0 to R."""
    rng = np.random.default_rng(seed)
    cap = nblocks * g.block_size
    lengths = rng.integers(0, cap + g.rows, b)
    lengths[: min(b, 4)] = [0, g.kpool - 1, cap - 1, cap + 2][: min(b, 4)]
    marks = lengths + rng.integers(-3, 3 * g.ring_rows, b)
    n_new = rng.integers(0, g.rows + 1, b)
    n_new[0] = g.rows
    tables = rng.permutation(b * nblocks + 5)[: b * nblocks].reshape(b, nblocks)
    return tuple(jnp.asarray(a, jnp.int32) for a in (lengths, marks, n_new, tables))


@pytest.mark.parametrize("g", GEOMETRIES)
@pytest.mark.parametrize("b", [1, 3, 5])
def test_the_kernel_computes_the_definitions_integers(kernel_impl, g, b):
    args = _inputs(g, b, 6, seed=b * 7 + g.rows)
    want = rm.row_meta_xla(g, *args)
    got = jax.jit(lambda *a: rm.row_meta_pallas(
        g, *a, interpret=kernel_impl == "pallas-interpret"))(*args)
    for name, x, y in zip(rm.RowMeta._fields, want, got, strict=True):
        assert x.dtype == y.dtype == jnp.int32 and x.shape == y.shape, name
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=name)
    if b == 5:  # the inputs reach the branches: rows dropped past the table or not valid,
        # rows stored, pools completed, marks held back by the ring's reach
        assert (np.asarray(want.slots) == -1).any() and (np.asarray(want.slots) >= 0).any()
        assert (np.asarray(want.index)[1] >= 0).any()
        assert (np.asarray(want.marks) < np.asarray(args[1])).any()


def test_the_definition_is_what_each_consumer_computes():
    g, b = GEOMETRIES[1], 5
    lengths, marks, n_new, tables = _inputs(g, b, 6, seed=3)
    meta = rm.row_meta_xla(g, lengths, marks, n_new, tables)
    pos = lengths[:, None] + jnp.arange(g.rows, dtype=jnp.int32)
    valid = jnp.arange(g.rows)[None, :] < n_new[:, None]
    k = g.attended
    np.testing.assert_array_equal(
        meta.slots, lw.flat_slots(pos, valid, tables, g.block_size).reshape(-1))
    np.testing.assert_array_equal(meta.index, iw.row_meta(
        pos, valid, kp=g.kpool, rows=g.ring_rows, num_pools=g.num_pools,
        keys_len=g.keys_len, ring_len=g.ring_len))
    cfg = shapes.tiny().replace(index_kpool=g.kpool)
    np.testing.assert_array_equal(
        meta.n_cand, layer.candidate_pools(cfg, pos[:, :k], valid[:, :k]))
    np.testing.assert_array_equal(meta.pv, tk.positions(pos[:, :k], valid[:, :k]).reshape(-1))
    np.testing.assert_array_equal(meta.lengths, lengths + n_new)
    rr = S.ring_rows(cfg)
    np.testing.assert_array_equal(
        rm.mark_after(lengths, marks, n_new, rr), S.ring_mark_after(cfg, lengths, marks, n_new))
    host = S.ring_mark_after(cfg, np.asarray(lengths), np.asarray(marks), np.asarray(n_new))
    assert isinstance(host, np.ndarray)  # the host's mirror keeps numpy
    np.testing.assert_array_equal(host, rm.mark_after(lengths, marks, n_new, rr))


def test_beside_the_x_projection_the_gemm_keeps_its_bits(kernel_impl):
    interpret = kernel_impl == "pallas-interpret"
    g, b = GEOMETRIES[1], 3
    args = _inputs(g, b, 6, seed=11)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((b, g.rows, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((200, 256)) * 0.05, jnp.bfloat16)
    meta, xw = jax.jit(lambda *a: rm.meta_matmul_pallas(g, *a, x, w, interpret=interpret))(
        *args)
    np.testing.assert_array_equal(np.asarray(xw),
                                  np.asarray(mm.matmul_pallas(x, w, interpret=interpret)))
    for x_, y_ in zip(meta, rm.row_meta_xla(g, *args), strict=True):
        np.testing.assert_array_equal(np.asarray(x_), np.asarray(y_))
    ref_meta, ref_xw = rm.meta_matmul_xla(g, *args, x, w)
    np.testing.assert_allclose(np.asarray(xw), np.asarray(ref_xw), rtol=2e-2, atol=2e-2)
    assert not np.array_equal(np.asarray(xw), np.zeros_like(np.asarray(xw)))


@pytest.mark.parametrize("summed", [True, False])
def test_beside_the_x_projection_fp8_row_parts_keep_the_whole_weights_bits(kernel_impl,
                                                                           summed):
    """The input GEMM's weight as `fp8.StackedRows` (fp8 blocks and bf16 rows, one launch
    part each, at the whole weight's K split): the bits of the whole bf16 weight, its K parts
    too (`summed=False`, what `decode_front` reads)."""
    from dsa_jax import fp8

    interpret = kernel_impl == "pallas-interpret"
    g, b = GEOMETRIES[1], 3
    args = _inputs(g, b, 6, seed=12)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((b, g.rows, 2048)), jnp.bfloat16)
    w = rng.standard_normal((200, 2048)) * 0.5
    rows = fp8.StackedRows((fp8.quantize_blocks(w[:192], (64, 128)),
                            jnp.asarray(w[192:], jnp.bfloat16)))
    assert mm.splits_for(200, 2048) > 1  # K parts to keep in order
    meta, xw = rm.meta_matmul_pallas(g, *args, x, rows, interpret=interpret, summed=summed)
    _, want = rm.meta_matmul_pallas(g, *args, x, rows.dequantize(), interpret=interpret,
                                    summed=summed)
    np.testing.assert_array_equal(np.asarray(xw), np.asarray(want))
    for x_, y_ in zip(meta, rm.row_meta_xla(g, *args), strict=True):
        np.testing.assert_array_equal(np.asarray(x_), np.asarray(y_))


def test_lowered_for_the_gpu_it_is_one_launch():
    """The Triton lowering runs on any host: the metadata and the GEMM are one custom call."""
    g, b = GEOMETRIES[0], 3
    i32 = jnp.int32
    bf16 = jnp.bfloat16
    args = ((jax.ShapeDtypeStruct((b,), i32),) * 3
            + (jax.ShapeDtypeStruct((b, 6), i32), jax.ShapeDtypeStruct((b, 1, 512), bf16),
               jax.ShapeDtypeStruct((300, 512), bf16)))
    text = jax.jit(lambda *a: rm.meta_matmul_pallas(g, *a)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1


def test_bad_geometry_and_shapes_are_refused():
    with pytest.raises(ValueError, match="attended=5"):
        rm.RowGeometry(4, 5, 16, 4, 16, 16, 16, 16)
    with pytest.raises(ValueError, match="ring_rows=2"):
        rm.RowGeometry(1, 1, 16, 4, 2, 2, 16, 16)
    g = GEOMETRIES[0]
    lengths, marks, n_new, tables = _inputs(g, 3, 6, seed=1)
    with pytest.raises(ValueError, match="n_new has shape"):
        rm.row_meta_xla(g, lengths, marks, n_new[:2], tables)
    with pytest.raises(ValueError, match="block_tables has shape"):
        rm.row_meta_pallas(g, lengths, marks, n_new, tables[:2], interpret=True)
    with pytest.raises(ValueError, match="slots has shape"):
        lw.latent_write_pallas(jnp.zeros((1, 1, 512)), jnp.ones((512,)),
                               jnp.zeros((2, 16, 512), jnp.bfloat16), 1.0, tables[:1],
                               jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool), eps=1e-6,
                               slots=jnp.zeros((2,), jnp.int32), interpret=True)
