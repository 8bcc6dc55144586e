"""Bitwise comparison of pytrees for the tests (fp8 included; -0.0 != 0.0)."""

import jax
import numpy as np


def bits(a):
    """Raw bytes of an array: equality here is bitwise."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.dtype.name, a.shape, a.view(np.uint8).tobytes()


def assert_bitwise(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert bits(x) == bits(y)
