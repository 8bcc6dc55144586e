"""The split-merge kernel (`pallas/merge_splits.py`) against its jnp twin
(`sparse_attend.merge_splits`), in Pallas interpret mode."""

import jax
import numpy as np
import pytest

from dsa_jax.pallas.merge_splits import merge_splits_pallas
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


@pytest.mark.parametrize("n,s,hp,cp", [(3, 3, 16, 32), (2, 5, 32, 384), (4, 1, 16, 16)])
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
