"""`pallas/scaled_q_abs.py`: a prompt's absorbed query scaled per (row, head) and in f16, the
kernel against its definition (`scaled_q_abs_xla`), one body run in interpret mode and compiled
("pallas": `gpu` marker).

The kernel computes the definition's products (power-of-two scaling is exact) in another
summation order: each f16 value is within one f16 spacing of the definition's (the rounding
may flip) plus the two fp32 K-term sums' bound 2 K 2^-24 sum_d |q_d 2^k| |u_dc|; the scale
2^-k is the same (both take the bound of the bf16-rounded q, the definition through
`reduce_precision`, which XLA keeps). Shapes are odd (rows past a tile, C past a column tile,
Dn past a K chunk, heads not a power of two), rows far from 1 and zero rows included.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.pallas import scaled_q_abs as sqa


def _inputs(n, h, dn, c, wdt, seed=0):
    rng = np.random.default_rng(seed)
    u = jnp.asarray(rng.standard_normal((h, dn, c)) * dn ** -0.5, wdt)  # [H, Dn, C]
    q = rng.standard_normal((n, h, dn)).astype(np.float32) * np.float32(3.0)  # [N, H, Dn]
    q[1] *= np.float32(2.0 ** -30)
    q[2, h - 1] *= np.float32(2.0 ** 40)
    q[3] = 0.0
    return jnp.asarray(q), u


def _assert_close(got, want, q, u, scale="bound"):
    """Scale "bound": the same 2^-k (both from the bound of the rounded q). "amax": 2^-k
    from each side's own f32 result, so the same except where the definition's amax lies
    within the K-term sums' bound of a power of two (then one binade apart); each value
    compared unscaled, within one f16 spacing at each side's scale plus the sums' bound."""
    (g16, gd), (w16, wd) = got, want
    gd, wd = np.asarray(gd, np.float64), np.asarray(wd, np.float64)  # [N, H]
    qo = np.asarray(q.astype(u.dtype).astype(jnp.float32), np.float64)
    s = np.einsum("nhd,hdc->nhc", np.abs(qo), np.abs(np.asarray(u, np.float64)))  # unscaled
    sums = 2 * q.shape[-1] * 2.0 ** -24 * s  # [N, H, C]
    if scale == "bound":
        np.testing.assert_array_equal(gd, wd)
    else:
        moved = gd != wd
        assert np.isin(gd[moved] / wd[moved], (0.5, 2.0)).all()
        amax = np.abs(np.asarray(w16, np.float64) * wd[..., None]).max(-1)  # [N, H]
        edge = 2.0 ** np.round(np.log2(np.where(amax > 0, amax, 1.0)))
        near = np.abs(amax - edge) <= sums.max(-1) + np.spacing(np.float16(2 ** 14)) * wd
        assert near[moved].all(), np.argwhere(moved & ~near)[:5]
    g, w = (np.asarray(x, np.float64) for x in (g16, w16))
    spacing = lambda x: np.spacing(np.abs(x).astype(np.float16)).astype(np.float64)  # noqa
    tol = spacing(w) * wd[..., None] + spacing(g) * gd[..., None] + sums
    # amax: a value just below 2^14 may round up to it (as the decode prep's may)
    top_ok = np.abs(g) < 2.0 ** 14 if scale == "bound" else np.abs(g) <= 2.0 ** 14
    assert np.isfinite(g).all() and top_ok.all()
    bad = np.abs(g * gd[..., None] - w * wd[..., None]) > tol
    assert not bad.any(), (np.argwhere(bad)[:5], np.abs(g - w).max())
    if scale == "amax":  # each (row, head) scaled into [2^13, 2^14) by its own largest value
        top = np.abs(g).max(-1)  # [N, H]
        live = (top > 0) & (np.abs(qo).max(-1) > 2.0 ** -100)
        assert ((top >= 2.0 ** 13) & (top <= 2.0 ** 14))[live].all()


# The kernel's tiles and scale follow q's dtype and C (`tiles`, `default_scale`): f32 rows
# take 128 x 256 tiles, others 64 x 512; "amax" where the tiles hold C whole, else "bound".
@pytest.mark.parametrize("n,h,dn,c,wdt,qdt", [
    (70, 5, 40, 64, jnp.bfloat16, jnp.float32),  # amax
    (130, 5, 72, 96, jnp.bfloat16, jnp.bfloat16),  # amax, partial row tiles, Dn past a chunk
    (9, 2, 40, 48, jnp.float32, jnp.float32),  # amax, f32 weights
    (37, 3, 72, 300, jnp.bfloat16, jnp.float32),  # bound, C past a column tile
    (9, 2, 40, 260, jnp.float32, jnp.float32),  # bound, f32 weights
    (20, 2, 48, 520, jnp.bfloat16, jnp.bfloat16),  # bound: bf16 rows converted to f32
])
def test_kernel_matches_its_definition(kernel_impl, n, h, dn, c, wdt, qdt):
    """q in f32 and in bf16 (as a prompt's q_b GEMM writes it with bf16 weights)."""
    q, u = _inputs(n, h, dn, c, wdt)
    q = q.astype(qdt)
    scale = sqa.default_scale(qdt, c)
    want = jax.jit(sqa.scaled_q_abs_xla)(q, u)
    got = T.run_op("scaled_q_abs", kernel_impl, q, u)
    _assert_close(got, want, q.astype(jnp.float32), u, scale)


def test_the_tiles_and_the_scale_follow_the_rows_dtype_and_c():
    """64 x 512 tiles for bf16 rows, 128 x 256 for f32 rows; "amax" where the tiles hold a
    head's C whole (a prompt's bf16 rows at GLM's C = 512; f32 rows at C <= 256), else
    "bound"; the definition's scale None follows the same rule."""
    assert sqa.tiles(jnp.bfloat16) == (64, 512) and sqa.tiles(jnp.float32) == (128, 256)
    assert sqa.default_scale(jnp.bfloat16, 512) == "amax"
    assert sqa.default_scale(jnp.bfloat16, 1024) == "bound"
    assert sqa.default_scale(jnp.float32, 512) == "bound"
    assert sqa.default_scale(jnp.float32, 256) == "amax"
    q, u = _inputs(6, 2, 40, 300, jnp.bfloat16, seed=4)
    for qdt in (jnp.float32, jnp.bfloat16):
        got = sqa.scaled_q_abs_xla(q.astype(qdt), u)
        want = sqa.scaled_q_abs_xla(q.astype(qdt), u, scale=sqa.default_scale(qdt, 300))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("c", [64, 300])  # f32 rows: amax, bound
def test_kernel_reads_a_stacked_weight_in_place(kernel_impl, c):
    """u_k a stack [G, H, Dn, C] at a layer index (clamped as XLA's dynamic index)."""
    q, u = _inputs(21, 3, 40, c, jnp.bfloat16, seed=1)
    stack = jnp.stack([u * 0.5, u, u * 3.0])
    for layer, want_w in ((1, u), (7, u * 3.0)):
        got = T.run_op("scaled_q_abs", kernel_impl, q, stack, jnp.int32(layer))
        want = jax.jit(sqa.scaled_q_abs_xla)(q, want_w)
        _assert_close(got, want, q, want_w, sqa.default_scale(q.dtype, c))


def test_kernel_rows_keep_their_bits_at_any_row_count(kernel_impl):
    """A row's result is its own: the same bits in a 5-row call and a 70-row one (what lets
    the wrapper split a call whose result would wrap Triton's 32-bit offsets)."""
    for c in (64, 300):  # f32 rows: amax, bound
        q, u = _inputs(70, 2, 40, c, jnp.bfloat16, seed=2)
        full = T.run_op("scaled_q_abs", kernel_impl, q, u)
        part = T.run_op("scaled_q_abs", kernel_impl, q[33:38], u)
        for a, b in zip(full, part, strict=True):
            np.testing.assert_array_equal(np.asarray(a[33:38]), np.asarray(b))


def test_the_bound_is_that_of_the_rounded_operand_under_jit():
    """`q_abs_bound` under jit equals it op by op: XLA keeps the rounding of q to the weight's
    dtype (a convert pair it would drop: the norm was q's own, up to 2^-9 off), and so does
    the kernel where XLA runs it (interpret mode under jit)."""
    q, u = _inputs(16, 4, 40, 300, jnp.bfloat16, seed=3)  # f32 rows at C = 300: "bound"
    assert sqa.default_scale(q.dtype, 300) == "bound"
    np.testing.assert_array_equal(np.asarray(jax.jit(sqa.q_abs_bound)(q, u)),
                                  np.asarray(sqa.q_abs_bound(q, u)))
    kernel = jax.jit(functools.partial(sqa.scaled_q_abs_pallas, interpret=True))
    want = jax.jit(sqa.scaled_q_abs_xla)(q, u)[1]
    np.testing.assert_array_equal(np.asarray(kernel(q, u)[1]),  # the kernel's under jit
                                  np.asarray(want))
    qo = np.asarray(q.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    col = np.sqrt((np.asarray(u, np.float64) ** 2).sum(1).max(-1))  # [H]
    want = np.sqrt((qo ** 2).sum(-1)) * col * sqa.BOUND_MARGIN
    np.testing.assert_allclose(np.asarray(sqa.q_abs_bound(q, u)), want, rtol=2.0 ** -20)


def test_bad_shapes_are_refused():
    q, u = _inputs(4, 3, 40, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"q's last axes \[3, 39\] must be u_k's"):
        sqa.scaled_q_abs_pallas(q[..., :39], u, interpret=True)
    with pytest.raises(ValueError, match="stacked u_k must be"):
        sqa.scaled_q_abs_pallas(q, u, jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="scale='max' must be one of"):
        sqa.scaled_q_abs_xla(q, u, scale="max")
