"""The cache-write kernels against their jnp definitions ("pallas-interpret", and "pallas"
under the `gpu` marker), and every implementation's handling of positions past the cache.

Tolerances (`dsa_jax.testing.assert_stored_close`): the kernels compute the same fp32 formulas
(RMSNorm / LayerNorm over C or Di terms, a softmax over KP members) with other reduction
orders, so fp32 results differ by a few ulps (rtol 1e-6 over these short reductions). A stored
bf16 / fp8 value may then round to the neighbouring code when the fp32 value sits on a rounding
boundary: allowed for under 1% of the elements, and never by more than one step of that dtype
(`storage_step`: eps, 2^-7 relative for bf16, 2^-3 for e4m3).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.implementation import OPS
from dsa_jax.pallas import index_write as iw
from dsa_jax.pallas import latent_write as lw
from dsa_jax.pallas.common import KernelLimitError, triton_offsets_wrap
from dsa_jax.pallas.latent_write import latent_write_pallas
from dsa_jax.pallas.sparse_attend import sparse_attend_pallas


# The default cache dtype first (the default suite runs the first interpret case only).
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float32", "bfloat16"])
@pytest.mark.parametrize("c", [24, 64])
def test_latent_write_matches_definition(kernel_impl, dtype, c):
    args = T.latent_write_inputs(c, dtype, c)
    cache = args[2]
    want = T.run_op("latent_write", "xla", *args, eps=1e-5)
    got = T.run_op("latent_write", kernel_impl, *args, eps=1e-5)
    # Untouched slots keep their contents (the cache is written in place).
    as_f32 = lambda a: np.asarray(a.astype(jnp.float32))
    untouched = as_f32(want) == as_f32(cache)
    T.assert_trees_bitwise_equal(np.asarray(got)[untouched], np.asarray(cache)[untouched])
    assert untouched.mean() > 0.5 and not untouched.all()
    T.assert_stored_close(got, want, dtype)


# The released checkpoint's KP and the default index dtype first.
@pytest.mark.parametrize("kpool", [4, 1, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_index_write_matches_definition(kernel_impl, kpool, dtype):
    args = T.index_write_inputs(kpool, kpool, dtype)
    want = T.run_op("index_write", "xla", *args)
    got = T.run_op("index_write", kernel_impl, *args)
    for w_, g_ in zip(want[:2], got[:2], strict=True):  # index_k, index_g
        T.assert_stored_close(g_, w_, dtype)
        chex.assert_type(g_, jnp.dtype(dtype))
    chex.assert_type(got[2], jnp.dtype(dtype))  # pool keys in the index dtype
    if dtype == "float32":
        chex.assert_trees_all_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    else:  # fp32 keys of other sums, each rounded once: a neighbouring code at most
        T.assert_stored_close(got[2], want[2], dtype)
    written = np.asarray(want[2]) != np.asarray(jnp.asarray(T.POISON, dtype))
    assert written.any() and not written.all()


def _wide(rng, rows, *parts):
    """The parts `[B, R, n]`, random columns before each and after the last: a GEMM output
    holding several projections. Returns it and each part's first column."""
    cols, starts, at = [], [], 0
    for i, part in enumerate(parts):
        noise = rng.standard_normal((*rows, 3 - i + 2 * i)).astype(np.float32)
        cols += [noise, np.asarray(part, np.float32)]
        starts.append(at + noise.shape[-1])
        at = starts[-1] + part.shape[-1]
    cols.append(rng.standard_normal((*rows, 4)).astype(np.float32))
    return jnp.asarray(np.concatenate(cols, axis=-1)), starts


def test_writes_read_their_columns_in_place(impl):
    """`col` / `cols`: rows read at column offsets of one wider array (the x projection's
    output, as the layer passes it) store the same bytes as the rows passed alone."""
    rng = np.random.default_rng(3)
    args = T.latent_write_inputs(5, "float8_e4m3fn", 24)
    wide, (col,) = _wide(rng, args[0].shape[:2], args[0])
    want = T.run_op("latent_write", impl, *args, eps=1e-5)
    got = T.run_op("latent_write", impl, wide, *args[1:], eps=1e-5, col=col)
    T.assert_trees_bitwise_equal(np.asarray(got), np.asarray(want))
    iargs = T.index_write_inputs(6, 4, "bfloat16")
    wide, (k0, g0) = _wide(rng, iargs[0].shape[:2], iargs[0], iargs[1])
    want = T.run_op("index_write", impl, *iargs)
    got = T.run_op("index_write", impl, wide, wide, *iargs[2:], cols=(k0, g0))
    T.assert_trees_bitwise_equal([np.asarray(a) for a in got], [np.asarray(a) for a in want])


