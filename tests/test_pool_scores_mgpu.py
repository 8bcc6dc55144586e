"""The Mosaic GPU pool-scores kernel (`pallas/pool_scores_mgpu.py`, issue #14).

On any host: its variants lower for cuda (Pallas -> Mosaic GPU MLIR; the kernel cannot run on
a CPU), for fp32 keys and for bf16 keys (a bf16 index cache), a numpy model of its arithmetic
(tf32 or bf16 splits, the products it runs per key x head) meets the
derived bound the GPU kernels are held to (`testing.pool_scores_bound` with
`TF32X3_ROUNDOFF`), and bad tunings raise. On the GPU (`gpu` marker): parity against the
float64 definition within that bound (odd P, n_cand off the tile edges, rows with none,
odd heads and dims), -inf exactly past the candidates, and the SPEC's batch independence with
`==`: a row alone against the same row in a batch, 1 vs 4 rows per sequence, chunk counts.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_scores_mgpu as pm

M = pm.MgpuScoresTuning
F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("shape,tuning,key_dtype", [
    ((2, 4, 32, 128, 4096), M(), F32),  # GLM-5.3-Flash: 2 sequences x 4 rows
    ((2, 3, 5, 12, 100), M(), F32),  # odd heads, dims, pools (keys padded to 104 x 32)
    ((1, 9, 32, 128, 200), M(stages=4, chunks=3, write_hi=True), F32),
    ((2, 3, 5, 12, 100), M(fuse_qlo=False), F32),
    ((2, 3, 5, 12, 100), M(rows=2), F32),  # rows padded to 4 per sequence
    ((1, 50, 32, 128, 4096), M(rows=2), F32),
    ((2, 3, 5, 12, 100), M(consumers=1, stages=1), F32),
    ((64, 1, 32, 128, 4096), M(consumers=1, block_p=128), F32),
    ((2, 3, 5, 12, 100), M(precision="bf16x6"), F32),  # Di padded to 64
    ((1, 9, 32, 128, 4096), M(precision="bf16x6", rows=2, stages=4), F32),
    ((2, 3, 5, 12, 100), M(persistent=True, chunks=3), F32),
    ((1, 9000, 32, 128, 4096), M(persistent=True, precision="bf16x6", rows=2, stages=4), F32),
    ((2, 4, 32, 128, 4096), M(), BF16),  # bf16 keys: "bf16x3"
    ((64, 1, 32, 128, 4096), M(), BF16),
    ((2, 3, 5, 12, 100), M(), BF16),  # Di padded to 64
    ((1, 50, 32, 128, 4096), M(rows=2), BF16),
    ((2, 3, 5, 12, 100), M(consumers=1, stages=1, block_p=128), BF16),
    ((1, 9000, 32, 128, 4096), M(persistent=True, rows=2, stages=4), BF16),
    ((1, 9000, 32, 128, 4096), M(split_q=False), BF16),  # qi split in jnp
    ((1, 50, 32, 128, 4096), M(rows=2, consumers=1), BF16),  # one consumer splits qi
    ((1, 7, 64, 72, 333), M(), BF16),  # qi split in the kernel, Di padded to 128
    ((64, 1, 32, 128, 4096), M(stages=2), BF16),  # decode rows: 32 heads, 64 in the kernel
    ((1, 7, 20, 128, 333), M(rows=2), BF16),  # 2 rows of 24 heads at 32: one copy a row
    ((1, 50, 32, 128, 4096), M(precision="bf16x6", rows=2, stages=2), F32),
])
def test_variants_lower_for_cuda(shape, tuning, key_dtype):
    """The kernel lowers on any host (the Mosaic GPU lowering rules run here), so a kernel that
    cannot lower fails before the device."""
    b, r, hi, di, p = shape
    f32, i32 = jnp.float32, jnp.int32
    fn = functools.partial(ps.pool_scores_pallas, tuning=ps.PoolScoresTuning(
        backend="mosaic", mosaic=tuning))
    args = (jax.ShapeDtypeStruct((b, r, hi, di), f32), jax.ShapeDtypeStruct((b, r, hi), f32),
            jax.ShapeDtypeStruct((b, p, di), key_dtype), jax.ShapeDtypeStruct((b, r), i32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "custom_call @__gpu$xla.gpu.triton" not in text
    split = pm.fit(tuning, hi, di, r, key_dtype).split_q
    assert ("stablehlo.concatenate" in text) == (not split)  # qi's parts split in jnp


def _trunc(x, mask=pm.TF32_MASK):
    return (np.asarray(x, np.float32).view(np.int32) & np.int32(mask)).view(np.float32)


def _parts(x, precision):
    """The kernel's operand splits, as float32 arrays: (hi, lo) or (x1, x2, x3)."""
    if precision == "keys-as-stored":  # bf16x3's keys: bf16 values, not split
        return (np.asarray(x, np.float32),)
    if precision == "tf32x3":
        return tuple(np.asarray(a) for a in pm.split_tf32(jnp.asarray(x)))
    return tuple(np.asarray(a.astype(jnp.float32)) for a in pm.split_bf16(jnp.asarray(x)))


