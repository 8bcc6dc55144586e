"""The cache-write kernels (interpret mode) against their jnp definitions.

Tolerances: the kernels compute the same fp32 formulas (RMSNorm / LayerNorm over C or Di
terms, a softmax over KP members) with other reduction orders, so fp32 results differ by a few
ulps (rtol 1e-6 over these short reductions). A stored bf16 / fp8 value may then round to the
neighbouring code when the fp32 value sits on a rounding boundary: allowed for at most a
handful of elements, and never by more than one step of that dtype (2^-8 relative for bf16,
2^-3 for e4m3).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax.pallas import index_write, latent_write

POISON = 1234.5


def _close_stored(got, want, step):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    want = np.asarray(jnp.asarray(want).astype(jnp.float32))
    diff = np.abs(got - want)
    off = diff > 1e-6 * np.abs(want) + 1e-30
    assert off.mean() < 0.01, off.mean()
    assert np.all(diff <= step * np.abs(want) + 1e-6), diff.max()


def _rows(key, b, r, lengths, max_pos):
    pos = jnp.asarray(lengths)[:, None] + jnp.arange(r)
    valid = (jnp.arange(r)[None, :] < jnp.asarray([r, r - 1, 0][:b])[:, None]) & (pos < max_pos)
    return pos.astype(jnp.int32), valid


@pytest.mark.parametrize("dtype,step", [("float32", 0.0), ("bfloat16", 2.0 ** -8),
                                        ("float8_e4m3fn", 2.0 ** -3)])
@pytest.mark.parametrize("c", [24, 64])
def test_latent_write_matches_definition(dtype, step, c):
    keys = jax.random.split(jax.random.key(c), 4)
    b, r, nb, bs, mb = 3, 4, 14, 8, 4
    kv_raw = jax.random.normal(keys[0], (b, r, c)) * 3
    norm_w = 1 + 0.3 * jax.random.normal(keys[1], (c,))
    tables = jax.random.permutation(keys[2], nb)[: b * mb].reshape(b, mb).astype(jnp.int32)
    cache = jnp.full((nb, bs, c), POISON if dtype != "float8_e4m3fn" else 400.0, dtype)
    pos, valid = _rows(keys[3], b, r, [5, 13, 2], mb * bs)
    args = (kv_raw, norm_w, cache, jnp.float32(0.02), tables, pos, valid)
    want = latent_write.latent_write_xla(*args, eps=1e-5)
    got = latent_write.latent_write_pallas(*args, eps=1e-5, interpret=True)
    # Untouched slots keep their contents (the cache is written in place).
    untouched = np.asarray(want.astype(jnp.float32)) == np.asarray(cache.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32))[untouched],
                                  np.asarray(cache.astype(jnp.float32))[untouched])
    assert untouched.mean() > 0.5 and not untouched.all()
    _close_stored(got, want, step)


@pytest.mark.parametrize("kpool", [1, 3, 4])
@pytest.mark.parametrize("dtype,step", [("float32", 0.0), ("bfloat16", 2.0 ** -8)])
def test_index_write_matches_definition(kpool, dtype, step):
    keys = jax.random.split(jax.random.key(kpool), 8)
    b, r, di, tmax = 3, 4, 12, 24
    p = tmax // kpool
    k_raw = jax.random.normal(keys[0], (b, r, di)) * 2 + 0.5
    g = jax.random.normal(keys[1], (b, r, di))
    norm_w = 1 + 0.3 * jax.random.normal(keys[2], (di,))
    norm_b = 0.3 * jax.random.normal(keys[3], (di,))
    ape = 0.5 * jax.random.normal(keys[4], (kpool, di))
    # Caches hold earlier rows (random), so completed pools mix old and new members.
    index_k = jax.random.normal(keys[5], (b, tmax, di)).astype(dtype)
    index_g = jax.random.normal(keys[6], (b, tmax, di)).astype(dtype)
    pool_keys = jnp.full((b, p, di), POISON, jnp.float32)
    pos, valid = _rows(keys[7], b, r, [5, 13, 2], tmax)
    args = (k_raw, g, norm_w, norm_b, ape, index_k, index_g, pool_keys, pos, valid)
    want = index_write.index_write_xla(*args)
    got = index_write.index_write_pallas(*args, interpret=True)
    for name, w_, g_ in zip(("index_k", "index_g"), want[:2], got[:2], strict=True):
        _close_stored(g_, w_, step)
        assert g_.dtype == jnp.dtype(dtype), name
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    written = np.asarray(want[2]) != POISON
    assert written.any() and not written.all()


def test_positions_past_the_cache_write_nothing():
    """An unchecked step past max_context must drop its writes in every implementation,
    never redirect them (a kernel writing flat row b*T + t would hit the next sequence or
    run off the array)."""
    keys = jax.random.split(jax.random.key(7), 4)
    b, r, c, nb, bs, mb = 2, 4, 16, 8, 4, 4  # 16 positions per sequence
    pos = jnp.asarray([[14, 15, 16, 17], [15, 16, 17, 18]], jnp.int32)
    valid = jnp.ones((b, r), bool)
    tables = jnp.arange(b * mb, dtype=jnp.int32).reshape(b, mb)
    cache = jnp.full((nb, bs, c), POISON, jnp.float32)
    args = (jax.random.normal(keys[0], (b, r, c)), jnp.ones((c,)), cache, jnp.float32(1.0),
            tables, pos, valid)
    for got in (latent_write.latent_write_xla(*args, eps=1e-5),
                latent_write.latent_write_pallas(*args, eps=1e-5, interpret=True)):
        changed = np.argwhere((np.asarray(got) != POISON).any(-1))
        assert {tuple(map(int, x)) for x in changed} == {(3, 2), (3, 3), (7, 3)}
    tmax, di, kp = 16, 8, 4
    iargs = (jax.random.normal(keys[1], (b, r, di)), jax.random.normal(keys[2], (b, r, di)),
             jnp.ones((di,)), jnp.zeros((di,)), jnp.zeros((kp, di)),
             jnp.full((b, tmax, di), POISON), jnp.zeros((b, tmax, di)),
             jnp.full((b, tmax // kp, di), POISON), pos, valid)
    for got in (index_write.index_write_xla(*iargs),
                index_write.index_write_pallas(*iargs, interpret=True)):
        rows = np.argwhere((np.asarray(got[0]) != POISON).any(-1))
        assert {tuple(map(int, x)) for x in rows} == {(0, 14), (0, 15), (1, 15)}
        pools = np.argwhere((np.asarray(got[2]) != POISON).any(-1))
        assert {tuple(map(int, x)) for x in pools} == {(0, 3), (1, 3)}
