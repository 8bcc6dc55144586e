"""The row-invariant GEMM kernel (`pallas/matmul.py`) against its definition and against
itself at other row counts: one body per check, run in Pallas interpret mode and (under
`pytest -m gpu`) compiled for the GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax.pallas import matmul as mm

EPS32 = np.finfo(np.float32).eps


def _operands(m, n, k, seed, dtype=jnp.bfloat16, heads=None, w_contract=None):
    kv, kw = jax.random.split(jax.random.key(seed))
    if heads is None:
        v = jax.random.normal(kv, (m, k), jnp.float32)
        w = jax.random.normal(kw, (n, k), jnp.float32)
    else:
        v = jax.random.normal(kv, (m, heads, k), jnp.float32)
        w = jax.random.normal(kw, (heads, k, n) if w_contract == 1 else (heads, n, k),
                              jnp.float32)
    return v, (w * 0.1).astype(dtype)


def _exact_and_bound(v, w, k, w_contract=None):
    """The fp64 product of the operands as the kernel rounds them (v to w's dtype), and the
    bound on an fp32 accumulation of K products, each exact in fp32 (16-bit operands): at most
    K roundings of the running sum, each <= eps32 times the sum of |products| (gamma_K)."""
    v16 = np.asarray(v.astype(w.dtype), np.float64)
    w64 = np.asarray(w, np.float64)
    if w_contract is None:
        exact, mag = v16 @ w64.T, np.abs(v16) @ np.abs(w64).T
    else:
        spec = "mhk,hkn->mhn" if w_contract == 1 else "mhk,hnk->mhn"
        exact, mag = np.einsum(spec, v16, w64), np.einsum(spec, np.abs(v16), np.abs(w64))
    return exact, k * EPS32 * mag


# (m, n, k, tuning overrides): partial row, column and K tiles, K splits that leave a short last
# part, one row, 16-bit weights of both kinds.
CASES = [(5, 40, 200, {}), (70, 100, 1536, {}), (1, 130, 4096, {}),
         (33, 64, 300, {"splits": 3, "block_k": 32}), (17, 48, 96, {"block_n": 16})]


@pytest.mark.parametrize("m,n,k,over", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_matmul_matches_the_definition(kernel_impl, m, n, k, over, dtype):
    v, w = _operands(m, n, k, seed=m + n, dtype=dtype)
    got = np.asarray(mm.matmul_pallas(v, w, interpret=kernel_impl == "pallas-interpret",
                                      **over))
    exact, bound = _exact_and_bound(v, w, k)
    assert got.shape == (m, n) and got.dtype == np.float32
    assert np.isfinite(got).all()
    assert (np.abs(got - exact) <= bound).all(), np.max(np.abs(got - exact) / bound)
    # The definition (XLA's dot) is within the same bound of the exact product.
    ref = np.asarray(mm.matmul_xla(v, w))
    assert (np.abs(ref - exact) <= bound).all()


@pytest.mark.parametrize("w_contract", [1, 2])
def test_per_head_matches_the_definition(kernel_impl, w_contract):
    m, heads, n, k = 7, 3, 40, 24
    v, w = _operands(m, n, k, seed=w_contract, heads=heads, w_contract=w_contract)
    got = mm.per_head_pallas(v.reshape(1, m, heads, k), w, w_contract,
                             interpret=kernel_impl == "pallas-interpret")
    assert got.shape == (1, m, heads, n)
    exact, bound = _exact_and_bound(v, w, k, w_contract)
    got = np.asarray(got)[0]
    assert (np.abs(got - exact) <= bound).all()
    ref = np.asarray(mm.per_head_xla(v, w, w_contract))
    assert (np.abs(ref - exact) <= bound).all()


@pytest.mark.parametrize("m,n,k,over", [(3, 130, 300, {}),
                                         (21, 70, 1536, {"block_n": 128, "splits": 2})])
def test_the_transposed_tile_matches_the_definition(kernel_impl, m, n, k, over):
    """`swap_ab` (the tile computed as `w_tile @ v_tile^T`): the same products within the
    same bound, for a weight [N, K] and for the per-head products of both layouts."""
    interpret = kernel_impl == "pallas-interpret"
    v, w = _operands(m, n, k, seed=m)
    got = np.asarray(mm.matmul_pallas(v, w, interpret=interpret, swap_ab=True, block_m=16,
                                      **over))
    exact, bound = _exact_and_bound(v, w, k)
    assert got.shape == (m, n) and (np.abs(got - exact) <= bound).all()
    for w_contract in (1, 2):
        v, w = _operands(m, 40, 24, seed=w_contract, heads=3, w_contract=w_contract)
        got = np.asarray(mm.per_head_pallas(v, w, w_contract, interpret=interpret,
                                            swap_ab=True, block_m=16))
        exact, bound = _exact_and_bound(v, w, 24, w_contract)
        assert got.shape == (m, 3, 40) and (np.abs(got - exact) <= bound).all()


@pytest.mark.parametrize("n,k,heads", [(100, 1536, None), (130, 4096, None), (40, 24, 3)])
def test_a_row_has_the_same_bits_at_every_row_count(kernel_impl, n, k, heads):
    """The kernel's promise: the default tiles change with the row count (16-, 64- and
    128-row tiles below), a row's bits do not. XLA's dot makes no such promise (its
    algorithm, and so a row's bits, may change with M)."""
    interpret = kernel_impl == "pallas-interpret"
    v, w = _operands(150, n, k, seed=n, heads=heads, w_contract=2)
    run = ((lambda x: mm.matmul_pallas(x, w, interpret=interpret)) if heads is None else
           (lambda x: mm.per_head_pallas(x, w, 2, interpret=interpret)))
    full = np.asarray(run(v))
    tiles = set()
    for m in (1, 5, 16, 17, 64, 65):
        tiles.add(mm.default_tuning(n, k, heads or 1, m).block_m)
        assert np.array_equal(np.asarray(run(v[:m])), full[:m]), m
    assert tiles == {16, 64, 128}


def test_the_split_is_a_function_of_the_weight_shape_alone():
    for n, k, heads in [(2336, 4096, 1), (4096, 16384, 1), (16384, 1536, 1), (512, 256, 64)]:
        assert len({mm.default_tuning(n, k, heads, m).splits for m in (1, 4, 64, 256)}) == 1
    assert mm.splits_for(4096, 16384) == 2 and mm.splits_for(16384, 1536) == 1


def test_zero_rows_and_bad_tiles():
    v, w = _operands(0, 40, 64, seed=1)
    assert mm.matmul_pallas(v, w, interpret=True).shape == (0, 40)
    v, w = _operands(3, 40, 64, seed=1)
    with pytest.raises(ValueError, match="block_k=24 must be a power of two"):
        mm.matmul_pallas(v, w, interpret=True, block_k=24)
    with pytest.raises(ValueError, match="splits=4 must be >= 1 and leave every split"):
        mm.matmul_pallas(v, w, interpret=True, splits=4, block_k=32)
    with pytest.raises(ValueError, match="w_contract=3"):
        mm.per_head_pallas(v.reshape(3, 1, 64), w.reshape(1, 40, 64), 3, interpret=True)


@pytest.mark.parametrize("heads,w_contract", [(None, None), (3, 1), (3, 2)])
def test_a_stacked_weight_read_in_place_gives_the_slice_bits(kernel_impl, heads, w_contract):
    """`layer=`: the kernel reads layer l of a stack `[G, ...]` in place (the model's scan),
    with the bits it gives the slice `stack[l]`, at every row count; the twin indexes the
    same layer; an index past the stack is clamped as XLA's dynamic index clamps it."""
    interpret = kernel_impl == "pallas-interpret"
    g, n, k = 3, 40, 200
    stack = jnp.stack([_operands(1, n, k, seed=s, heads=heads, w_contract=w_contract)[1]
                       for s in range(g)])  # [G, ...]
    v = _operands(20, n, k, seed=9, heads=heads, w_contract=w_contract)[0]

    def run(x, w, layer=None):
        if heads is None:
            return mm.matmul_pallas(x, w, layer, interpret=interpret)
        return mm.per_head_pallas(x, w, w_contract, layer, interpret=interpret)

    in_place = jax.jit(run)
    for layer in range(g):
        want = np.asarray(run(v, stack[layer]))  # [M, ...]
        for m in (1, 4, 20):
            got = np.asarray(in_place(v[:m], stack, jnp.int32(layer)))
            assert np.array_equal(got, want[:m]), (layer, m)
        twin = (mm.matmul_xla(v, stack, jnp.int32(layer)) if heads is None else
                mm.per_head_xla(v, stack, w_contract, jnp.int32(layer)))
        exact, bound = _exact_and_bound(v, stack[layer], k, w_contract)
        assert (np.abs(np.asarray(twin) - exact) <= bound).all()
        assert (np.abs(want - exact) <= bound).all()
    assert np.array_equal(np.asarray(in_place(v, stack, jnp.int32(g + 5))),
                          np.asarray(run(v, stack[g - 1])))


def test_a_stacked_weight_needs_its_layer_axis_and_a_scalar_index():
    v, w = _operands(3, 40, 64, seed=1)
    with pytest.raises(ValueError, match=r"a stacked weight must be \[G, 1, \., \.\]"):
        mm.matmul_pallas(v, w, jnp.int32(0), interpret=True)  # [N, K]: no layer axis
    with pytest.raises(ValueError, match="layer must be a scalar integer index"):
        mm.matmul_pallas(v, w[None], jnp.zeros((2,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="layer must be a scalar integer index"):
        mm.matmul_pallas(v, w[None], jnp.float32(0), interpret=True)


@pytest.mark.parametrize("heads,w_contract,shape", [
    (None, None, (2336, 4096)), (None, None, (4096, 16384)), (None, None, (256, 4096)),
    (64, 1, (256, 512)), (64, 2, (256, 512))])
@pytest.mark.parametrize("m", [1, 64])
def test_the_stacked_operand_lowers_for_cuda(heads, w_contract, shape, m):
    """The Triton lowering (on any host) of the kernel reading a stacked weight at the model's
    GLM-5.3 shapes (x_proj, o_proj, the LM head at vocabulary 256, U_k and U_v of 64 heads):
    a lowering error surfaces here, before the GPU (interpret mode accepts more)."""
    n, k = shape
    g = 4
    if heads is None:
        fn = functools.partial(mm.matmul_pallas)
        args = (jax.ShapeDtypeStruct((m, k), jnp.float32),
                jax.ShapeDtypeStruct((g, n, k), jnp.bfloat16))
    else:
        fn = functools.partial(mm.per_head_pallas, w_contract=w_contract)
        w = (g, heads, k, n) if w_contract == 1 else (g, heads, n, k)
        args = (jax.ShapeDtypeStruct((m, heads, k), jnp.float32),
                jax.ShapeDtypeStruct(w, jnp.bfloat16))
    text = jax.jit(lambda v, w, layer: fn(v, w, layer=layer)).trace(
        *args, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("splits", [1, 2])
def test_a_bf16_result_is_the_f32_result_rounded(kernel_impl, splits):
    """`out_dtype=bf16` (a prompt's U_v product, `projection.output_projection`): the kernel
    rounds its fp32 sums once (in the kernel with one K part, after the split sum with two),
    so its result is the f32 result rounded, bit for bit; the twin rounds its own the same
    way."""
    interpret = kernel_impl == "pallas-interpret"
    m, heads, n, k = 70, 3, 40, 256
    v, w = _operands(m, n, k, seed=splits, heads=heads, w_contract=2)
    v = v.astype(jnp.bfloat16)  # the attend's bf16 result
    f32 = mm.per_head_pallas(v, w, 2, interpret=interpret, splits=splits, block_k=64)
    b16 = mm.per_head_pallas(v, w, 2, out_dtype=jnp.bfloat16, interpret=interpret,
                             splits=splits, block_k=64)
    assert b16.dtype == jnp.bfloat16 and b16.shape == (m, heads, n)
    np.testing.assert_array_equal(np.asarray(b16), np.asarray(f32.astype(jnp.bfloat16)))
    twin = mm.per_head_xla(v, w, 2, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(twin),
                                  np.asarray(mm.per_head_xla(v, w, 2).astype(jnp.bfloat16)))
    assert mm.per_head_pallas(v[:0], w, 2, out_dtype=jnp.bfloat16,
                              interpret=True).dtype == jnp.bfloat16


# fp8 weights (`fp8.Fp8Block`): (n, k, block, heads, w_contract, overrides). 64-column tiles
# over 32-row blocks (two scales a tile), a ragged block grid, K splits, one row per program;
# K chunks across K blocks (a scale per element) and within one (a scale per column: the
# last three, as 128-deep chunks in 128 x 128 blocks).
FP8_CASES = [(96, 256, (32, 32), None, None, {}),
             (100, 200, (32, 40), None, None, {"splits": 2, "block_k": 32}),
             (64, 96, (16, 32), 3, 1, {}), (48, 64, (16, 32), 3, 2, {"block_n": 16}),
             (100, 256, (32, 64), None, None, {"block_k": 32}),
             (64, 96, (16, 32), 3, 1, {"block_k": 16}),
             (48, 64, (16, 32), 3, 2, {"block_k": 32, "block_n": 16})]


@pytest.mark.parametrize("n,k,block,heads,w_contract,over", FP8_CASES)
@pytest.mark.parametrize("m", [1, 5, 40, 130])  # 16-, 64- and 128-row tiles for bf16
def test_fp8_weights_give_the_bits_of_their_bf16_weights(kernel_impl, m, n, k, block, heads,
                                                         w_contract, over):
    """The kernel dequantizes each fp8 tile as the load-time dequantization does: its result
    is the bf16 weight's kernel result, `==` (rows of 1 to 130, in-kernel and pre-converted
    rows), and the twin's the bf16 twin's."""
    from dsa_jax import fp8

    v, w = _operands(m, n, k, seed=7 * m + n, dtype=jnp.float32, heads=heads,
                     w_contract=w_contract)
    w8 = fp8.quantize_blocks(np.asarray(w) * 10.0, block)
    w16 = w8.dequantize()
    interpret = kernel_impl == "pallas-interpret"
    swap = mm.default_tuning(n, k, heads or 1, m, fp8_weight=True,
                             w_kn=w_contract == 1).swap_ab
    # a few rows: the transposed tile's bits are tested (16- and 64-row ones; not U_k's layout)
    assert swap == (w_contract != 1 and m <= (mm.FP8_SWAP_ROWS if heads is None
                                              else mm.FP8_SWAP_ROWS_PER_HEAD))
    if swap and over.get("block_n", 64) < mm.FP8_MIN_BLOCK_M:  # narrow columns: row tiles
        over = {**over, "swap_ab": False, "block_m": mm.FP8_MIN_BLOCK_M}
    if heads is None:
        got = mm.matmul_pallas(v, w8, interpret=interpret, **over)
        want = mm.matmul_pallas(v, w16, interpret=interpret, **over)
        twins = mm.matmul_xla(v, w8), mm.matmul_xla(v, w16)
    else:
        got = mm.per_head_pallas(v, w8, w_contract, interpret=interpret, **over)
        want = mm.per_head_pallas(v, w16, w_contract, interpret=interpret, **over)
        twins = mm.per_head_xla(v, w8, w_contract), mm.per_head_xla(v, w16, w_contract)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(*map(np.asarray, twins))
    assert np.isfinite(np.asarray(got)).all() and np.abs(np.asarray(got)).max() > 0


@pytest.mark.parametrize("m", [1, 6, 40])
def test_stacked_fp8_and_bf16_rows_give_the_whole_weights_bits(kernel_impl, m):
    """`fp8.StackedRows` (fp8 parts and a bf16 part, as the input GEMM's weight): each part at
    the whole weight's K split (here 2, where the 8-row part alone would take 4) and tiles
    (transposed up to `FP8_SWAP_ROWS` rows, the bf16 part's too), so every column has the
    bits of the whole bf16 weight's."""
    from dsa_jax import fp8

    n, k = 4104, 2048
    v, w = _operands(m, n, k, seed=11 + m, dtype=jnp.float32)
    w = np.asarray(w) * 10
    rows = fp8.StackedRows((fp8.quantize_blocks(w[:4000], (128, 128)),  # a ragged last block
                            fp8.quantize_blocks(w[4000:4096], (32, 128)),
                            jnp.asarray(w[4096:], jnp.bfloat16)))  # 8 unquantized rows
    whole = rows.dequantize()
    assert rows.shape == whole.shape == (n, k)
    assert mm.splits_for(n, k) == 2 and mm.splits_for(8, k) == 4
    interpret = kernel_impl == "pallas-interpret"
    got = mm.matmul_pallas(v, rows, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(mm.matmul_pallas(v, whole, interpret=interpret)))
    np.testing.assert_array_equal(np.asarray(mm.matmul_xla(v, rows)),
                                  np.asarray(mm.matmul_xla(v, whole)))
    # one launch writing each part's columns in place: no concatenation of the parts
    eqns = jax.make_jaxpr(lambda v: mm.matmul_pallas(v, rows, interpret=interpret))(v).eqns
    names = [e.primitive.name for e in eqns]
    assert names.count("pallas_call") == 1 and "concatenate" not in names, names
    part, finish = mm.matmul_part(v, rows, summed=False)
    assert part.out_shape[0].shape == (2, m, 1, n)  # [S, M, H, N]: the whole weight's


def test_the_colaunched_q_gemm_reads_fp8_weights_with_their_bf16_bits(kernel_impl):
    """The decode's top-k and q_b GEMM in one launch (`pallas/topk_matmul.py`, via
    `matmul_part`): an `fp8.Fp8Block` q_b gives the bf16 weight's pools and rows, `==`."""
    from dsa_jax import fp8
    from dsa_jax.pallas import topk_matmul as tm

    interpret = kernel_impl == "pallas-interpret"
    scores = jax.random.normal(jax.random.key(0), (2, 4, 300))
    v = jax.random.normal(jax.random.key(1), (2, 4, 96))
    w8 = fp8.quantize_blocks(np.asarray(jax.random.normal(jax.random.key(2), (256, 96))),
                             (32, 32))
    assert tm.shares_launch(scores.shape, v.shape, w8.shape, interpret, tm.tk.PoolTopkTuning(),
                            None)
    got = tm.topk_matmul_pallas(scores, 16, v, w8, interpret=interpret)
    want = tm.topk_matmul_pallas(scores, 16, v, w8.dequantize(), interpret=interpret)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("heads, w_contract", [(None, None), (3, 1), (3, 2)])
def test_a_stack_of_fp8_layers_is_read_in_place_with_each_layers_bits(kernel_impl, heads,
                                                                      w_contract):
    """The model's scan hands the kernels a stack of layers and an index (`stacked.LayerOf`):
    a stack of `Fp8Block`s (values and scales `[G, ...]`) read at layer 2 gives that layer's
    bf16 stack result, `==`, and the twins the same."""
    from dsa_jax import fp8

    interpret = kernel_impl == "pallas-interpret"
    v, w = _operands(5, 64, 96, seed=21, dtype=jnp.float32, heads=heads, w_contract=w_contract)
    ws = np.stack([np.asarray(w) * (i + 1) for i in range(3)])  # [G, ...]
    w8 = fp8.quantize_blocks(ws, (32, 32))
    w16 = w8.dequantize()
    at = jnp.int32(2)
    if heads is None:
        got = mm.matmul_pallas(v, w8, at, interpret=interpret)
        want = mm.matmul_pallas(v, w16, at, interpret=interpret)
        twins = mm.matmul_xla(v, w8, at), mm.matmul_xla(v, w16, at)
    else:
        got = mm.per_head_pallas(v, w8, w_contract, at, interpret=interpret)
        want = mm.per_head_pallas(v, w16, w_contract, at, interpret=interpret)
        twins = mm.per_head_xla(v, w8, w_contract, at), mm.per_head_xla(v, w16, w_contract, at)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(*map(np.asarray, twins))
    alone = mm.matmul_xla(v, w16[2]) if heads is None else mm.per_head_xla(v, w16[2],
                                                                           w_contract)
    np.testing.assert_array_equal(np.asarray(twins[0]), np.asarray(alone))