def _model(qi, w, keys, n_cand, precision="tf32x3"):
    """The kernel's arithmetic in numpy: its splits of both operands, the products it runs
    (tf32x3: hi hi + lo hi + hi lo; bf16x6: the six of order <= 2; bf16x3: bf16 keys as
    stored times qi's three parts) summed exactly (float64, standing in for the tensor core's
    wide accumulation), then fp32 relu, weights, head sum."""
    f64 = functools.partial(np.asarray, dtype=np.float64)
    qs = _parts(qi, "bf16x6" if precision == "bf16x3" else precision)
    ks = _parts(keys, "keys-as-stored" if precision == "bf16x3" else precision)

    def dot(a, b):
        return np.einsum("brhd,bpd->brhp", f64(a), f64(b))

    pairs = {"tf32x3": [(0, 0), (0, 1), (1, 0)], "bf16x3": [(0, 0), (1, 0), (2, 0)],
             "bf16x6": [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0)]}[precision]
    dots = sum(dot(qs[i], ks[j]) for i, j in pairs).astype(np.float32)
    s = np.einsum("brh,brhp->brp", np.asarray(w, np.float32), np.maximum(dots, 0))
    s = np.where(s == 0, np.float32(0), s)
    return np.where(np.arange(keys.shape[1]) < np.asarray(n_cand)[..., None], s, -np.inf)


def test_split_is_exact_tf32():
    """hi and lo carry at most 10 significand bits, and x - hi - lo <= 2^-20 |x|: the split
    that `TF32X3_ROUNDOFF` (2^-18 per product) covers."""
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 1e3
    hi, lo = (np.asarray(a) for a in pm.split_tf32(jnp.asarray(x)))
    for part in (hi, lo):
        assert not (part.view(np.int32) & ~np.int32(pm.TF32_MASK)).any()
    np.testing.assert_array_equal(hi, _trunc(x))
    resid = np.abs(x.astype(np.float64) - hi - lo)
    assert (resid <= 2.0 ** -20 * np.abs(x)).all()


def test_split_bf16_bounds():
    """x1, x2 exact bf16 values with the truncation bounds `split_bf16` states, and
    |x - x1 - x2 - x3| <= 2^-23 |x|: what the bf16x6 precision's bound rests on."""
    x = np.random.default_rng(4).standard_normal(8192).astype(np.float32) * 1e3
    x1, x2, x3 = _parts(x, "bf16x6")
    for part in (x1, x2):
        assert not (part.view(np.int32) & np.int32(0xFFFF)).any()
    ax = np.abs(x.astype(np.float64))
    assert (np.abs(x - x1.astype(np.float64)) < 2.0 ** -7 * ax).all()
    assert (np.abs(x - x1.astype(np.float64) - x2) < 2.0 ** -14 * ax).all()
    assert (np.abs(x - x1.astype(np.float64) - x2 - x3) <= 2.0 ** -23 * ax).all()