def test_write_columns_out_of_range_are_refused():
    args = T.latent_write_inputs(5, "float32", 24)
    with pytest.raises(ValueError, match="col=20"):
        lw.latent_write_xla(jnp.zeros((3, 4, 40)), *args[1:], eps=1e-5, col=20)
    with pytest.raises(ValueError, match="C = 24"):
        lw.latent_write_xla(jnp.zeros((3, 4, 30)), *args[1:], eps=1e-5)
    iargs = T.index_write_inputs(6, 4, "float32")
    wide = jnp.zeros((*iargs[0].shape[:2], 30))
    with pytest.raises(ValueError, match="cols=\\(3, 20\\)"):
        iw.index_write_xla(wide, wide, *iargs[2:], cols=(3, 20))


def test_positions_past_the_cache_write_nothing(impl):
    """An unchecked step past max_context must drop its writes in every implementation,
    never redirect them (a kernel writing flat row b*T + t would hit the next sequence or
    run off the array)."""
    b, r, c, nb, bs, mb = 2, 4, 16, 8, 4, 4  # 16 positions per sequence
    pos = jnp.asarray([[14, 15, 16, 17], [15, 16, 17, 18]], jnp.int32)
    valid = jnp.ones((b, r), bool)
    tables = jnp.arange(b * mb, dtype=jnp.int32).reshape(b, mb)
    cache = jnp.full((nb, bs, c), T.POISON, jnp.float32)
    args = (T.random_rows(7, b, r, c), jnp.ones((c,)), cache, jnp.float32(1.0), tables, pos,
            valid)
    got = T.run_op("latent_write", impl, *args, eps=1e-5)
    changed = np.argwhere((np.asarray(got) != T.POISON).any(-1))
    assert {tuple(map(int, x)) for x in changed} == {(3, 2), (3, 3), (7, 3)}
    tmax, di, kp = 16, 8, 4
    iargs = (T.random_rows(8, b, r, di), T.random_rows(9, b, r, di), jnp.ones((di,)),
             jnp.zeros((di,)), jnp.zeros((kp, di)), jnp.full((b, tmax, di), T.POISON),
             jnp.zeros((b, tmax, di)), jnp.full((b, tmax // kp, di), T.POISON), pos, valid)
    got = T.run_op("index_write", impl, *iargs)
    rows = np.argwhere((np.asarray(got[0]) != T.POISON).any(-1))
    assert {tuple(map(int, x)) for x in rows} == {(0, 14), (0, 15), (1, 15)}
    pools = np.argwhere((np.asarray(got[2]) != T.POISON).any(-1))
    assert {tuple(map(int, x)) for x in pools} == {(0, 3), (1, 3)}


def _bytes(a) -> np.ndarray:
    a = jnp.asarray(a)
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}")))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("c", [23, 24, 64])
def test_xla_store_writes_the_kernels_bytes(dtype, c):
    """The write's XLA store (the rows computed by the kernel, scattered by XLA: what a cache
    of 2..4 GiB of fp8 gets) stores exactly the bytes of the kernel's in-place store: random
    rows, odd widths, a poisoned cache, invalid rows, permuted tables."""
    args = T.latent_write_inputs(c + 100, dtype, c)
    cache = args[2]
    kernel = lw.store_in_place(*args, eps=1e-5, interpret=True)
    xla = lw.store_by_xla(*args, eps=1e-5, interpret=True)
    assert (_bytes(xla) == _bytes(kernel)).all()
    written = (_bytes(kernel) != _bytes(cache)).any(-1)  # [NB, bs]
    assert 0 < written.sum() < written.size / 2


# (cache shape, dtype, offsets wrap): 2**31 elements of fp8 (2 GiB) through exactly 2**32 bytes
# wrap; past 2**32 bytes the lowering switches to 64-bit offsets.
ZONE = [
    ((65535, 64, 512), jnp.float8_e4m3fn, False),  # one block below 2**31 elements
    ((65536, 64, 512), jnp.float8_e4m3fn, True),  # 2 GiB: offsets reach 2**31
    ((98304, 64, 512), jnp.float8_e4m3fn, True),  # 3 GiB
    ((131072, 64, 512), jnp.float8_e4m3fn, True),  # 4 GiB: the B=64 x 16K x 8-layer pool
    ((131073, 64, 512), jnp.float8_e4m3fn, False),  # past 2**32 bytes: 64-bit offsets
    ((65536, 64, 512), jnp.bfloat16, True),  # exactly 2**31 elements, 2**32 bytes
    ((65536, 64, 512), jnp.float32, False),  # 2**30 elements
]


@pytest.mark.parametrize("shape,dtype,wraps", ZONE)
def test_store_rule_follows_the_offset_limit(shape, dtype, wraps):
    """The addressing rule itself, at sizes past 2**31 (nothing allocated): where Triton's
    offsets would wrap the write stores through XLA, elsewhere in place (the in-place store
    refuses such a cache: `test_triton_kernels_refuse_a_cache_their_offsets_would_wrap`)."""
    nb, bs, c = shape
    assert triton_offsets_wrap(shape, dtype) == wraps
    assert triton_offsets_wrap((nb * bs, c), dtype) == wraps  # the flat view the kernel sees
    assert lw.pick_store(shape, dtype) == ("xla" if wraps else "kernel")


def test_a_cache_xla_stores_takes_no_shared_launch():
    """`latent_write_part` (the kernel storing in place, for `step.decode_front`'s launch)
    refuses a cache whose offsets would wrap (traced only), where `pick_store` says "xla";
    the decode front then writes alone."""
    kv, table = jnp.zeros((1, 1, 512)), jnp.zeros((1, 2), jnp.int32)
    pos, valid = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
    for nb, ok in ((131072, False), (1024, True)):
        cache = jax.ShapeDtypeStruct((nb, 64, 512), jnp.float8_e4m3fn)
        def fn(c):
            part, _ = lw.latent_write_part(kv, jnp.ones(512), c, 1.0, table, pos, valid,
                                           eps=1e-6)
            return part.out_shape[0]

        if ok:
            assert jax.eval_shape(fn, cache).shape == (nb * 64, 512)
        else:
            assert lw.pick_store(cache.shape, cache.dtype) == "xla"
            with pytest.raises(KernelLimitError, match=r"latent cache .* bytes"):
                jax.eval_shape(fn, cache)


def _write_call(store=latent_write_pallas):
    kv = jax.random.normal(jax.random.key(0), (2, 3, 512))
    # The top blocks of a 4 GiB pool: flat rows up to 2**23 - 1, byte offsets past 2**31.
    table = jnp.asarray([[131071, 131070], [0, 98304]], jnp.int32)
    pos = jnp.asarray([[126, 127, 64], [0, 1, 64]], jnp.int32)
    valid = jnp.ones((2, 3), bool)
    return lambda c: store(kv, jnp.ones(512), c, jnp.float32(1.0), table, pos, valid,
                           eps=1e-6, interpret=True)


@pytest.mark.parametrize("nb,zone", [(131072, True), (98304, True), (131073, False),
                                     (1024, False)])
def test_no_triton_kernel_gets_a_cache_it_cannot_address(nb, zone):
    """Traced only (no memory): in the zone, the write's Pallas call sees only the rows
    `[N, C]` and a scatter stores them at the rows' flat slots (here in the top GiB: byte
    offsets past 2**31, which XLA addresses); elsewhere the kernel gets the cache aliased."""
    cache = jax.ShapeDtypeStruct((nb, 64, 512), jnp.float8_e4m3fn)
    jaxpr = jax.make_jaxpr(_write_call())(cache)
    eqns = list(jaxpr.jaxpr.eqns)
    calls = [e for e in eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1
    biggest = max(int(np.prod(v.aval.shape)) for v in calls[0].invars)
    scatters = [e for e in eqns if e.primitive.name.startswith("scatter")]
    if zone:
        assert biggest == 6 * 512 and len(scatters) == 1  # the rows [N, C], no cache
    else:
        assert biggest == nb * 64 * 512 and not scatters
    assert jax.eval_shape(_write_call(), cache).shape == cache.shape


def test_flat_slots_past_2_31_bytes():
    """The row indices the scatter gets for the last blocks of a 4 GiB fp8 pool: exact int32
    rows (below 2**23), whose byte offsets (row * 512) are past 3 * 2**30 (32-bit: negative)."""
    table = jnp.asarray([[131071, 131070], [0, 98304]], jnp.int32)
    pos = jnp.asarray([[126, 127, 64], [0, 1, 64]], jnp.int32)
    got = np.asarray(lw.flat_slots(pos, jnp.ones((2, 3), bool), table, 64))
    want = np.asarray([[131070 * 64 + 62, 131070 * 64 + 63, 131070 * 64],
                       [0, 1, 98304 * 64]])
    assert (got == want).all() and int(got.max()) * 512 > 2 ** 31 + 2 ** 30


@pytest.mark.parametrize("nb,dtype,refused", [
    (65536, jnp.float8_e4m3fn, True),  # 2 GiB of fp8: offsets reach 2**31
    (131072, jnp.float8_e4m3fn, True),  # 4 GiB: the 64-bit switch needs more than 2**32 bytes
    (131073, jnp.float8_e4m3fn, False),  # past 2**32 bytes: 64-bit offsets
    (65535, jnp.float8_e4m3fn, False),  # below 2**31 elements
    (65536, jnp.bfloat16, True),  # exactly 2**31 elements, 2**32 bytes
])
def test_triton_kernels_refuse_a_cache_their_offsets_would_wrap(nb, dtype, refused):
    """A latent cache of 2**31 or more elements and at most 2**32 bytes is refused by the
    Triton gather-attend and by the write's in-place kernel store (`store_in_place`) before
    anything runs (traced only: no memory is used); one block fewer or more passes. The
    write's default store takes such a cache (through XLA)."""
    cache = jax.ShapeDtypeStruct((nb, 64, 512), dtype)
    q = jax.random.normal(jax.random.key(1), (1, 1, 8, 512))
    sel = jnp.zeros((1, 1, 4), jnp.int32)
    table = jnp.zeros((1, 1), jnp.int32)
    calls = [
        _write_call(lw.store_in_place),
        lambda c: sparse_attend_pallas(q, c, jnp.float32(1.0), table, sel, softmax_scale=0.1,
                                       interpret=True),
    ]
    for call in calls:
        if refused:
            with pytest.raises(KernelLimitError, match=r"latent cache .* bytes: the Pallas Triton "
                                                 r"kernels address .* 32-bit offsets"):
                jax.eval_shape(call, cache)
        else:
            jax.eval_shape(call, cache)
    jax.eval_shape(_write_call(), cache)


@pytest.mark.parametrize("rows,stacked", [(4, False), (40, False), (1, True), (40, True)])
def test_index_write_lowers_for_cuda(rows, stacked):
    """The Triton lowering (any host) of the indexer write at GLM shapes, read in place from a
    wider x projection: a decode's rows and a prompt chunk longer than the ring (which runs
    the late-rows launch too), its weights alone or in stacks (the model's scan); lowering
    errors surface here, before the GPU."""
    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    b, di, kp, ring, pools = 2, 128, 4, 16, 4096
    g = (4,) if stacked else ()

    def fn(xw, norm_w, norm_b, ape, index_k, index_g, keys, pos, valid):
        return iw.index_write_pallas(xw, xw, norm_w, norm_b, ape, index_k, index_g, keys, pos,
                                     valid, cols=(2048, 2048 + di),
                                     weight_layer=jnp.int32(1) if stacked else None)

    args = (jax.ShapeDtypeStruct((b, rows, 2336), f32), jax.ShapeDtypeStruct((*g, di), f32),
            jax.ShapeDtypeStruct((*g, di), f32), jax.ShapeDtypeStruct((*g, kp, di), f32),
            jax.ShapeDtypeStruct((b, ring, di), bf16), jax.ShapeDtypeStruct((b, ring, di), bf16),
            jax.ShapeDtypeStruct((b, pools, di), bf16 if stacked else f32),  # both key dtypes
            jax.ShapeDtypeStruct((b, rows), i32),
            jax.ShapeDtypeStruct((b, rows), jnp.bool_))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == (3 if rows > ring - kp + 1 else 2)


def _write_fn(name: str, impl: str):
    """Op `name`'s definition or kernel under `impl`, taking a traced index keyword."""
    op = OPS[name]
    if impl == "xla":
        return op.reference
    return functools.partial(op.kernel, interpret=impl == "pallas-interpret")


def test_writes_read_stacked_weights_in_place(impl):
    """`layer=` / `weight_layer=`: the writes read their weights (the latent RMSNorm's, the
    indexer LayerNorm's and ape) at an index in stacks `[G, ...]` (the model's scan) and store
    the bytes the layer's own weights give, an index past G clamped; a stack of the wrong
    shape or a non-scalar index is refused."""
    args = T.latent_write_inputs(5, "float8_e4m3fn", 24)
    stack = jnp.stack([args[1] * (1 + 0.1 * s) for s in range(3)])  # [G, C]
    latent = _write_fn("latent_write", impl)
    write = jax.jit(lambda at, raw, *rest: latent(raw, stack, *rest, eps=1e-5, layer=at))
    for at in (0, 2, 9):
        want = T.run_op("latent_write", impl, args[0], stack[min(at, 2)], *args[2:], eps=1e-5)
        got = write(jnp.int32(at), args[0], *args[2:])
        T.assert_trees_bitwise_equal(np.asarray(got), np.asarray(want))
    iargs = T.index_write_inputs(6, 4, "bfloat16")
    stacks = [jnp.stack([a * (1 + 0.1 * s) for s in range(3)]) for a in iargs[2:5]]
    index = _write_fn("index_write", impl)
    iwrite = jax.jit(lambda at, a: index(a[0], a[1], *stacks, *a[5:], weight_layer=at))
    for at in (1, 5):
        want = T.run_op("index_write", impl, *iargs[:2], *(s[min(at, 2)] for s in stacks),
                        *iargs[5:])
        got = iwrite(jnp.int32(at), iargs)
        T.assert_trees_bitwise_equal([np.asarray(a) for a in got], [np.asarray(a) for a in want])
    with pytest.raises(ValueError, match=r"a stacked latent_write's norm_w must be \[G, 24\]"):
        latent(args[0], stack[:, :5], *args[2:], eps=1e-5, layer=jnp.int32(0))
    with pytest.raises(ValueError, match="index_write's norm_w's layer must be a scalar"):
        index(*iargs[:2], *stacks, *iargs[5:], weight_layer=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"index_write's ape has shape \(3, 4, 12\)"):
        index(*iargs[:2], stacks[0][0], stacks[1][0], stacks[2], *iargs[5:])


@pytest.mark.parametrize("rows,stacked", [(1, False), (1, True), (256, True)])
def test_latent_write_lowers_for_cuda(rows, stacked):
    """The Triton lowering (any host) of the latent write at GLM shapes (C 512 read in place
    from the x projection's 2336 columns, an fp8 cache), its norm weight alone or in a stack
    (the model's scan): lowering errors surface here, before the GPU."""
    f32, i32 = jnp.float32, jnp.int32
    b, c, nb, bs, mb = 2, 512, 64, 64, 16

    def fn(xw, norm_w, cache, tables, pos, valid):
        return lw.latent_write_pallas(xw, norm_w, cache, jnp.float32(0.02), tables, pos, valid,
                                      eps=1e-5, col=1536,
                                      layer=jnp.int32(2) if stacked else None)

    args = (jax.ShapeDtypeStruct((b, rows, 2336), f32),
            jax.ShapeDtypeStruct((4, c) if stacked else (c,), f32),
            jax.ShapeDtypeStruct((nb, bs, c), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((b, mb), i32), jax.ShapeDtypeStruct((b, rows), i32),
            jax.ShapeDtypeStruct((b, rows), jnp.bool_))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1


def test_a_decodes_writes_run_the_shared_launchs_warps_a_prompts_their_own():
    """The write kernels' warps follow the rows per sequence (`index_write.warps_for`,
    `latent_write.warps_for`): a decode's or verify's at the decode front's 4 (its parts
    share launches at that count, `decode_front`), a prompt's at 1 and 2."""
    for r in (1, 4, iw.SHARED_ROWS):
        assert iw.warps_for(r) == lw.warps_for(r) == 4
    assert iw.warps_for(iw.SHARED_ROWS + 1) == 1
    assert lw.warps_for(2048) == 2
