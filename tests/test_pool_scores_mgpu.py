"""The Mosaic GPU pool-scores kernel (`pallas/pool_scores_mgpu.py`, issue #14).

On any host: the kernel lowers for cuda (Pallas -> Mosaic GPU MLIR; the kernel cannot run on
a CPU) at the plans `fit` chooses, for fp32 keys and for bf16 keys (a bf16 index cache), a
numpy model of its arithmetic (tf32 or bf16 splits, the products it runs per key x head)
meets the derived bound the GPU kernels are held to (`testing.pool_scores_bound` with
`TF32X3_ROUNDOFF`), and bad plans and arguments raise. On the GPU (`gpu` marker): parity
against the float64 definition within that bound (odd P, n_cand off the tile edges, rows with
none, odd heads and dims), -inf exactly past the candidates, and the SPEC's batch independence
with `==`: a row alone against the same row in a batch, 1 vs 4 rows per sequence, chunk
counts, rows per CTA and where qi is split.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.pallas import common
from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_scores_mgpu as pm

Plan = pm.Plan
F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("shape,key_dtype,plan", [
    ((2, 4, 32, 128, 4096), F32, None),  # GLM-5.3-Flash: 2 sequences x 4 rows
    ((2, 3, 5, 12, 100), F32, None),  # odd heads, dims, pools (keys padded to 104 x 32)
    ((1, 9, 32, 128, 200), F32, None),  # a prompt's rows: two per CTA
    ((1, 50, 32, 128, 4096), F32, None),
    ((64, 1, 32, 128, 4096), F32, None),
    ((1, 9000, 32, 128, 4096), F32, None),
    ((2, 4, 64, 128, 1000), F32, None),  # 64 heads: 2 stages
    ((2, 4, 32, 128, 4096), BF16, None),  # bf16 keys: "bf16x3", qi split in the kernel
    ((64, 1, 32, 128, 4096), BF16, None),  # decode rows: 32 heads, 64 in the kernel
    ((2, 3, 5, 12, 100), BF16, None),  # Di padded to 64
    ((1, 50, 32, 128, 4096), BF16, None),
    ((1, 9000, 32, 128, 4096), BF16, None),
    ((1, 7, 64, 72, 333), BF16, None),  # qi split in the kernel, Di padded to 128
    ((1, 7, 20, 128, 333), BF16, None),  # 2 rows of 24 heads at 32: one copy a row
    ((2, 3, 72, 128, 100), BF16, None),  # 72 heads: qi split in jnp (N 384 in the kernel)
    ((1, 9000, 32, 128, 4096), BF16, Plan("bf16x3", 2, 2, False)),  # qi split in jnp
    ((64, 1, 32, 128, 4096), F32, Plan("tf32x3", 2, 2, False)),  # 2 rows per CTA at decode
])
def test_kernel_lowers_for_cuda(shape, key_dtype, plan):
    """The kernel lowers on any host (the Mosaic GPU lowering rules run here), so a kernel that
    cannot lower fails before the device."""
    b, r, hi, di, p = shape
    f32, i32 = jnp.float32, jnp.int32
    if plan is None:
        fn = functools.partial(ps.pool_scores_pallas, backend="mosaic")
    else:
        fn = functools.partial(pm.pool_scores_mgpu, plan=plan)
    args = (jax.ShapeDtypeStruct((b, r, hi, di), f32), jax.ShapeDtypeStruct((b, r, hi), f32),
            jax.ShapeDtypeStruct((b, p, di), key_dtype), jax.ShapeDtypeStruct((b, r), i32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "custom_call @__gpu$xla.gpu.triton" not in text
    split = (plan or pm.fit(hi, di, r, key_dtype)).split_q
    assert ("stablehlo.concatenate" in text) == (not split)  # qi's parts split in jnp


def _trunc(x, mask=pm.TF32_MASK):
    return (np.asarray(x, np.float32).view(np.int32) & np.int32(mask)).view(np.float32)


def _parts(x, split):
    """The kernel's operand splits, as float32 arrays: (hi, lo), (x1, x2, x3) or (x,)."""
    if split == "as-stored":  # bf16x3's keys: bf16 values, not split
        return (np.asarray(x, np.float32),)
    if split == "tf32":
        return tuple(np.asarray(a) for a in pm.split_tf32(jnp.asarray(x)))
    return tuple(np.asarray(a.astype(jnp.float32)) for a in pm.split_bf16(jnp.asarray(x)))


