"""On the GPU (`pytest -m gpu`, compiled; skipped elsewhere): the kernel checks the device
scripts ran on the H200 before they were removed, where no other test holds them.

- The Mosaic GPU gather-attend at the library's tuning on odd and GLM-5.3-Flash cases (128
  heads, 32, 5, C = 384, a prefix of live slots, empty rows, 3 splits): within the derived
  f16 bound of tests/test_attend_kernel.py, cache rows outside the selection NaN (never read),
  the allocator poisoned first (every output element written), empty rows exactly 0.
- Its input prep (`attend_prep.prep_pallas`, one Triton launch) compiled: bitwise its jnp twin
  on rows of extreme magnitude (zero, 1e-30, f32 subnormal, 1e30, beyond f16, f16 subnormals).
- A prompt's attend in bf16 (the kernel writes the caller's dtype itself) is its f32 result
  rounded, bit for bit.
- The latent write into the top GiB of pools of 3 GiB, 4 GiB (the `loop-b64-l8` model's) and
  4 GiB + one block, where 32-bit offsets wrap: the rows are the bytes the kernel writes into
  a small pool, no other byte changes, and the attend reads them as it reads the small pool.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.pallas import attend_prep as ap
from dsa_jax.pallas import latent_write as lw
from dsa_jax.pallas import sparse_attend as sa
from dsa_jax.pallas.mgpu_plan import row_scales

pytestmark = pytest.mark.gpu

MOSAIC = sa.AttendTuning("mosaic")
E32, U16 = 2.0 ** -24, 2.0 ** -11


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _inputs(seed, b, r, h, c, w, bs, mb, prefix=False, empty_rows=0):
    """q, an fp8 cache whose rows outside the selection are NaN, permuted tables, selections
    of distinct tokens with -1 slots (a prefix of live slots when `prefix`)."""
    rng = np.random.default_rng(seed)
    nb, kv = b * mb + 3, 1 / 64
    q = rng.standard_normal((b, r, h, c)).astype(np.float32)
    lat = np.clip(rng.standard_normal((nb, bs, c)) / kv, -448, 448)
    tables = rng.permutation(nb)[: b * mb].reshape(b, mb).astype(np.int32)
    sel = np.stack([np.stack([rng.permutation(mb * bs)[:w] for _ in range(r)])
                    for _ in range(b)]).astype(np.int32)
    sel = np.where(rng.random(sel.shape) < 0.2, -1, sel)
    if prefix:  # live slots then -1, ending on and off 64-slot tile boundaries
        ends = rng.choice([0, 1, 63, 64, 65, 128, w - 1, w], size=(b, r))
        sel = np.where(np.arange(w)[None, None] < ends[..., None], np.abs(sel), -1)
    for k in range(empty_rows):
        sel[k % b, (k // b) % r] = -1
    used = np.zeros(nb * bs, bool)
    s = np.clip(sel, 0, None)
    used[(tables[np.arange(b)[:, None, None], s // bs] * bs + s % bs)[sel >= 0]] = True
    used[0] = True  # the twin reads slot 0 for empty slots (and masks it)
    flat = lat.reshape(-1, c)
    flat[~used] = np.nan
    return (jnp.asarray(q), jnp.asarray(flat.reshape(nb, bs, c), jnp.float8_e4m3fn),
            jnp.float32(kv), jnp.asarray(tables), jnp.asarray(sel))


def _f16_bound(q, lat, kv, tables, sel, scale):
    """tests/test_attend_kernel.py's bound for the Mosaic kernel (f16 operands, u = 2^-11,
    the q and p subnormal floors, f16 split partials), `[B, R, 1, 1]`."""
    b, r, h, c = q.shape
    bs = lat.shape[1]
    flat = np.asarray(lat.astype(jnp.float32), np.float64).reshape(-1, c) * float(kv)
    sel = np.asarray(sel)
    s = np.clip(sel, 0, None)
    slots = np.asarray(tables)[np.arange(b)[:, None, None], s // bs] * bs + s % bs
    rows = np.where((sel >= 0)[..., None], np.nan_to_num(flat[slots]), 0.0)  # [B, R, W, C]
    down = np.asarray(row_scales(q.reshape(b * r, h, c))[1], np.float64).reshape(b, r)
    l_j = scale * np.einsum("brhc,brwc->brhw", np.abs(np.asarray(q, np.float64)),
                            np.abs(rows))
    d = (U16 + 2 * c * E32) * l_j.max(axis=(2, 3))
    d = d + scale * 2.0 ** -25 * down * np.abs(rows).sum(axis=3).max(axis=2)
    m = np.abs(rows).max(axis=(2, 3))
    w = sel.shape[-1]
    return 2.0 * ((np.expm1(2 * d) + 2 * U16 + w * 2.0 ** -25 + 4 * (w + 64) * E32) * m
                  + 2.0 ** -25 * float(kv))[..., None, None]


CASES = [  # (B, R, H, C, W, block size, blocks per seq, input kwargs, call kwargs)
    (3, 1, 64, 512, 2051, 64, 40, {}, {}),
    (2, 2, 128, 512, 2048, 64, 40, dict(prefix=True, empty_rows=1), {}),
    (2, 3, 5, 512, 70, 16, 9, dict(empty_rows=2), {}),
    (3, 1, 64, 512, 2051, 64, 40, {}, dict(num_splits=3)),
    (2, 1, 24, 384, 300, 32, 12, {}, {}),
    (4, 1, 32, 512, 2051, 64, 40, {}, {}),  # a TP 2 rank's 32 heads (padded to a 64-row tile)
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_mosaic_attend_meets_its_bound(case):
    b, r, h, c, w, bs, mb, extra, call = CASES[case]
    args = _inputs(1000 + 17 * case, b, r, h, c, w, bs, mb, **extra)
    scale = 1 / 16
    ref = np.asarray(jax.jit(functools.partial(sa.sparse_attend_xla, softmax_scale=scale))(
        *args), np.float64)
    bufs = [jnp.full((b * r * h * c * 16 + 1,), jnp.nan, jnp.float32) for _ in range(3)]
    jax.block_until_ready(bufs)
    del bufs  # the next allocations likely reuse poisoned memory
    out = np.asarray(jax.jit(functools.partial(sa.sparse_attend_pallas, softmax_scale=scale,
                                               tuning=MOSAIC, **call))(*args), np.float64)
    T.assert_attend_close(out, ref, _f16_bound(*args, scale), 1e-2)
    empty = (np.asarray(args[4]) < 0).all(-1)
    assert (out[empty] == 0).all()


def _extreme_rows(q: np.ndarray) -> np.ndarray:
    q = q.copy()
    q[0] = 0.0
    q[1] *= 1e-30
    q[2] *= 1e-42  # f32 subnormals
    q[3] *= 1e30
    q[4, 0, 0] = 65504.0 * 8  # beyond f16 before scaling
    q[5, :, 1::2] *= 3e-5  # f16 subnormals after scaling
    return q


@pytest.mark.parametrize("shape", [(64, 1, 64, 512, 2051, 64, 40, 64, 2176),
                                   (3, 3, 5, 384, 70, 16, 9, 64, 128)])
def test_the_attend_prep_compiled_is_bitwise_its_jnp_twin(shape):
    """`prep_pallas` (q scaled and rounded to f16, the slots, the live counts) against
    `mosaic_inputs_jnp`, both compiled, at the decode point's shape and an odd one."""
    b, r, h, c, w, bs, mb, hp, wp = shape
    q, _, _, tables, sel = T.attend_inputs(7 + h, b, r, h, c, w, bs, mb, "float8_e4m3fn")
    q = jnp.asarray(_extreme_rows(np.asarray(q).reshape(b * r, h, c)))
    got = jax.jit(functools.partial(ap.prep_pallas, block_size=bs, hp=hp, wp=wp))(
        q, sel, tables)
    want = jax.jit(functools.partial(sa.mosaic_inputs_jnp, block_size=bs, hp=hp, wp=wp))(
        q, sel, tables)
    T.assert_trees_bitwise_equal(got, want)


