"""The cache-write kernels against their jnp definitions ("pallas-interpret", and "pallas"
under the `gpu` marker), and every implementation's handling of positions past the cache.

Tolerances (`dsa_jax.testing.assert_stored_close`): the kernels compute the same fp32 formulas
(RMSNorm / LayerNorm over C or Di terms, a softmax over KP members) with other reduction
orders, so fp32 results differ by a few ulps (rtol 1e-6 over these short reductions). A stored
bf16 / fp8 value may then round to the neighbouring code when the fp32 value sits on a rounding
boundary: allowed for under 1% of the elements, and never by more than one step of that dtype
(`storage_step`: eps, 2^-7 relative for bf16, 2^-3 for e4m3).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.pallas.common import KernelLimitError
from dsa_jax.pallas.latent_write import latent_write_pallas
from dsa_jax.pallas.sparse_attend import sparse_attend_pallas


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
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


@pytest.mark.parametrize("kpool", [1, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_index_write_matches_definition(kernel_impl, kpool, dtype):
    args = T.index_write_inputs(kpool, kpool, dtype)
    want = T.run_op("index_write", "xla", *args)
    got = T.run_op("index_write", kernel_impl, *args)
    for w_, g_ in zip(want[:2], got[:2], strict=True):  # index_k, index_g
        T.assert_stored_close(g_, w_, dtype)
        chex.assert_type(g_, jnp.dtype(dtype))
    chex.assert_trees_all_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    written = np.asarray(want[2]) != T.POISON
    assert written.any() and not written.all()


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


@pytest.mark.parametrize("nb,dtype,refused", [
    (65536, jnp.float8_e4m3fn, True),  # 2 GiB of fp8: offsets reach 2**31
    (131072, jnp.float8_e4m3fn, True),  # 4 GiB: the 64-bit switch needs more than 2**32 bytes
    (131073, jnp.float8_e4m3fn, False),  # past 2**32 bytes: 64-bit offsets
    (65535, jnp.float8_e4m3fn, False),  # below 2**31 elements
    (65536, jnp.bfloat16, True),  # exactly 2**31 elements, 2**32 bytes
])
def test_triton_kernels_refuse_a_cache_their_offsets_would_wrap(nb, dtype, refused):
    """A latent cache of 2**31 or more elements and at most 2**32 bytes is refused by the
    Triton write and gather-attend before anything runs (traced only: no memory is used);
    one block fewer or more passes."""
    cache = jax.ShapeDtypeStruct((nb, 64, 512), dtype)
    kv = jax.random.normal(jax.random.key(0), (1, 1, 512))
    table = jnp.zeros((1, 1), jnp.int32)
    pos, valid = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
    q = jax.random.normal(jax.random.key(1), (1, 1, 8, 512))
    sel = jnp.zeros((1, 1, 4), jnp.int32)
    calls = [
        lambda c: latent_write_pallas(kv, jnp.ones(512), c, jnp.float32(1.0), table, pos,
                                      valid, eps=1e-6, interpret=True),
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