def _model(qi, w, keys, n_cand, precision="tf32x3"):
    """The kernel's arithmetic in numpy: its splits of both operands, the products it runs
    (tf32x3: hi hi + lo hi + hi lo; bf16x3: bf16 keys as stored times qi's three parts)
    summed exactly (float64, standing in for the tensor core's wide accumulation), then fp32
    relu, weights, head sum."""
    f64 = functools.partial(np.asarray, dtype=np.float64)
    qs = _parts(qi, "bf16" if precision == "bf16x3" else "tf32")
    ks = _parts(keys, "as-stored" if precision == "bf16x3" else "tf32")

    def dot(a, b):
        return np.einsum("brhd,bpd->brhp", f64(a), f64(b))

    pairs = {"tf32x3": [(0, 0), (0, 1), (1, 0)], "bf16x3": [(0, 0), (1, 0), (2, 0)]}[precision]
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
    |x - x1 - x2 - x3| <= 2^-23 |x|: what the bf16x3 precision's bound rests on."""
    x = np.random.default_rng(4).standard_normal(8192).astype(np.float32) * 1e3
    x1, x2, x3 = _parts(x, "bf16")
    for part in (x1, x2):
        assert not (part.view(np.int32) & np.int32(0xFFFF)).any()
    ax = np.abs(x.astype(np.float64))
    assert (np.abs(x - x1.astype(np.float64)) < 2.0 ** -7 * ax).all()
    assert (np.abs(x - x1.astype(np.float64) - x2) < 2.0 ** -14 * ax).all()
    assert (np.abs(x - x1.astype(np.float64) - x2 - x3) <= 2.0 ** -23 * ax).all()


@pytest.mark.parametrize("precision", ["tf32x3", "bf16x3"])
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


def test_bad_plans_and_arguments_raise():
    with pytest.raises(ValueError, match="stages=3"):
        Plan("tf32x3", 1, 3, False)
    with pytest.raises(ValueError, match="rows=3"):
        Plan("tf32x3", 3, 2, False)
    with pytest.raises(ValueError, match="precision='fp8'"):
        Plan("fp8", 1, 2, False)
    with pytest.raises(ValueError, match="backend='cuda'"):
        ps.PoolScoresTuning(backend="cuda")
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 1, 2, 8, 16)
    with pytest.raises(ValueError, match="no interpret mode"):
        ps.pool_scores_pallas(qi, w, keys, n_cand, interpret=True, backend="mosaic")
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 1, 32, 128, 16)
    with pytest.raises(ValueError, match="shared memory"):  # 360 KiB
        pm.pool_scores_mgpu(qi, w, keys, n_cand, plan=Plan("tf32x3", 1, 8, False))
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 1, 129, 32, 16)
    with pytest.raises(ValueError, match="N = 272 > 256"):  # hi x [qhi | qlo]: 2 x 136 heads
        pm.pool_scores_mgpu(qi, w, keys, n_cand)
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 1, 32, 128, 16)
    with pytest.raises(ValueError, match="'tf32x3' does not apply to bfloat16 pool keys"):
        pm.pool_scores_mgpu(qi, w, keys.astype(BF16), n_cand, plan=Plan("tf32x3", 1, 2, False))
    with pytest.raises(ValueError, match="'bf16x3' does not apply to float32 pool keys"):
        pm.pool_scores_mgpu(qi, w, keys, n_cand, plan=Plan("bf16x3", 1, 2, False))
    with pytest.raises(ValueError, match="pool keys of dtype float16 are not supported"):
        pm.pool_scores_mgpu(qi, w, keys.astype(jnp.float16), n_cand)


