"""The shared test helpers (`dsa_jax.testing`) catch what they exist to catch."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.shapes import ODD


def test_bitwise_trees_see_signed_zeros_nan_payloads_dtypes_and_fp8():
    a = {"x": np.array([0.0, 1.5], np.float32), "n": None, "k": np.arange(3, dtype=np.int32)}
    T.assert_trees_bitwise_equal(a, {"x": a["x"].copy(), "n": None, "k": np.arange(3)
                                     .astype(np.int32)})
    nan2 = np.array([0x7FC00001], np.uint32).view(np.float32)
    for x, y, what in [
        (np.float32([-0.0]), np.float32([0.0]), "1 of 1 elements differ"),
        (np.float32([np.nan]), nan2, "1 of 1 elements differ"),
        (jnp.float32([1.0]), jnp.bfloat16([1.0]), "float32[1] vs bfloat16[1]"),
        (jnp.float8_e4m3fn([1.5, 2.0]), jnp.float8_e4m3fn([1.5, 2.5]), "first at (1,)"),
        (np.ones((2, 1), np.float32), np.ones((2,), np.float32), "float32[2, 1] vs"),
    ]:
        with pytest.raises(AssertionError, match=re.escape(what)):
            T.assert_trees_bitwise_equal([x], [y])
    with pytest.raises(AssertionError):
        T.assert_trees_bitwise_equal((a["x"],), [a["x"]])  # structure counts


def test_rel_err_and_roundoffs():
    assert T.rel_err([3.0, 4.0], [3.0, 4.0]) == 0
    assert T.rel_err([3.0, 5.0], [3.0, 4.0]) == pytest.approx(0.2)
    assert T.rel_err([0.0], [0.0]) == 0 and T.rel_err([1e-30], [0.0]) == np.inf
    assert [T.unit_roundoff(d) for d in (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn)] == [
        2.0 ** -8, 2.0 ** -24, 2.0 ** -4]
    assert [T.storage_step(d) for d in (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn)] == [
        2.0 ** -7, 0.0, 2.0 ** -3]
    # bf16 keeps 8 significant bits: 1 + 2^-8 is a tie, rounded to 1, an error of u itself.
    assert float(jnp.bfloat16(1 + 2.0 ** -8)) == 1.0
    with pytest.raises(AssertionError, match="0.2 > 0.1"):
        T.assert_rel_close([3.0, 5.0], [3.0, 4.0], 0.1, "probe")


def test_topk_definition_is_the_total_order():
    s = np.float32([[0.0, -0.0, 0.0, -0.0, 1.0, -np.inf, 1.0]])
    assert T.topk_definition(s, 7).tolist() == [[4, 6, 0, 2, 1, 3, 5]]


def test_random_inputs_are_seeded_nonzero_and_permuted():
    a, b = T.random_rows(3, 2, 5), T.random_rows(3, 2, 5)
    T.assert_trees_bitwise_equal(a, b)
    assert bool(jnp.all(a != 0)) and not bool(jnp.all(a == T.random_rows(4, 2, 5)))
    tables = T.permuted_block_tables(ODD, 2, 0)
    assert tables.shape == (2, ODD.blocks_per_seq)
    assert sorted(tables.ravel()) == list(range(tables.size))
    assert not np.array_equal(tables.ravel(), np.arange(tables.size))