def test_a_prompts_bf16_attend_is_its_f32_attend_rounded():
    """A prompt chunk (1 x 2048 rows, 64 heads, 2051 slots, GLM-5.3-Flash's C, fp8), as a
    prefill's layer asks for it in bf16: the kernel's own bf16 result == its f32 result
    rounded to bf16, bit for bit, and finite."""
    args = T.attend_inputs(11, 1, 2048, 64, 512, 2051, 64, 40, "float8_e4m3fn")

    def attend(dtype):
        return jax.jit(functools.partial(sa.sparse_attend_pallas, softmax_scale=256 ** -0.5,
                                         tuning=MOSAIC, out_dtype=dtype))(*args)

    out16, out32 = attend(jnp.bfloat16), attend(jnp.float32)
    assert out16.dtype == jnp.bfloat16
    assert _bits_equal(out16, out32.astype(jnp.bfloat16))
    assert np.isfinite(np.asarray(out32)).all()


POISON = 0x3A  # an fp8 e4m3 code (1.25): the bytes no write may touch


@pytest.mark.parametrize("nb", [98304, 131072, 131073])  # 3 GiB, 4 GiB, 4 GiB + one block
def test_rows_written_into_the_top_gib_of_a_large_pool(nb):
    bs, c, h = 64, 512, 64
    rows = 2 * bs  # two blocks of the top GiB: the pool's last, and one half a GiB below
    per_gib = 2 ** 30 // (bs * c)
    blocks = jnp.asarray([[nb - 1 - per_gib // 2, nb - 1]], jnp.int32)
    small_table = jnp.asarray([[0, 1]], jnp.int32)
    rng = np.random.default_rng(nb)
    raw = jnp.asarray(rng.standard_normal((1, rows, c)).astype(np.float32) * 3)
    norm_w = jnp.asarray(1 + 0.1 * rng.standard_normal(c).astype(np.float32))
    kv = jnp.float32(1 / 64)
    pos, valid = jnp.arange(rows, dtype=jnp.int32)[None], jnp.ones((1, rows), bool)
    poison = jax.lax.bitcast_convert_type(jnp.uint8(POISON), jnp.float8_e4m3fn)
    write = jax.jit(functools.partial(lw.latent_write_pallas, eps=1e-6), donate_argnums=2)
    small = write(raw, norm_w, jnp.full((2, bs, c), poison), kv, small_table, pos, valid)
    big = write(raw, norm_w, jnp.full((nb, bs, c), poison), kv, blocks, pos, valid)
    assert _bits_equal(big[blocks[0]], small)
    as_u8 = jax.jit(lambda p: jnp.sum(jax.lax.bitcast_convert_type(p, jnp.uint8) != POISON))
    assert int(as_u8(big)) == int(as_u8(small)) > 0  # no byte changed elsewhere
    sel = np.stack([np.random.default_rng(s).permutation(rows) for s in range(2)])
    sel[:, ::7] = -1
    sel = jnp.asarray(sel[None].astype(np.int32))  # [1, 2, 2bs]: every token once, some empty
    q = jnp.asarray(rng.standard_normal((1, 2, h, c)).astype(np.float32))
    attend = jax.jit(functools.partial(sa.sparse_attend_pallas, softmax_scale=c ** -0.5,
                                       tuning=MOSAIC))
    assert _bits_equal(attend(q, big, kv, blocks, sel), attend(q, small, kv, small_table, sel))