def test_register_budgets():
    """The kernel's setmaxnreg budgets fit the CTA's registers at launch; budgets beyond them
    hang (a consumer's increase waits forever), so `check_register_budgets` refuses them."""
    common.check_register_budgets(pm.CONSUMERS, pm.CONSUMER_REGS, pm.PRODUCER_REGS)
    check = common.check_register_budgets
    with pytest.raises(ValueError, match=r"2 \* 240 \+ 40 = 520 .* 3 \* 168 at launch"):
        check(2, 240, 40)
    with pytest.raises(ValueError, match=r"1 \* 256 \+ 248 = 504 .* 2 \* 248 at launch"):
        check(1, 256, 248)
    with pytest.raises(ValueError, match="multiple of 8"):
        check(2, 232, 44)
    check(1, 248, 248)  # exactly the launch pool


def test_fit_chooses_the_schedule():
    """The plan per shape (none changes the arithmetic): a prompt's rows two per CTA, decode
    rows four stages; what does not fit falls back; the precision follows the keys' dtype."""
    assert (pm.fit(32, 128, 1).rows, pm.fit(32, 128, 1).stages) == (1, 4)
    assert (pm.fit(32, 128, 9000).rows, pm.fit(32, 128, 9000).stages) == (2, 2)
    assert pm.fit(64, 128, 1).stages == 2  # qi parts 64 KiB: 4 stages do not fit
    assert pm.fit(5, 12, 50).rows == 2
    assert pm.supports(32, 128) is None
    bf = pm.fit(32, 128, 1, BF16)  # bf16 keys: one wgmma of N = 96 (192 in the kernel)
    assert (bf.precision, bf.rows, bf.stages) == ("bf16x3", 1, 4)
    assert pm.fit(32, 128, 9000, BF16).rows == 2
    assert pm.fit(32, 128, 1).precision == "tf32x3"
    assert pm.supports(32, 128, BF16) is None
    assert "not supported" in pm.supports(32, 128, jnp.float16)
    assert ps.pick_backend(ps.PoolScoresTuning(), 32, 128, False, BF16) == "mosaic"
    assert "wgmma N" in pm.supports(200, 128)
    with pytest.raises(ValueError, match="wgmma N = 400"):
        pm.fit(200, 128, 1)


def test_fit_splits_qi_in_the_kernel_where_it_can():
    """For the bf16 parts qi is split in the kernel (a prompt's two rows of 32 heads; one row of
    64; a decode row of 32 heads, padded to 64) unless the padded heads overflow the wgmma N;
    in jnp for tf32 parts. The padded heads count in the wgmma N and the shared memory."""
    assert pm.fit(32, 128, 9000, BF16).split_q is True
    assert pm.fit(32, 128, 4, BF16).split_q is True  # one row of 32 heads, padded
    assert pm.fit(64, 128, 4, BF16).split_q is True
    assert pm.fit(32, 128, 9000).split_q is False  # tf32x3: qi's parts are tf32
    assert pm.fit(72, 128, 4, BF16).split_q is False  # 72 -> 128 heads: N 384
    t = pm.fit(32, 128, 9000, BF16)
    hp, dp = pm.padded_dims(32, 128, t.precision)
    assert pm.kernel_heads(hp, t) == 32  # two rows of 32: 64 rows of the layout already
    assert pm.smem_bytes(hp, dp, t) == pm.smem_bytes(
        hp, dp, dataclasses.replace(t, split_q=False)) + 4 * 2 * 32 * 128  # the f32 qi
    d = pm.fit(32, 128, 4, BF16)  # a decode row: 32 heads padded to 64
    assert (d.rows, pm.kernel_heads(hp, d), pm.kernel_heads(
        hp, dataclasses.replace(d, split_q=False))) == (
        1, 64, 32)
    assert pm.smem_bytes(hp, dp, d) == 2 * 128 * d.stages * 64 + 2 * 128 * 3 * 64 + 4 * 128 * 64
    assert [pm.kernel_heads(8, Plan("bf16x3", r, 2, True)) for r in (1, 2, 4, 8, 16)] == [
        64, 32, 16, 8, 8]
    assert "wgmma N = 384" in pm.why_not(Plan("bf16x3", 1, 2, True), 72, 128)
    assert pm.why_not(Plan("bf16x3", 1, 2, False), 72, 128) is None
    assert "split_q=True needs" in pm.why_not(Plan("tf32x3", 1, 2, True), 32, 128)
    qi, w, keys, n_cand = T.pool_inputs(1, 1, 4, 32, 128, 16)
    with pytest.raises(ValueError, match="split_q=True needs"):  # f32 keys: tf32x3
        pm.pool_scores_mgpu(qi, w, keys, n_cand, plan=Plan("tf32x3", 1, 2, True))


