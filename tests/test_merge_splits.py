"""The split-merge kernel (`pallas/merge_splits.py`) against its jnp twin
(`sparse_attend.merge_splits`), in Pallas interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax.pallas.merge_splits import merge_splits_pallas, padded_rows_jnp
from dsa_jax.pallas.sparse_attend import merge_splits


def _partials(n, s, hp, cp, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    o = jax.random.normal(k[0], (n, s, hp, cp))  # normalized partials
    m = 4.0 * jax.random.normal(k[1], (n, s, hp))
    l = jax.random.uniform(k[2], (n, s, hp), minval=0.5, maxval=40.0)
    # Split 0 of row 0 saw nothing (the kernels' empty-split values); row 1 saw nothing at all.
    o = o.at[0, 0].set(0.0).at[1].set(0.0)
    m = m.at[0, 0].set(-1e30).at[1].set(-1e30)
    l = l.at[0, 0].set(0.0).at[1].set(0.0)
    return o, m, l


@pytest.mark.parametrize("n,s,hp,cp", [(3, 3, 16, 32), (2, 5, 32, 384), (4, 1, 16, 16),
                                      (2, 33, 16, 64)])  # 33: a decode row's splits
def test_merge_kernel_matches_twin(n, s, hp, cp):
    o, m, l = _partials(n, s, hp, cp, seed=n * 10 + s)
    got = np.asarray(merge_splits_pallas(o, m, l, interpret=True))
    want = np.asarray(merge_splits(o, m, l))
    # Both are the weighted mean of S fp32 partials with weights in (0, 1] times l: each
    # sums S products in another order (and FMA or not), so per element the error is at most
    # about (2S + 4) roundings of the largest |o| the row holds.
    eps = np.finfo(np.float32).eps
    bound = (2 * s + 4) * eps * np.abs(np.asarray(o)).max(axis=(1, 3))  # [N, Hp]
    assert (np.abs(got - want) <= bound[:, :, None]).all()
    assert (got[1] == 0).all()  # a row no split saw is 0
    if s == 1:
        assert (got == want).all()


def test_merge_kernel_refuses_odd_heads():
    o, m, l = _partials(2, 2, 16, 32, seed=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        merge_splits_pallas(o[:, :, :8], m[:, :, :8], l[:, :, :8], interpret=True)


@pytest.mark.parametrize("rows_in,rows_out,s", [(1, 4, 3), (2, 3, 1), (3, 3, 2)])
def test_merge_kernel_writes_the_padded_block(rows_in, rows_out, s):
    """With `pad` and a dtype: each sequence's merged rows rounded once, then its fill rows
    (0 for padding, NaN for a real row past the caller's promise): the same bits as the plain
    merge rounded and padded by the twin (`padded_rows_jnp`)."""
    b, hp, cp = 2, 32, 256
    o, m, l = _partials(b * rows_in, s, hp, cp, seed=7 * rows_out + s)
    fill = jnp.where(jax.random.bernoulli(jax.random.key(s), 0.5, (b, rows_out)),
                     jnp.nan, 0.0)  # [B, Rt]
    plain = merge_splits_pallas(o, m, l, interpret=True)  # [N, Hp, Cp] f32
    got = merge_splits_pallas(o, m, l, interpret=True, dtype=jnp.bfloat16, pad=(rows_in, fill))
    want = padded_rows_jnp(plain.reshape(b, rows_in, hp, cp), fill, jnp.bfloat16)
    assert got.shape == (b * rows_out, hp, cp) and got.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32).reshape(got.shape)
    assert np.array_equal(got, want, equal_nan=True)
    rows = got.reshape(b, rows_out, hp, cp)
    assert not np.isnan(rows[:, :rows_in]).any()
    fill = np.asarray(fill)
    for i in range(b):
        for r in range(rows_in, rows_out):
            assert (np.isnan(rows[i, r]).all() if np.isnan(fill[i, r]) else
                    (rows[i, r] == 0).all())


def test_merge_kernel_refuses_a_pad_that_does_not_fit():
    o, m, l = _partials(4, 2, 16, 32, seed=2)
    with pytest.raises(ValueError, match="rows_in=3"):
        merge_splits_pallas(o, m, l, interpret=True, pad=(3, jnp.zeros((2, 4))))
    with pytest.raises(ValueError, match="rows_in=2"):
        merge_splits_pallas(o, m, l, interpret=True, pad=(2, jnp.zeros((2, 1))))


@pytest.mark.parametrize("splits,pad", [(16, True), (3, False), (1, True), (33, True)])
def test_merge_kernel_lowers_for_cuda(splits, pad):
    """The Triton lowering (any host) at a decode's GLM shapes: 64 rows, 64 heads, C 512,
    padded to 4 rows per sequence in bf16 (lowering errors surface here, before the GPU)."""
    f32 = jnp.float32
    n, hp, cp = 64, 64, 512

    def fn(o, m, l, fill):
        return merge_splits_pallas(o, m, l, dtype=jnp.bfloat16,
                                   pad=(1, fill) if pad else None)

    args = (jax.ShapeDtypeStruct((n, splits, hp, cp), f32),
            jax.ShapeDtypeStruct((n, splits, hp), f32), jax.ShapeDtypeStruct((n, splits, hp), f32),
            jax.ShapeDtypeStruct((n, 4), f32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("n,s,pad", [(3, 3, None), (2, 33, (1, 4)), (4, 1, (2, 3))])
def test_merge_kernel_scales_half_partials(n, s, pad):
    """f16 partials in the cache's units (the Mosaic kernel's with splits, values up to e4m3's
    448) and the cache's scale: the kernel against the twin (f32 sums of the same f16 values,
    the scale applied to the merged rows), and the twin against the f32 merge of the scaled
    partials. With a pad, the kernel's rows are the twin's padded by `padded_rows_jnp`."""
    hp, cp, kv = 16, 64, 0.0137
    o, m, l = _partials(n, s, hp, cp, seed=31 + s)
    o16 = (100.0 * o).astype(jnp.float16)  # |o| up to ~450, some below f16's normal range
    o16 = o16.at[0, -1, 0, :4].set(
        jnp.asarray([448.0, -448.0, 2.0 ** -20, -(2.0 ** -24)], jnp.float16))
    eps = np.finfo(np.float32).eps
    top = np.abs(np.asarray(o16, np.float64)).max(axis=(1, 3)) * kv  # [N, Hp]
    bound = ((2 * s + 5) * eps * top)[:, :, None]  # the merge's roundings and the scale's one
    want = np.asarray(merge_splits(o16, m, l, scale=jnp.float32(kv)))
    # The twin scales after merging: the f32 merge of the scaled partials within the bound.
    scaled = merge_splits(o16.astype(jnp.float32) * jnp.float32(kv), m, l)
    assert (np.abs(want - np.asarray(scaled)) <= bound).all()
    if pad is None:
        got = np.asarray(merge_splits_pallas(o16, m, l, interpret=True,
                                             scale=jnp.asarray([kv], jnp.float32)))
        assert (np.abs(got - want) <= bound).all()
        assert (got[1] == 0).all()
        return
    rows_in, rows_out = pad
    b = n // rows_in
    fill = jnp.zeros((b, rows_out), jnp.float32).at[0, -1].set(jnp.nan)
    plain = merge_splits_pallas(o16, m, l, interpret=True, scale=jnp.float32(kv))
    got = merge_splits_pallas(o16, m, l, interpret=True, dtype=jnp.bfloat16,
                              pad=(rows_in, fill), scale=jnp.float32(kv))
    assert got.dtype == jnp.bfloat16 and got.shape == (b * rows_out, hp, cp)
    assert (np.abs(np.asarray(plain) - want) <= bound).all()
    padded = padded_rows_jnp(plain.reshape(b, rows_in, hp, cp), fill, jnp.bfloat16)
    assert np.array_equal(np.asarray(got, np.float32),
                          np.asarray(padded, np.float32).reshape(got.shape), equal_nan=True)
    if s == 1:  # one partial: the kernel's row is its f16 value times the scale, rounded once
        assert (np.asarray(plain) == np.asarray(o16[:, 0], np.float32) * np.float32(kv)).all()


def test_merge_kernel_lowers_half_partials_for_cuda():
    """f16 partials and a scale lower through the Triton path (any host)."""
    f32 = jnp.float32
    n, s, hp, cp = 64, 2, 64, 512

    def fn(o, m, l, kv, fill):
        return merge_splits_pallas(o, m, l, dtype=jnp.bfloat16, pad=(1, fill), scale=kv)

    args = (jax.ShapeDtypeStruct((n, s, hp, cp), jnp.float16),
            jax.ShapeDtypeStruct((n, s, hp), f32), jax.ShapeDtypeStruct((n, s, hp), f32),
            jax.ShapeDtypeStruct((1,), f32), jax.ShapeDtypeStruct((n, 4), f32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text