@pytest.mark.parametrize("precision", ["tf32x3", "bf16x6", "bf16x3"])
def test_model_meets_the_tf32x3_bound(precision):
    """The modelled arithmetic is within the derived bound of the float64 definition, on odd
    shapes with candidate counts on and off the 64-pool tile edges (bf16x3: of bf16 keys)."""
    qi, w, keys, _ = T.pool_inputs(3, 2, 3, 5, 12, 150)
    if precision == "bf16x3":
        keys = keys.astype(BF16)
    n_cand = np.array([[0, 63, 64], [65, 150, 1]], np.int32)
    got = _model(np.asarray(qi), np.asarray(w), np.asarray(keys), n_cand, precision)
    bound = T.pool_scores_bound(qi, w, keys, T.TF32X3_ROUNDOFF)
    T.assert_pool_scores_close(got, T.pool_scores_definition(qi, w, keys, n_cand), bound)


def test_bad_tunings_raise():
    with pytest.raises(ValueError, match="stages=3"):
        M(stages=3)
    with pytest.raises(ValueError, match="consumers=3"):
        M(consumers=3, stages=3)
    with pytest.raises(ValueError, match="block_p=32"):
        M(block_p=32)
    with pytest.raises(ValueError, match="backend='cuda'"):
        ps.PoolScoresTuning(backend="cuda")
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 1, 2, 8, 16)
    with pytest.raises(ValueError, match="no interpret mode"):
        ps.pool_scores_pallas(qi, w, keys, n_cand, interpret=True, backend="mosaic")
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 1, 32, 128, 16)
    with pytest.raises(ValueError, match="shared memory"):  # 288 KiB
        pm.pool_scores_mgpu(qi, w, keys, n_cand, tuning=M(block_p=128, stages=2))
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 1, 129, 32, 16)
    with pytest.raises(ValueError, match="N = 272 > 256"):
        pm.pool_scores_mgpu(qi, w, keys, n_cand, tuning=M(fuse_qlo=True))
    with pytest.raises(ValueError, match="rows=3"):
        M(rows=3)
    # setmaxnreg budgets beyond the CTA's registers at launch hang (h200-attend-run9)
    with pytest.raises(ValueError, match=r"2 \* 240 \+ 40 = 520 .* 3 \* 168 at launch"):
        M(consumer_regs=240)
    with pytest.raises(ValueError, match=r"1 \* 256 \+ 248 = 504 .* 2 \* 248 at launch"):
        M(consumers=1, consumer_regs=256, producer_regs=248)
    with pytest.raises(ValueError, match="multiple of 8"):
        M(producer_regs=44)
    M(consumers=1, consumer_regs=248, producer_regs=248)  # exactly the launch pool
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 1, 32, 128, 16)
    with pytest.raises(ValueError, match="'tf32x3' does not apply to bfloat16 pool keys"):
        pm.pool_scores_mgpu(qi, w, keys.astype(BF16), n_cand, tuning=M(precision="tf32x3"))
    with pytest.raises(ValueError, match="'bf16x3' does not apply to float32 pool keys"):
        pm.pool_scores_mgpu(qi, w, keys, n_cand, tuning=M(precision="bf16x3"))
    with pytest.raises(ValueError, match="pool keys of dtype float16 are not supported"):
        pm.pool_scores_mgpu(qi, w, keys.astype(jnp.float16), n_cand)
    with pytest.raises(ValueError, match="precision='fp8'"):
        M(precision="fp8")


