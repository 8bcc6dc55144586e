"""`attend_prep.prep_pallas` (the Mosaic kernel's inputs in one Triton launch) against its jnp
twin `sparse_attend.mosaic_inputs_jnp`: bitwise (`==` on the bits) in interpret mode, on odd
shapes and extreme q magnitudes; its Triton lowering for cuda at GLM-5.3-Flash's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.pallas import attend_prep as ap
from dsa_jax.pallas import sparse_attend as sa
from dsa_jax.pallas import sparse_attend_mgpu as mg
from dsa_jax.pallas.common import KernelLimitError


def _extreme_rows(q: np.ndarray) -> np.ndarray:
    """q [N, H, C] with its rows pushed to the edges of f32 and f16 (N >= 7)."""
    q = q.copy()
    q[0] = 0.0  # zero row: scaled as if amax were 1, stays 0
    q[1] *= 1e-30  # tiny: scaled up by ~2^113
    q[2] *= 1e-42  # f32 subnormal amax: k clips at 126
    q[3] *= 1e30  # huge: scaled down
    q[4, 0, 0] = 65504.0 * 8  # beyond f16 before scaling, one element
    q[5] = np.float32(2.0 ** 14) * (1 - 2.0 ** -24)  # just under 2^14: k = 0, rounds to 2^14
    q[6, :, 1::2] = -q[6, :, 1::2] * 3e-5  # mixed magnitudes: f16 subnormals after scaling
    return q


@pytest.mark.parametrize("rows", [1, 2])
def test_prep_reads_the_first_rows_in_place(rows):
    """rows=: each sequence's first rows of [B, R] read in place (a decode's real row): bitwise
    the twin of those rows sliced out, and the other rows (random here) never read."""
    b, r, h, c, w, bs, mb = 3, 4, 40, 32, 70, 16, 6
    q, _, _, tables, sel = T.attend_inputs(77 + rows, b, r, h, c, w, bs, mb, "float8_e4m3fn",
                                           empty=[(1, 0)])
    got = ap.prep_pallas(q.reshape(b * r, h, c), sel, tables, bs, hp=64, wp=80, rows=rows,
                         interpret=True)
    want = sa.mosaic_inputs_jnp(q[:, :rows].reshape(b * rows, h, c), sel[:, :rows], tables, bs,
                                hp=64, wp=80)
    T.assert_trees_bitwise_equal(got, want)
    with pytest.raises(ValueError, match="rows=5"):
        ap.prep_pallas(q.reshape(b * r, h, c), sel, tables, bs, hp=64, wp=80, rows=5,
                       interpret=True)


def test_scale_exponent_is_frexps():
    """The exponent from the amax bits equals the twin's frexp rule, across f32's range."""
    e = np.arange(-149, 128, dtype=np.float64)
    vals = np.concatenate([2.0 ** e, 2.0 ** e * 1.75, 2.0 ** e * (1 - 2.0 ** -24)])
    vals = np.concatenate([vals[np.isfinite(vals.astype(np.float32))], [0.0, np.inf]])
    a = jnp.asarray(vals, jnp.float32)
    up, down = mg.row_scales(a[:, None, None])
    k = ap.scale_exponent(a)
    np.testing.assert_array_equal(np.asarray(jnp.ldexp(jnp.ones_like(a), k)), np.asarray(up))
    np.testing.assert_array_equal(np.asarray(ap._pow2_bits(-k)), np.asarray(down))


def test_prep_refuses_bad_arguments():
    q = jnp.zeros((4, 5, 128), jnp.float32)
    sel = jnp.zeros((2, 2, 10), jnp.int32)
    tables = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="hp=4"):
        ap.prep_pallas(q, sel, tables, 8, hp=4, wp=64)
    with pytest.raises(ValueError, match="wp=40"):
        ap.prep_pallas(q, sel, tables, 8, hp=64, wp=40)
    with pytest.raises(ValueError, match="does not match"):
        ap.prep_pallas(q, sel[:1], tables, 8, hp=64, wp=64)
    # 65536 rows x 64 heads x 512 as f16: 2^31 elements in 4 GiB, past 32-bit offsets.
    big = jax.ShapeDtypeStruct((65536, 64, 512), jnp.float32)
    with pytest.raises(KernelLimitError, match="attend prep q16"):
        jax.eval_shape(lambda q: ap.prep_pallas(q, jnp.zeros((65536, 1, 8), jnp.int32),
                                                jnp.zeros((65536, 1), jnp.int32), 8, hp=64,
                                                wp=16), big)


@pytest.mark.parametrize("shape,rows", [((64, 4, 64, 2051, 256, 64, 2176), 1),
                                        ((1, 2048, 64, 2051, 256, 64, 2112), None),
                                        ((128, 2, 128, 2048, 256, 128, 2048), None)])
def test_prep_lowers_for_cuda(shape, rows):
    """The Triton lowering refuses what interpret mode accepts: lower at GLM-5.3-Flash's
    shapes (a decode's first of 4 rows, a prompt chunk, 2 rows of 128 heads)."""
    b, r, h, w, mb, hp, wp = shape
    f32, i32 = jnp.float32, jnp.int32

    def fn(q, sel, tables):
        return ap.prep_pallas(q, sel, tables, 64, hp=hp, wp=wp, rows=rows)

    args = (jax.ShapeDtypeStruct((b * r, h, 512), f32), jax.ShapeDtypeStruct((b, r, w), i32),
            jax.ShapeDtypeStruct((b, mb), i32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text


# (B, R, H, C, W, block size, blocks per seq, Hp, Wp, heads per scale): groups with padded
# heads only (a zero group), groups of real and padded heads, 3 column chunks (C = 384).
GROUP_CASES = [
    (3, 3, 5, 384, 70, 16, 9, 64, 128, 16),
    (2, 4, 96, 512, 300, 32, 12, 128, 320, 32),
    (7, 1, 160, 128, 37, 8, 6, 192, 64, 64),
]


@pytest.mark.parametrize("case", range(len(GROUP_CASES)))
def test_prep_is_bitwise_the_jnp_twin(case):
    """One program per (row, head group), each group scaled into [2^13, 2^14) by its own amax,
    and one per row for its slots; bitwise the twin, and each group's scale at least its
    row's."""
    b, r, h, c, w, bs, mb, hp, wp, g = GROUP_CASES[case]
    q, _, _, tables, sel = T.attend_inputs(90 + case, b, r, h, c, w, bs, mb, "float8_e4m3fn",
                                           empty=[(1, 0)])
    q = np.asarray(q).reshape(b * r, h, c)
    q = _extreme_rows(q) if b * r >= 7 else q
    q[-1, : min(h, g)] *= 1e3  # one group far larger than the row's others
    q = jnp.asarray(q)
    got = ap.prep_pallas(q, sel, tables, bs, hp=hp, wp=wp, scale_heads=g, interpret=True)
    want = sa.mosaic_inputs_jnp(q, sel, tables, bs, hp=hp, wp=wp, scale_heads=g)
    T.assert_trees_bitwise_equal(got, want)
    q16, up, down, slots, live = (np.asarray(x) for x in got)
    assert up.shape == down.shape == (b * r, hp) and (up * down == 1).all()
    # Groups holding a real head with a normal amax (not the zero row 0, not row 2's f32
    # subnormals): scaled into [2^13, 2^14], by at least their row's scale.
    qg = np.abs(np.pad(np.asarray(q), ((0, 0), (0, hp - h), (0, 0)))).reshape(
        b * r, hp // g, g * c).max(axis=2)  # [N, G] each group's amax
    normal = (qg >= np.finfo(np.float32).tiny) & (np.arange(hp // g) * g < h)[None, :]
    assert normal[:, 0].sum() >= b * r - 2  # every row's first group but rows 0 and 2
    got16 = np.abs(q16.astype(np.float32)).reshape(b * r, hp // g, g * c).max(axis=2)
    assert ((got16 >= 2.0 ** 13) & (got16 <= 2.0 ** 14))[normal].all()
    row_up = np.asarray(mg.row_scales(q)[0])  # [N]
    assert (up.reshape(b * r, hp // g, g)[:, :, 0] >= row_up[:, None])[normal].all()
    assert (q16[:, h:] == 0).all() and (slots[:, w:] == -1).all() and live[1 * r] == 0
    if b * r >= 7:  # _extreme_rows: rows 0 and 2 take the zero row's and the subnormals' k
        assert up[0, 0] == 2.0 ** 13 and up[2, 0] in (2.0 ** 126, 2.0 ** 13)


@pytest.mark.parametrize("kw,match", [(dict(scale_heads=8), "power of two >= 16"),
                                      (dict(scale_heads=48), "power of two"),
                                      (dict(scale_heads=128), "dividing hp=64")])
def test_prep_refuses_head_groups_it_cannot_run(kw, match):
    q, _, _, tables, sel = T.attend_inputs(3, 1, 1, 5, 32, 20, 16, 2, "float8_e4m3fn")
    with pytest.raises(ValueError, match=match):
        ap.prep_pallas(q.reshape(1, 5, 32), sel, tables, 16, hp=64, wp=32, interpret=True,
                       **kw)