def test_pick_backend():
    """"auto": mosaic where it runs (not interpret mode, Hi and Di it supports), decided on Hi
    and Di only; "mosaic" raises where it cannot run."""
    auto, S = ps.PoolScoresTuning(backend="auto"), ps.PoolScoresTuning
    assert ps.pick_backend(auto, 32, 128, False) == "mosaic"
    assert ps.pick_backend(auto, 5, 12, False) == "mosaic"
    assert ps.pick_backend(auto, 32, 128, True) == "triton"
    assert ps.pick_backend(auto, 300, 128, False) == "triton"  # wgmma N > 256
    assert ps.pick_backend(auto, 32, 128, False, jnp.float16) == "triton"
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


def _mosaic(args, key_dtype=F32, sms=None, **plan):
    """The kernel on args (keys cast to key_dtype) at `fit`'s plan with the fields in `plan`
    replaced; sms: the multiprocessors `default_chunks` divides (other chunk counts)."""
    qi, w, keys, n_cand = args
    _, r, hi, di = qi.shape
    t = dataclasses.replace(pm.fit(hi, di, r, key_dtype), **plan) if plan else None
    return np.asarray(jax.jit(functools.partial(pm.pool_scores_mgpu, plan=t, sms=sms))(
        qi, w, keys.astype(key_dtype), n_cand))