def test_fit_chooses_the_schedule():
    """None fields chosen per shape (none changes the arithmetic): a prompt's rows two per CTA,
    decode rows four stages; what does not fit falls back; set fields are kept."""
    assert (pm.fit(M(), 32, 128, 1).rows, pm.fit(M(), 32, 128, 1).stages) == (1, 4)
    assert (pm.fit(M(), 32, 128, 9000).rows, pm.fit(M(), 32, 128, 9000).stages) == (2, 2)
    assert pm.fit(M(), 64, 128, 1).stages == 2  # qi parts 64 KiB: 4 stages do not fit
    assert pm.fit(M(stages=2), 32, 128, 1).stages == 2
    assert pm.fit(M(rows=1), 32, 128, 9000).rows == 1
    assert pm.fit(M(precision="bf16x6"), 5, 12, 50).rows == 2
    assert pm.supports(M(), 32, 128) is None
    bf = pm.fit(M(), 32, 128, 1, BF16)  # bf16 keys: one wgmma of N = 96, 4 stages
    assert (bf.precision, bf.rows, bf.stages) == ("bf16x3", 1, 4)
    assert pm.fit(M(), 32, 128, 9000, BF16).rows == 2
    assert pm.fit(M(), 32, 128, 1).precision == "tf32x3"
    assert pm.supports(M(), 32, 128, BF16) is None
    assert "does not apply" in pm.supports(M(precision="bf16x6"), 32, 128, BF16)
    assert ps.pick_backend(ps.PoolScoresTuning(), 32, 128, False, BF16) == "mosaic"
    assert "wgmma N" in pm.supports(M(fuse_qlo=True), 200, 128)
    with pytest.raises(ValueError, match="wgmma N = 400"):
        pm.fit(M(fuse_qlo=True), 200, 128, 1)


def test_fit_splits_qi_in_the_kernel_where_it_can():
    """split_q None: in the kernel for the bf16 parts (a prompt's two rows of 32 heads; one
    row of 64; a decode row of 32 heads, padded to 64), in jnp for tf32 parts; an explicit
    True that cannot run raises naming why; False is kept. The padded heads count in the
    wgmma N and the shared memory."""
    assert pm.fit(M(), 32, 128, 9000, BF16).split_q is True
    assert pm.fit(M(), 32, 128, 4, BF16).split_q is True  # one row of 32 heads, padded
    assert pm.fit(M(), 64, 128, 4, BF16).split_q is True
    assert pm.fit(M(precision="bf16x6"), 32, 128, 9000).split_q is True
    assert pm.fit(M(), 32, 128, 9000).split_q is False  # tf32x3: qi's parts are tf32
    assert pm.fit(M(split_q=False), 32, 128, 9000, BF16).split_q is False
    assert pm.fit(M(split_q=False), 32, 128, 4, BF16).split_q is False
    t = pm.fit(M(), 32, 128, 9000, BF16)
    hp, dp = pm.padded_dims(32, 128, t.precision)
    assert pm.kernel_heads(hp, t) == 32  # two rows of 32: 64 rows of the layout already
    assert pm.smem_bytes(hp, dp, t) == pm.smem_bytes(
        hp, dp, dataclasses.replace(t, split_q=False)) + 4 * 2 * 32 * 128  # the f32 qi
    d = pm.fit(M(), 32, 128, 4, BF16)  # a decode row: 32 heads padded to 64
    assert (d.rows, pm.kernel_heads(hp, d), pm.kernel_heads(
        hp, dataclasses.replace(d, split_q=False))) == (
        1, 64, 32)
    assert pm.smem_bytes(hp, dp, d) == 2 * 128 * d.stages * 64 + 2 * 128 * 3 * 64 + 4 * 128 * 64
    assert [pm.kernel_heads(8, M(rows=r, split_q=True)) for r in (1, 2, 4, 8, 16)] == [
        64, 32, 16, 8, 8]
    assert "wgmma N = 384" in pm.supports(M(split_q=True), 72, 128, BF16)  # 72 -> 128 heads
    assert pm.supports(M(split_q=False), 72, 128, BF16) is None
    with pytest.raises(ValueError, match=r"split_q=True needs .*\(precision tf32x3"):
        pm.fit(M(split_q=True), 32, 128, 9000)
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 4, 32, 128, 16)
    with pytest.raises(ValueError, match="split_q=True needs"):
        pm.pool_scores_mgpu(qi, w, keys, n_cand, tuning=M(split_q=True))  # f32 keys: tf32x3


def test_pick_backend():
    """"auto": mosaic where it runs (not interpret mode, no explicit Triton field, Hi and Di
    it supports), decided on Hi and Di only; "mosaic" raises where it cannot run."""
    auto, S = ps.PoolScoresTuning(backend="auto"), ps.PoolScoresTuning
    assert ps.pick_backend(auto, 32, 128, False) == "mosaic"
    assert ps.pick_backend(auto, 5, 12, False) == "mosaic"
    assert ps.pick_backend(auto, 32, 128, True) == "triton"
    assert ps.pick_backend(S(backend="auto", block_p=32), 32, 128, False) == "triton"
    assert ps.pick_backend(S(backend="auto", rows_per_program=1), 32, 128, False) == "triton"
    assert ps.pick_backend(auto, 300, 128, False) == "triton"  # wgmma N > 256
    assert ps.pick_backend(S(backend="triton"), 32, 128, False) == "triton"
    with pytest.raises(ValueError, match="wgmma N"):
        ps.pick_backend(S(backend="mosaic"), 300, 128, False)


def test_default_chunks():
    """About one CTA per multiprocessor, at least one per row, at most one per tile; a padded
    decode's rows count per sequence."""
    assert pm.default_chunks(64, 1, 64, 132) == 2
    assert pm.default_chunks(64, 4, 64, 132) == 2  # 3 of 4 rows padding
    assert pm.default_chunks(1, 4, 64, 132) == 64
    assert pm.default_chunks(1, 1, 64, 132) == 64
    assert pm.default_chunks(4, 9, 64, 132) == 3
    assert pm.default_chunks(1, 9000, 64, 132) == 1


# ------------------------------------------------------------------------------------ GPU


def _mosaic(args, key_dtype=jnp.float32, **kw):
    qi, w, keys, n_cand = args
    return np.asarray(jax.jit(functools.partial(pm.pool_scores_mgpu, tuning=M(**kw)))(
        qi, w, keys.astype(key_dtype), n_cand))