_ODD = [(2, 5, 32, 128, 300), (3, 2, 5, 12, 100), (1, 3, 32, 128, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("kw,dims", [({}, d) for d in _ODD] + [
    (dict(sms=1), _ODD[2]), (dict(sms=400), _ODD[1]), (dict(stages=2), _ODD[0]),
    (dict(rows=2), _ODD[0]), (dict(rows=2, stages=4), _ODD[1]),
    ({}, (1, 9, 32, 128, 1000))] + [
    (dict(key_dtype=BF16, **kw), d) for kw, d in [
        ({}, _ODD[0]), ({}, _ODD[1]), ({}, _ODD[2]), (dict(stages=2), _ODD[0]),
        (dict(rows=2), _ODD[1]), (dict(sms=400), _ODD[1]), ({}, (1, 9, 32, 128, 1000)),
        ({}, (2, 3, 72, 128, 100))]])
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
    4 rows per sequence, under other chunk counts, and as a row of a prompt chunk (2 rows per
    CTA by `fit`) against the same row scored alone (one per CTA)."""
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
    for sms in (64, 320):  # one chunk per row; five
        np.testing.assert_array_equal(mosaic((qi, w, keys, n_cand), sms=sms), full)
    pq, pw, pk, _ = T.pool_inputs(9, 1, 21, 32, 128, 1000)
    pn = jnp.asarray(np.arange(40, 1000, 46)[None, :21].astype(np.int32))  # [1, 21]
    prompt = mosaic((pq, pw, pk, pn))
    for r in (0, 7, 20):
        one = mosaic((pq[:, r:r + 1], pw[:, r:r + 1], pk, pn[:, r:r + 1]))
        np.testing.assert_array_equal(one, prompt[:, r:r + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", [F32, BF16])
def test_gpu_rows_per_cta_same_bits(key_dtype):
    """Two rows per CTA (their heads side by side in the wgmma N: a prompt's plan) score each
    row with the same bits as one row per CTA (a decode's)."""
    qi, w, keys, _ = T.pool_inputs(8, 2, 7, 32, 128, 777)
    n_cand = jnp.asarray(np.random.default_rng(3).integers(0, 778, (2, 7)).astype(np.int32))
    args = (qi, w, keys, n_cand)
    np.testing.assert_array_equal(_mosaic(args, key_dtype, rows=2),
                                  _mosaic(args, key_dtype, rows=1))


@pytest.mark.gpu
@pytest.mark.parametrize("kw,dims", [
    ({}, (1, 37, 32, 128, 2000)),  # a prompt: two rows of 32 heads per CTA
    (dict(stages=4), (2, 9, 32, 128, 777)),
    ({}, (2, 7, 64, 72, 333)),  # one row of 64 heads, Di padded
    ({}, (64, 1, 32, 128, 4096)),  # decode rows: 32 heads padded to 64
    ({}, (3, 4, 32, 128, 777)),  # verify rows, one per CTA, padded heads
    (dict(stages=2), (2, 3, 5, 12, 100)),  # 5 heads: 8 padded to 64
    (dict(rows=2), (1, 7, 20, 128, 333))])  # 2 rows of 24 heads at 32
def test_gpu_split_in_the_kernel_same_bits(kw, dims):
    """qi's bf16 parts split by the consumers in shared memory score every pool with the same
    bits as the parts split in jnp (split_q True == False), and within the bound."""
    b, r, hi, di, p = dims
    qi, w, keys, _ = T.pool_inputs(11, b, r, hi, di, p)
    n_cand = np.random.default_rng(4).integers(0, p + 1, (b, r)).astype(np.int32)
    n_cand[0, 0] = p
    args = (qi, w, keys, jnp.asarray(n_cand))
    assert pm.fit(hi, di, r, BF16).split_q
    inside = _mosaic(args, BF16, **kw, split_q=True)
    np.testing.assert_array_equal(inside, _mosaic(args, BF16, **kw, split_q=False))
    keys = keys.astype(BF16)
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


@pytest.mark.parametrize("shape", [
    (64, 1, 32, 128, 4096),  # the selection points: 64 decode rows
    (64, 4, 32, 128, 4096),  # 4 rows per sequence (3 padding)
    (1, 7, 32, 128, 333),  # a prompt's rows, padded to 8 per sequence in the kernel
    (2, 9, 32, 128, 200),
])
def test_positions_lower_for_cuda(shape):
    """With `positions` the kernel takes pos and valid (no pass before it: one launch, the
    Mosaic call alone) and lowers on any host."""
    b, r, hi, di, p = shape
    fn = functools.partial(ps.pool_scores_pallas, backend="mosaic")
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
@pytest.mark.parametrize("key_dtype,dims", [
    (BF16, (64, 1, 32, 128, 4096)),  # the selection-b64 point's rows
    (BF16, (64, 4, 32, 128, 4096)),  # -r4's
    (BF16, (1, 37, 32, 128, 2000)),  # a prompt, padded in the kernel
    (BF16, (2, 9, 32, 128, 777)),
    (BF16, (2, 3, 5, 12, 100)),  # odd heads, dims, pools
    (F32, (3, 5, 32, 128, 300))])
def test_gpu_counts_from_positions_same_bits(key_dtype, dims):
    """The counts the kernel takes from pos and valid give the same scores, bit for bit, as
    the counts `row_meta.candidate_pools` computes before it (invalid rows, rows with none,
    rows with every pool, rows padded in the kernel)."""
    from dsa_jax.pallas.row_meta import candidate_pools

    b, r, hi, di, p = dims
    kp = 4
    qi, w, keys, _ = T.pool_inputs(14, b, r, hi, di, p)
    keys = keys.astype(key_dtype)
    pos, valid = _positions_case(b, r, p, kp, 15)
    at = jax.jit(lambda q, w_, k_, p_, v_: pm.pool_scores_mgpu(
        q, w_, k_, None, positions=(p_, v_, kp)))(qi, w, keys, pos, valid)
    given = jax.jit(pm.pool_scores_mgpu)(qi, w, keys, candidate_pools(pos, valid, kp))
    np.testing.assert_array_equal(np.asarray(at), np.asarray(given))
    assert np.isneginf(np.asarray(at)[~np.asarray(valid)]).all()  # no candidate: all -inf