_ODD = [(2, 5, 32, 128, 300), (3, 2, 5, 12, 100), (1, 3, 32, 128, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("kw,dims", [({}, d) for d in _ODD] + [
    (dict(stages=4), _ODD[0]), (dict(chunks=1), _ODD[2]), (dict(chunks=3), _ODD[1]),
    (dict(write_hi=True), _ODD[0]), (dict(fuse_qlo=False), _ODD[1]), (dict(rows=2), _ODD[0]),
    (dict(rows=2, fuse_qlo=False, write_hi=True, stages=4), _ODD[1]),
    (dict(consumers=1, block_p=128), _ODD[2]),
    (dict(consumers=1, stages=3), _ODD[0]), (dict(precision="bf16x6"), _ODD[1]),
    (dict(precision="bf16x6", stages=4, rows=2), _ODD[0]),
    (dict(precision="bf16x6", consumers=1, stages=3), _ODD[2]),
    (dict(persistent=True, chunks=3), _ODD[0]), (dict(persistent=True, rows=2), _ODD[1]),
    (dict(persistent=True, precision="bf16x6", consumers=1), _ODD[2])] + [
    (dict(key_dtype=BF16, **kw), d) for kw, d in [
        ({}, _ODD[0]), ({}, _ODD[1]), ({}, _ODD[2]), (dict(stages=2), _ODD[0]),
        (dict(rows=2), _ODD[1]), (dict(consumers=1, block_p=128), _ODD[2]),
        (dict(chunks=3), _ODD[1]), (dict(persistent=True, rows=2), _ODD[0])]])
def test_gpu_parity_within_bound(kw, dims):
    """Within the derived tf32x3 bound of the float64 definition; -inf exactly past each
    row's candidates (on, before and after tile edges, none, all); no -0.0."""
    b, r, hi, di, p = dims
    qi, w, keys, _ = T.pool_inputs(7, b, r, hi, di, p)
    rng = np.random.default_rng(1)
    n_cand = rng.integers(0, p + 1, (b, r)).astype(np.int32)
    n_cand[0, 0], n_cand[-1, -1] = 0, p
    if r > 2:
        n_cand[0, 1], n_cand[0, 2] = 64, 65
    out = _mosaic((qi, w, keys, jnp.asarray(n_cand)), **kw)
    keys = keys.astype(kw.get("key_dtype", jnp.float32))  # the definition of the stored keys
    bound = T.pool_scores_bound(qi, w, keys, T.TF32X3_ROUNDOFF)
    T.assert_pool_scores_close(out, T.pool_scores_definition(qi, w, keys, n_cand), bound)


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", [jnp.float32, BF16])
def test_gpu_batch_independence(key_dtype):
    """A row's scores, bitwise, alone and in a batch of 64 sequences, as the first of 1 or of
    4 rows per sequence, under other schedules (chunks, persistent CTAs, hi written: equal
    where the tensor core ignores an fp32 word's low 13 bits), and as a row of a prompt chunk
    (2 rows per CTA by `fit`) against the same row scored alone (one per CTA)."""
    qi, w, keys, _ = T.pool_inputs(5, 64, 1, 32, 128, 1000)
    n_cand = jnp.asarray(np.random.default_rng(2).integers(0, 1001, (64, 1)).astype(np.int32))
    mosaic = functools.partial(_mosaic, key_dtype=key_dtype)
    full = mosaic((qi, w, keys, n_cand))
    for i in (0, 31, 63):
        one = mosaic((qi[i:i + 1], w[i:i + 1], keys[i:i + 1], n_cand[i:i + 1]))
        np.testing.assert_array_equal(one[0], full[i])
    q4, w4, _, _ = T.pool_inputs(6, 64, 4, 32, 128, 1000)
    q4 = q4.at[:, :1].set(qi)
    w4 = w4.at[:, :1].set(w)
    nc4 = jnp.concatenate([n_cand, jnp.full((64, 3), 700, jnp.int32)], axis=1)
    np.testing.assert_array_equal(mosaic((q4, w4, keys, nc4))[:, :1], full)
    schedules = (dict(chunks=1), dict(chunks=5), dict(persistent=True, chunks=3))
    for kw in schedules + ((dict(write_hi=True),) if key_dtype == jnp.float32 else ()):
        np.testing.assert_array_equal(mosaic((qi, w, keys, n_cand), **kw), full)
    pq, pw, pk, _ = T.pool_inputs(9, 1, 21, 32, 128, 1000)
    pn = jnp.asarray(np.arange(40, 1000, 46)[None, :21].astype(np.int32))  # [1, 21]
    prompt = mosaic((pq, pw, pk, pn))
    for r in (0, 7, 20):
        one = mosaic((pq[:, r:r + 1], pw[:, r:r + 1], pk, pn[:, r:r + 1]))
        np.testing.assert_array_equal(one, prompt[:, r:r + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(fuse_qlo=False), dict(precision="bf16x6"),
                                dict(key_dtype=BF16)])
def test_gpu_rows_per_cta_same_bits(kw):
    """Two rows per CTA (their heads side by side in the wgmma N) score each row with the
    same bits as one row per CTA: what `MgpuScoresTuning.rows` relies on."""
    qi, w, keys, _ = T.pool_inputs(8, 2, 7, 32, 128, 777)
    n_cand = jnp.asarray(np.random.default_rng(3).integers(0, 778, (2, 7)).astype(np.int32))
    np.testing.assert_array_equal(_mosaic((qi, w, keys, n_cand), rows=2, **kw),
                                  _mosaic((qi, w, keys, n_cand), rows=1, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("kw,dims", [
    (dict(key_dtype=BF16), (1, 37, 32, 128, 2000)),  # a prompt: two rows of 32 heads per CTA
    (dict(key_dtype=BF16, consumers=1), (2, 9, 32, 128, 777)),
    (dict(key_dtype=BF16, persistent=True, rows=2, stages=4), (1, 37, 32, 128, 2000)),
    (dict(key_dtype=BF16), (2, 7, 64, 72, 333)),  # one row of 64 heads, Di padded
    (dict(key_dtype=BF16), (64, 1, 32, 128, 4096)),  # decode rows: 32 heads padded to 64
    (dict(key_dtype=BF16), (3, 4, 32, 128, 777)),  # verify rows, one per CTA, padded heads
    (dict(key_dtype=BF16, stages=2), (2, 3, 5, 12, 100)),  # 5 heads: 8 padded to 64
    (dict(key_dtype=BF16, rows=2), (1, 7, 20, 128, 333)),  # 2 rows of 24 heads at 32
    (dict(precision="bf16x6", rows=2, stages=2), (1, 21, 32, 128, 1000))])
def test_gpu_split_in_the_kernel_same_bits(kw, dims):
    """qi's bf16 parts split by the consumers in shared memory score every pool with the same
    bits as the parts split in jnp (split_q True == False), and within the bound."""
    b, r, hi, di, p = dims
    qi, w, keys, _ = T.pool_inputs(11, b, r, hi, di, p)
    n_cand = np.random.default_rng(4).integers(0, p + 1, (b, r)).astype(np.int32)
    n_cand[0, 0] = p
    args = (qi, w, keys, jnp.asarray(n_cand))
    assert pm.fit(M(**{k: v for k, v in kw.items() if k != "key_dtype"}), hi, di, r,
                  kw.get("key_dtype", F32)).split_q
    inside = _mosaic(args, **kw, split_q=True)
    np.testing.assert_array_equal(inside, _mosaic(args, **kw, split_q=False))
    keys = keys.astype(kw.get("key_dtype", F32))
    T.assert_pool_scores_close(inside, T.pool_scores_definition(qi, w, keys, n_cand),
                               T.pool_scores_bound(qi, w, keys, T.TF32X3_ROUNDOFF))


# --------------------------------------- the counts from positions (`positions=`), issue #14


def _positions_case(b, r, p, kpool, seed):
    """pos [B, R] int32 across the pools' range (row counts on, before and after tile edges,
    0, all) and valid [B, R] bool with invalid rows among them."""
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, p * kpool + kpool, (b, r)).astype(np.int32)
    pos[0, 0], pos[-1, -1] = kpool - 2, p * kpool - 1  # no complete pool; every pool
    valid = rng.random((b, r)) < 0.7
    valid[0, 0] = valid[-1, -1] = True
    if r > 1:
        valid[0, 1] = False
    return jnp.asarray(pos), jnp.asarray(valid)


@pytest.mark.parametrize("shape,tuning", [
    ((64, 1, 32, 128, 4096), M()),  # the selection points: 64 decode rows
    ((64, 4, 32, 128, 4096), M()),  # 4 rows per sequence (3 padding)
    ((1, 7, 32, 128, 333), M(rows=2)),  # rows padded to 8 per sequence in the kernel
    ((2, 9, 32, 128, 200), M(persistent=True, chunks=3)),
])
def test_positions_variants_lower_for_cuda(shape, tuning):
    """With `positions` the kernel takes pos and valid (no pass before it: one launch, the
    Mosaic call alone) and lowers on any host."""
    b, r, hi, di, p = shape
    fn = functools.partial(ps.pool_scores_pallas, tuning=ps.PoolScoresTuning(
        backend="mosaic", mosaic=tuning))
    args = (jax.ShapeDtypeStruct((b, r, hi, di), F32), jax.ShapeDtypeStruct((b, r, hi), F32),
            jax.ShapeDtypeStruct((b, p, di), BF16))
    pos, valid = (jax.ShapeDtypeStruct((b, r), jnp.int32), jax.ShapeDtypeStruct((b, r), bool))

    def call(qi, w, keys, pos, valid):
        return fn(qi, w, keys, None, positions=(pos, valid, 4))

    text = jax.jit(call).trace(*args, pos, valid).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "stablehlo.select" not in text and "stablehlo.divide" not in text  # no counts pass


def test_positions_counts_are_the_candidate_pools():
    """The reference (and the Triton kernel's path) take `positions` as
    `row_meta.candidate_pools` of them: the same scores, bit for bit; exactly one of n_cand
    and positions, and a pool size >= 1, or a clear error."""
    from dsa_jax.pallas.row_meta import candidate_pools

    b, r, hi, di, p, kp = 3, 5, 4, 16, 40, 4
    qi, w, keys, _ = T.pool_inputs(12, b, r, hi, di, p)
    pos, valid = _positions_case(b, r, p, kp, 13)
    want = ps.pool_scores_xla(qi, w, keys, candidate_pools(pos, valid, kp))
    np.testing.assert_array_equal(ps.pool_scores_xla(qi, w, keys, None,
                                                     positions=(pos, valid, kp)), want)
    np.testing.assert_array_equal(ps.pool_scores_pallas(
        qi, w, keys, None, positions=(pos, valid, kp), interpret=True,
        tuning=ps.PoolScoresTuning(backend="triton")), ps.pool_scores_pallas(
        qi, w, keys, candidate_pools(pos, valid, kp), interpret=True,
        tuning=ps.PoolScoresTuning(backend="triton")))
    n_cand = candidate_pools(pos, valid, kp)
    with pytest.raises(ValueError, match="not both"):
        ps.pool_scores_xla(qi, w, keys, n_cand, positions=(pos, valid, kp))
    with pytest.raises(ValueError, match="not both"):
        ps.pool_scores_xla(qi, w, keys, None)
    with pytest.raises(ValueError, match="kpool=0"):
        ps.pool_scores_xla(qi, w, keys, None, positions=(pos, valid, 0))
    with pytest.raises(ValueError, match="pool size 0"):
        pm.pool_scores_mgpu(qi, w, keys, None, positions=(pos, valid, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("kw,dims", [
    (dict(key_dtype=BF16), (64, 1, 32, 128, 4096)),  # the selection-b64 point's rows
    (dict(key_dtype=BF16), (64, 4, 32, 128, 4096)),  # -r4's
    (dict(key_dtype=BF16, rows=2), (1, 37, 32, 128, 2000)),  # a prompt, padded in the kernel
    (dict(key_dtype=BF16, persistent=True, rows=2, stages=4), (2, 9, 32, 128, 777)),
    (dict(key_dtype=BF16, stages=2), (2, 3, 5, 12, 100)),  # odd heads, dims, pools
    (dict(), (3, 5, 32, 128, 300))])  # fp32 keys
def test_gpu_counts_from_positions_same_bits(kw, dims):
    """The counts the kernel takes from pos and valid give the same scores, bit for bit, as
    the counts `row_meta.candidate_pools` computes before it (invalid rows, rows with none,
    rows with every pool, rows padded in the kernel)."""
    from dsa_jax.pallas.row_meta import candidate_pools

    b, r, hi, di, p = dims
    kp = 4
    qi, w, keys, _ = T.pool_inputs(14, b, r, hi, di, p)
    keys = keys.astype(kw.pop("key_dtype", F32))
    pos, valid = _positions_case(b, r, p, kp, 15)
    tuning = M(**kw)
    at = jax.jit(lambda q, w_, k_, p_, v_: pm.pool_scores_mgpu(
        q, w_, k_, None, tuning=tuning, positions=(p_, v_, kp)))(qi, w, keys, pos, valid)
    given = jax.jit(functools.partial(pm.pool_scores_mgpu, tuning=tuning))(
        qi, w, keys, candidate_pools(pos, valid, kp))
    np.testing.assert_array_equal(np.asarray(at), np.asarray(given))
    assert np.isneginf(np.asarray(at)[~np.asarray(valid)]).all()  # no candidate: all -inf
