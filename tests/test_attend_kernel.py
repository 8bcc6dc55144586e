"""Gather-attend kernels beside the Triton default: the Triton kernel's gather (interpret
mode), the Mosaic GPU kernel's host side and arithmetic, and the backend rule.

Mosaic GPU kernels do not run here: jax's experimental GPU interpret mode (0.10.2) lacks
primitives the kernel uses (plgpu.load, run_state). So the kernel itself is checked on the GPU
against the jnp twin with the bound below (tests/test_kernels.py, `gpu` marker), and here its
arithmetic is modelled in numpy (the same rounding points: f16 q scaled per head group, f16 p,
fp32 sums, log2-unit softmax, per-split partials in f16 merged by `merge_splits`) and held to
that bound, together with the jnp pieces it runs (`row_scales`, `head_scales`), and it is
lowered for CUDA at odd shapes.

Tolerances, derived (e = 2^-24, fp32 accumulation), per row with s = softmax_scale * kv_scale,
c_j the dequantized latent row, M = max_j |c_j|_inf and L_j = s sum_c |q_c| |c_jc|:
  * Triton (bf16 operands, u = 2^-8): tests/test_kernels.py's bound (dsa_jax.testing),
    2 [(exp(2D) - 1) + u + 4 (W + S) e] M with D = max_j (u + 2 C e) L_j.
  * Mosaic (f16 operands, u = 2^-11): each head group's q is scaled by 2^k (its max |q| in
    [2^13, 2^14)) before the f16 rounding: |dq| <= u |q| + 2^-25 2^-k (f16 subnormals), with
    2^-k at most the row's own scale's (`row_scales`), latents are exact
    (e4m3 is a subset of f16), so the logits move by D = max_j (u + 2 C e) L_j
    + s 2^-25 2^-k max_j sum_c |c_jc|. p is rounded to f16 (relative u, absolute 2^-25 below
    2^-14) against an fp32 denominator >= 1: u M + W 2^-25 M. exp2 (approximate, ~2^-22) and
    the fp32 sums: 4 (W + S) e M. => 2 [(exp(2D) - 1) + u + W 2^-25 + 4 (W + S) e] M.
    With S > 1 each split's normalized partial is rounded to f16 in the cache's units before
    the merge (relative u, absolute 2^-25 kv_scale below f16's normal range); the merge is a
    convex combination: + u M + 2^-25 kv_scale inside the bracket's factor 2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import testing as T
from dsa_jax.pallas import mgpu_gather
from dsa_jax.pallas import sparse_attend as sa
from dsa_jax.pallas import sparse_attend_mgpu as mg

U_F16 = T.unit_roundoff(jnp.float16)


def _bound(q, lat, kv_scale, tables, sel, scale, u, splits, q_sub=None, half=False):
    """The module docstring's elementwise bound, [B, R, 1, 1]. q_sub [B, R]: 2^-25 2^-k (f16
    subnormal rounding of the scaled q, Mosaic only); half: f16 partials."""
    floors = {} if q_sub is None else dict(q_floor=q_sub, p_floor=2.0 ** -25)
    if half:
        floors.update(partial_u=U_F16, partial_floor=2.0 ** -25 * float(kv_scale))
    return T.attend_bound(q, lat, kv_scale, tables, sel, scale, u, splits, **floors)


# ------------------------------------------------------------------ Triton kernel

def test_triton_never_reads_unselected_rows():
    """Every cache row outside the selection (slot 0 included, which empty slots clamp to) is
    NaN: the output has no NaN and equals, bitwise, the output with those rows finite."""
    q, lat, kv, tables, sel = T.attend_inputs(7, 2, 2, 5, 24, 37, 8, 6, "float8_e4m3fn",
                                      empty=[(1, 1)])
    nb, bs, c = lat.shape
    rows = jax.vmap(sa.token_slots, in_axes=(0, 0, None))(sel, tables, bs)
    sel = jnp.where(rows == 0, -1, sel)  # slot 0, which empty slots clamp to, is poisoned too
    rows = np.asarray(jnp.where(sel >= 0, rows, -1))
    used = np.zeros(nb * bs, bool)
    used[rows[rows >= 0]] = True
    flat = np.asarray(lat.astype(jnp.float32)).reshape(nb * bs, c)
    poisoned = jnp.asarray(np.where(used[:, None], flat, np.nan).reshape(lat.shape), lat.dtype)
    tun = sa.AttendTuning(backend="triton")
    outs = [np.asarray(sa.sparse_attend_pallas(q, x, kv, tables, sel, softmax_scale=0.3,
                                               interpret=True, tuning=tun, block_w=16))
            for x in (poisoned, lat)]
    assert not np.isnan(outs[0]).any()
    T.assert_trees_bitwise_equal(outs[0], outs[1])
    assert (outs[0][1, 1] == 0).all() and (np.abs(outs[0][0, 0]) > 0).any()


# ------------------------------------------------------------------ backend rule, tuning

def test_backend_rule():
    fp8, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    auto, tri, mos = sa.AttendTuning(), sa.AttendTuning("triton"), sa.AttendTuning("mosaic")
    pick = sa.pick_backend
    assert pick(auto, fp8, 64, 512, False, False) == "mosaic"
    assert pick(auto, fp8, 128, 512, False, False) == "mosaic"
    assert pick(auto, fp8, 64, 512, True, False) == "triton"  # interpret mode
    assert pick(auto, fp8, 64, 512, False, True) == "triton"  # a Triton tile argument
    assert pick(auto, fp8, 8, 512, False, False) == "triton"  # heads not filling a tile
    assert pick(auto, fp8, 31, 512, False, False) == "triton"  # under half a tile
    assert pick(auto, fp8, 32, 512, False, False) == "mosaic"  # TP 2: half a tile, padded
    assert pick(auto, fp8, 96, 512, False, False) == "mosaic"
    assert pick(auto, bf16, 64, 512, False, False) == "triton"
    assert pick(auto, jnp.float32, 64, 512, False, False) == "triton"
    assert pick(auto, fp8, 64, 24, False, False) == "triton"  # C not a multiple of 128
    assert pick(tri, fp8, 64, 512, False, False) == "triton"
    assert pick(mos, fp8, 8, 512, False, False) == "mosaic"  # asked for: padded heads
    with pytest.raises(ValueError, match="bfloat16"):
        pick(mos, bf16, 64, 512, False, False)
    with pytest.raises(ValueError, match="C=640"):
        pick(mos, fp8, 64, 640, False, False)
    with pytest.raises(ValueError, match="interpret"):
        pick(mos, fp8, 64, 512, True, False)
    with pytest.raises(ValueError, match="interpret"):  # raised before anything is traced
        sa.sparse_attend_pallas(*T.attend_inputs(1, 1, 1, 64, 128, 8, 8, 2, "float8_e4m3fn"),
                                softmax_scale=0.3, interpret=True, tuning=mos)


def test_tuning_defaults_are_the_librarys_and_errors_name_the_value():
    assert sa.AttendTuning().mosaic == mg.MgpuTuning() and sa.AttendTuning().backend == "auto"
    with pytest.raises(ValueError, match="cuda"):
        sa.AttendTuning(backend="cuda")
    with pytest.raises(ValueError, match="max_splits=0"):
        mg.MgpuTuning(max_splits=0)


def test_mosaic_plan_fits_the_h200():
    t = mg.MgpuTuning()
    # Q halves 64 KiB, two f16 tiles 128 KiB, P 8 KiB, the row statistics (the slots on top).
    assert mg.smem_bytes(512) == 65536 + 2 * 65536 + 8192 + 512 <= mg.SMEM_LIMIT
    assert mg.supports(jnp.float8_e4m3fn, 512) is None
    assert mg.supports(jnp.float8_e4m3fn, 384) is None
    assert "bfloat16" in mg.supports(jnp.bfloat16, 512)
    assert "C=640" in mg.supports(jnp.float8_e4m3fn, 640)
    assert "C=192" in mg.supports(jnp.float8_e4m3fn, 192)
    # 64 rows x 1 head block: 2 splits fill 132 multiprocessors; 256 x 2 need no split.
    assert mg.num_splits(64, 33, 132, 16) == 2
    assert mg.num_splits(512, 32, 132, 16) == 1
    # One row: 16 splits at most would run 3 tiles each, so 11 splits run them all (no split
    # of padding only); the default's 64 run one tile per split.
    assert mg.num_splits(1, 33, 132, 16) == 11 and mg.num_splits(1, 3, 132, 16) == 3
    assert mg.num_splits(1, 33, 132, t.max_splits) == 33
    assert mg.num_splits(8, 33, 132, t.max_splits) == 11  # 16 fit: 3 tiles each
    for ps in range(1, 300):  # never an idle split, never more tiles per split than `most`'s
        for tiles in (1, 2, 3, 16, 33, 64):
            s = mg.num_splits(ps, tiles, 132, 64)
            most = max(1, min(64, tiles, 132 // ps))
            per = -(-tiles // s)
            assert (s - 1) * per < tiles and per == -(-tiles // most)


@pytest.mark.parametrize("c", [384, 512])
def test_register_gather_places_every_element_once(c):
    """The converting warpgroup's register gather (`mgpu_gather`, the same index code evaluated
    on ints):
    the 128 threads' chunks cover every element of a 64-row tile once, a warp's load is 256
    contiguous bytes of the rows, and each chunk lands where the swizzled f16 tile holds that
    (row, column): tiled (8, 64), the 16-byte chunk index XOR the row within its 8-row tile."""
    bw, half, o, vec = 64, c // 2, mgpu_gather.IntOps, mgpu_gather.VEC
    chunks = bw * c // (128 * vec)
    seen = np.zeros((bw, c), int)
    placed = np.zeros((2, bw // 8, half // 64, 8, 64), int)
    for tid in range(128):
        for k in range(chunks):
            row, col = mgpu_gather.chunk_source(o, tid, k, c)
            seen[row, col:col + vec] += 1
            h, rb, cb, ri, x = mgpu_gather.chunk_place(o, row, col, c)
            assert x % vec == 0 and rb == row // 8 and ri == row % 8 and h == col // half
            assert cb == (col % half) // 64
            assert x // vec == ((col % 64) // vec) ^ (row % 8)  # the 128-byte swizzle
            placed[h, rb, cb, ri, x:x + vec] += 1
            if tid % 32 == 0:  # the warp's 32 chunks: 256 contiguous bytes of the rows
                ends = [mgpu_gather.chunk_source(o, tid + i, k, c) for i in (0, 31)]
                flat = [r * c + x0 for r, x0 in ends]
                assert flat[1] - flat[0] == 31 * vec
    assert (seen == 1).all() and (placed == 1).all()


# ------------------------------------------------------------------ Mosaic host side, math

def test_row_scales_are_exact_powers_of_two():
    q = np.array(T.random_rows(3, 5, 3, 16))
    q[1] *= 1e-30
    q[2] *= 1e30
    q[3] = 0.0
    q[4, 0, 0] = 65504.0 * 8  # beyond f16 before scaling
    up, down = (np.asarray(x) for x in mg.row_scales(jnp.asarray(q)))
    np.testing.assert_array_equal(up * down, 1.0)
    assert (np.frexp(up)[0] == 0.5).all()  # powers of two: the scaling is exact
    amax = np.abs(q).max(axis=(1, 2)) * up
    live = amax > 0
    assert ((amax[live] >= 2.0 ** 13) & (amax[live] < 2.0 ** 14)).all()
    q16 = (jnp.asarray(q) * jnp.asarray(up)[:, None, None]).astype(jnp.float16)
    back = np.asarray(q16, np.float64) * down[:, None, None]
    tol = U_F16 * np.abs(q) + 2.0 ** -25 * down[:, None, None]  # f16 rounding, subnormals
    assert np.isfinite(back).all() and (np.abs(back - q) <= tol).all()


def _mosaic_model(q, lat, kv, tables, sel, scale, splits, half=True):
    """The Mosaic kernel's arithmetic in numpy float32 (same rounding points), then the same
    split merge: [B, R, H, C], and the rows' q floors 2^-25 2^-k [B, R] (the largest of their
    head groups'). q scaled per group of `SCALE_HEADS` heads (`mosaic_inputs_jnp`), each logit
    row by its head's 2^-k; the logits one fp32 dot over all C. half: with splits > 1 the
    partials f16 in the cache's units and the merge scaling by kv, as the kernel writes them
    (False: f32 partials, to show the rounding)."""
    half = half and splits > 1
    b, r, h, c = q.shape
    n, w, block_w = b * r, sel.shape[-1], mg.BLOCK_W
    q16, _, down, _, _ = (np.asarray(x) for x in sa.mosaic_inputs_jnp(
        jnp.asarray(q).reshape(n, h, c), sel, tables, lat.shape[1], hp=mg.HEADS_PER_CTA, wp=w))
    q16, down = q16[:, :h], down[:, :h]
    slots = np.asarray(jax.vmap(sa.token_slots, in_axes=(0, 0, None))(
        sel, tables, lat.shape[1])).reshape(n, w)
    tiles_all = -(-w // block_w)
    tiles = -(-tiles_all // splits)
    slots = np.pad(slots, ((0, 0), (0, splits * tiles * block_w - w)), constant_values=-1)
    flat = np.asarray(lat.astype(jnp.float32)).reshape(-1, c)  # stored values: exact in f16
    log2e = np.float32(np.log2(np.e))
    o = np.zeros((n, splits, h, c), np.float32)
    m_out = np.zeros((n, splits, h), np.float32)
    l_out = np.zeros((n, splits, h), np.float32)
    for i in range(n):
        ls = (np.float32(kv * scale) * down[i] * log2e)[:, None]  # [H, 1]
        for s in range(splits):
            m = np.full(h, -1e30, np.float32)
            l = np.zeros(h, np.float32)
            acc = np.zeros((h, c), np.float32)
            for t in range(tiles):
                sl = slots[i, (s * tiles + t) * block_w:(s * tiles + t + 1) * block_w]
                tile = np.where((sl >= 0)[:, None], flat[np.maximum(sl, 0)], 0.0)
                tile = tile.astype(np.float16).astype(np.float32)  # [BW, C]
                dots = q16[i].astype(np.float32) @ tile.T
                logits = np.where(sl[None] >= 0, dots * ls, -np.inf)
                m_new = np.maximum(m, logits.max(axis=1))
                alpha = np.exp2(m - m_new)
                p = np.exp2(logits - m_new[:, None]).astype(np.float32)
                l = l * alpha + p.sum(axis=1)
                acc = acc * alpha[:, None] + p.astype(np.float16).astype(np.float32) @ tile
                m = m_new
            o[i, s] = acc * (np.float32(1.0 if half else kv) / np.where(l > 0, l, 1.0))[:, None]
            m_out[i, s], l_out[i, s] = m / log2e, l
    o = o.astype(np.float16) if half else o
    out = sa.merge_splits(jnp.asarray(o), jnp.asarray(m_out), jnp.asarray(l_out),
                          scale=jnp.float32(kv) if half else None)
    return np.asarray(out).reshape(b, r, h, c), (2.0 ** -25) * down.max(axis=1).reshape(b, r)


@pytest.mark.parametrize("splits", [1, 3])
def test_mosaic_arithmetic_meets_the_f16_bound(splits):
    args = T.attend_inputs(11 + splits, 2, 2, 5, 256, 150, 16, 12, "float8_e4m3fn", kv_scale=1 / 64,
                   empty=[(1, 0)])
    got, q_sub = _mosaic_model(*args, 0.0625, splits)
    ref = sa.sparse_attend_xla(*args, softmax_scale=0.0625)
    T.assert_attend_close(got, ref, _bound(*args, 0.0625, U_F16, splits, q_sub, half=splits > 1))
    if splits > 1:  # the partials' rounding shows: not the f32 partials' result
        f32, _ = _mosaic_model(*args, 0.0625, splits, half=False)
        assert (got != f32).any()
    assert (got[1, 0] == 0).all()
    # The bound is not vacuous: the bf16 kernel's error on the same inputs is larger.
    tri = sa.sparse_attend_pallas(*args, softmax_scale=0.0625, interpret=True,
                                  tuning=sa.AttendTuning("triton"), block_w=32)
    e16 = np.abs(got - np.asarray(ref)).max()
    assert 0 < e16 < np.abs(np.asarray(tri) - np.asarray(ref)).max()


def test_mosaic_kernel_lowers_for_cuda():
    """The Mosaic kernel cannot run here, but it lowers (Pallas -> Mosaic GPU MLIR) on any
    host: it traces and lowers at odd shapes (5 heads padded to 64, C = 384, a partial last
    tile, 3 splits) before it reaches the device, with the Triton prep and merge beside it."""
    f32, i32 = jnp.float32, jnp.int32
    fn = functools.partial(sa.sparse_attend_pallas, softmax_scale=0.1, num_splits=3,
                           tuning=sa.AttendTuning("mosaic"))
    args = (jax.ShapeDtypeStruct((2, 3, 5, 384), f32),
            jax.ShapeDtypeStruct((30, 16, 384), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((2, 12), i32),
            jax.ShapeDtypeStruct((2, 3, 150), i32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2  # the prep, the merge


@pytest.mark.parametrize("splits", [1, 2])
def test_mosaic_prompt_result_is_written_by_the_kernel(splits):
    """A prompt's attend (no padded block) in bf16: with one split the Mosaic kernel writes the
    bf16 result itself and no merge kernel runs (the prep is the program's only Triton call);
    with two splits the partials go through the merge kernel. Lowered for CUDA on any host."""
    f32, i32 = jnp.float32, jnp.int32
    fn = functools.partial(sa.sparse_attend_pallas, softmax_scale=0.1, num_splits=splits,
                           out_dtype=jnp.bfloat16, tuning=sa.AttendTuning("mosaic"))
    args = (jax.ShapeDtypeStruct((2, 3, 64, 512), f32),
            jax.ShapeDtypeStruct((30, 16, 512), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((2, 12), i32),
            jax.ShapeDtypeStruct((2, 3, 150), i32))
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert lowered.out_info.dtype == jnp.bfloat16 and lowered.out_info.shape == (2, 3, 64, 512)
    assert text.count("custom_call @mosaic_gpu") == 1
    triton_calls = text.count("custom_call @__gpu$xla.gpu.triton")
    assert triton_calls == (1 if splits == 1 else 2)  # the prep (+ the merge)


def test_mosaic_partials_check_the_q_scales_shape():
    z = jnp.zeros
    args = (z((2, 64, 512), jnp.float16), z((2, 128), jnp.int32), z((30, 512), jnp.float8_e4m3fn))
    for scales in ((2,), (2, 16)):  # one per head: [N, Hp]
        with pytest.raises(ValueError, match="q scales"):
            mg.sparse_attend_mgpu_partials(jnp.float32(1.0), (z(scales), z(scales)),
                                           z((2,), jnp.int32), *args, softmax_scale=0.1,
                                           splits=1, tiles=2)


def test_head_scales_are_row_scales_of_each_group():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 64, 32)).astype(np.float32)
    q[1, 16:32] *= 1e4
    up, down = (np.asarray(x) for x in mg.head_scales(jnp.asarray(q), 16))
    ref_up, ref_down = (np.asarray(x) for x in mg.row_scales(jnp.asarray(q.reshape(12, 16, 32))))
    assert (up == np.repeat(ref_up.reshape(3, 4), 16, axis=1)).all()
    assert (down == np.repeat(ref_down.reshape(3, 4), 16, axis=1)).all()
    assert up[1, 0] > up[1, 16]  # the large group's scale alone is smaller


def test_mosaic_partials_refuse_a_narrow_dtype_with_splits():
    z = jnp.zeros
    with pytest.raises(ValueError, match="partials to be merged stay float32"):
        mg.sparse_attend_mgpu_partials(
            jnp.float32(1.0), (z((2, 64)), z((2, 64))), z((2,), jnp.int32),
            z((2, 64, 512), jnp.float16),
            z((2, 128), jnp.int32), z((30, 512), jnp.float8_e4m3fn), softmax_scale=0.1,
            splits=2, tiles=1, out_dtype=jnp.bfloat16)


def test_mosaic_decode_rows_lower_for_cuda():
    """A decode's attend (the first of 4 rows per sequence read in place by the prep, the
    padded block written by the merge kernel in bf16) lowers on any host; the 2 splits'
    partials reach the merge as f16."""
    f32, i32 = jnp.float32, jnp.int32

    def fn(q, lat, kv, tables, sel, fill):
        return sa.sparse_attend_pallas(q, lat, kv, tables, sel, softmax_scale=0.1,
                                       num_splits=2, out_dtype=jnp.bfloat16, rows=1, fill=fill,
                                       tuning=sa.AttendTuning("mosaic"))

    args = (jax.ShapeDtypeStruct((2, 4, 64, 512), f32),
            jax.ShapeDtypeStruct((30, 16, 512), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((2, 12), i32),
            jax.ShapeDtypeStruct((2, 4, 150), i32), jax.ShapeDtypeStruct((2, 4), f32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "tensor<2x2x64x512xf16>" in text  # [2 rows, 2 splits, 64, 512]


def test_auto_takes_triton_on_a_gpu_that_is_not_hopper(monkeypatch):
    """The Mosaic GPU kernels compile for sm_90a only: "auto" picks them on a Hopper GPU (or a
    device reporting no compute capability, as the CPU), the Triton kernels elsewhere;
    "mosaic" asked for stays mosaic (its compile then fails loudly)."""
    import types

    import jax

    from dsa_jax.pallas import common
    from dsa_jax.pallas import pool_scores as ps
    fp8 = jnp.float8_e4m3fn
    for cc, want in (("8.0", "triton"), ("10.0", "triton"), ("9.0", "mosaic"), (None, "mosaic")):
        dev = types.SimpleNamespace(compute_capability=cc)
        monkeypatch.setattr(jax, "devices", lambda *a, dev=dev: [dev])
        assert common.gpu_is_not_hopper() == (want == "triton")
        assert sa.pick_backend(sa.AttendTuning(), fp8, 64, 512, False, False) == want
        assert ps.pick_backend(ps.PoolScoresTuning(), 32, 128, False) == want
        assert sa.pick_backend(sa.AttendTuning("mosaic"), fp8, 64, 512, False, False) == "mosaic"


def test_mosaic_slot_staging_refuses_past_shared_memory():
    """The kernel stages a split's slots in shared memory: a split of more tiles than fit is
    refused with the limit named; two splits of the same slots lower."""
    f32, i32 = jnp.float32, jnp.int32
    w = 107 * 64  # 107 tiles in one split: 27,392 B of slots on 205,312 B

    def fn(splits):
        return functools.partial(sa.sparse_attend_pallas, softmax_scale=0.1,
                                 num_splits=splits, tuning=sa.AttendTuning("mosaic"))

    args = (jax.ShapeDtypeStruct((1, 1, 64, 512), f32),
            jax.ShapeDtypeStruct((120, 64, 512), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((1, 120), i32),
            jax.ShapeDtypeStruct((1, 1, w), i32))
    with pytest.raises(ValueError, match="107 tiles per split.*> 232448"):
        jax.jit(fn(1)).trace(*args).lower(lowering_platforms=("cuda",))
    text = jax.jit(fn(2)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


def test_q_abs_bound_bounds_the_absorbed_query():
    """`projection.q_abs_bound` is at least every |a_hc| the U_k GEMM computes: random rows,
    and rows built to reach the bound (q_h along the largest column of U_k[h], where
    Cauchy-Schwarz is tight), bf16 weights (q rounded as the GEMM rounds it) and f32."""
    from dsa_jax import projection
    rng = np.random.default_rng(3)
    for wdt in (jnp.bfloat16, jnp.float32):
        u = jnp.asarray(rng.standard_normal((5, 48, 40)) * 0.3, wdt)  # [H, Dn, C]
        q = rng.standard_normal((7, 5, 48)).astype(np.float32)  # [N, H, Dn]
        u32 = np.asarray(u.astype(jnp.float32))
        best = np.argmax((u32 ** 2).sum(1), axis=-1)  # [H]: the largest column
        q[:3] = np.stack([u32[h, :, best[h]] for h in range(5)]) * np.float32(7.5)
        q = jnp.asarray(q)
        a = np.abs(np.asarray(projection.per_head(q, u, 1)))  # [N, H, C]
        bound = np.asarray(projection.q_abs_bound(q, u))  # [N, H]
        assert (a.max(-1) <= bound).all()
        assert (a[:3].max(-1) >= bound[:3] * (1 - 2.0 ** -8)).all()  # tight where it can be


def test_scaled_q_abs_rounds_q_as_the_amax_scales_do():
    """`projection.scaled_q_abs` (each head's scale from the bound or, the default at these
    shapes, from its own amax) holds q_abs's f16 rounding: q16 * down equals q_abs scaled by
    each head's own amax's power of two and rounded, exactly (power-of-two scaling is exact,
    f16 rounding relative), also for rows far from 1 and a head 2^40 above its row's others;
    every |q16| is at most 2^14 (below it under the bound's margin); the slots of
    `scaled_inputs` are the prep twin's, padded heads zero."""
    rng = np.random.default_rng(4)
    n, h, dn, c = 6, 5, 48, 64
    u = jnp.asarray(rng.standard_normal((h, dn, c)) * 0.2, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((n, h, dn)) * np.float32(3.0))
    q = q.at[1].multiply(2.0 ** -30).at[2, 3].multiply(2.0 ** 40)  # rows far from 1
    for scale in ("bound", "amax", None):
        _check_scaled(q, u, scale, h, c)


def _check_scaled(q, u, scale, h, c):
    from dsa_jax import projection
    from dsa_jax.pallas import scaled_q_abs as sqa
    if scale is None:
        q16, down = projection.scaled_q_abs(q, u)
    else:
        q16, down = sqa.scaled_q_abs_xla(q, u, scale=scale)
    q_abs = projection.per_head(q, u, 1)  # [N, H, C] f32
    _, _, _, tables, sel = T.attend_inputs(5, 2, 3, h, c, 70, 16, 12, "float8_e4m3fn")
    sel, tables = jnp.asarray(sel), jnp.asarray(tables)
    got = sa.scaled_inputs(q16, down, sel, tables, 16, hp=64, wp=80)
    want = sa.mosaic_inputs_jnp(q_abs, sel, tables, 16, hp=64, wp=80, scale_heads=16)
    up1, down1 = mg.head_scales(q_abs, 1)  # each head its own amax's scale: [N, H]
    amax16 = (q_abs * up1[:, :, None]).astype(jnp.float16)
    deq = lambda q16, down: np.asarray(q16.astype(jnp.float32)) * np.asarray(down)[:, :, None]
    np.testing.assert_array_equal(deq(got[0][:, :h], got[2][:, :h]), deq(amax16, down1))
    assert not np.asarray(got[0][:, h:]).any()
    top = np.abs(np.asarray(q16, np.float32)).max(-1)
    assert (top < 2.0 ** 14).all() if scale == "bound" else (top <= 2.0 ** 14).all()
    np.testing.assert_array_equal(np.asarray(got[1] * got[2]), 1.0)
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))
    np.testing.assert_array_equal(np.asarray(got[4]), np.asarray(want[4]))


def test_bound_scales_lower_for_cuda_without_the_prep():
    """A prompt's attend given q_scaled lowers with no Triton prep and no merge (one split);
    without it the prep runs."""
    f32, i32 = jnp.float32, jnp.int32
    args = (jax.ShapeDtypeStruct((1, 40, 5, 512), f32),
            jax.ShapeDtypeStruct((30, 16, 512), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((1, 12), i32),
            jax.ShapeDtypeStruct((1, 40, 150), i32),
            jax.ShapeDtypeStruct((1, 40, 5, 512), jnp.float16),
            jax.ShapeDtypeStruct((1, 40, 5), f32))
    for hint in (True, False):
        def fn(q, lat, kv, tables, sel, q16, down, hint=hint):
            return sa.sparse_attend_pallas(q, lat, kv, tables, sel, softmax_scale=0.1,
                                           num_splits=1, out_dtype=jnp.bfloat16,
                                           q_scaled=(q16, down) if hint else None,
                                           tuning=sa.AttendTuning("mosaic"))
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1
        assert ("custom_call @__gpu$xla.gpu.triton" in text) == (not hint)


def test_prompt_rows_carry_the_scaled_q_only_where_the_attend_reads_it(monkeypatch):
    """`sparse_attend.takes_scaled_q`: only where the tuning picks the Mosaic kernel (fp8
    cache, 64 heads, compiled: never in interpret mode). `Projections
    .q_scaled` follows it: None for a decode's rows (<= max_verify) and for "xla"; with the
    gate open, a prompt's rows carry `scaled_q_abs`."""
    import os

    from dsa_jax import config, projection
    from dsa_jax import weights as W
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    assert sa.takes_scaled_q(fp8, 64, 512, False)
    assert not sa.takes_scaled_q(fp8, 64, 512, True)  # interpret: the Triton kernel
    assert not sa.takes_scaled_q(jnp.dtype(jnp.bfloat16), 64, 512, False)
    assert not sa.takes_scaled_q(fp8, 8, 512, False)  # 8 heads: the Triton kernel
    assert not sa.takes_scaled_q(fp8, 64, 512, False, sa.AttendTuning("triton"))
    path = os.path.join(os.path.dirname(__file__), "..", "dsa_jax", "configs", "tiny.json")
    cfg = config.DsaConfig.from_json(path, implementation="pallas-interpret")
    w = W.fold_weights(cfg, T.random_hf_numpy(cfg, np.random.default_rng(0)))
    prompt = jnp.asarray(np.random.default_rng(1).standard_normal((2, 9, cfg.hidden_size)),
                         jnp.float32)
    assert projection.project(cfg, w, prompt).q_scaled is None  # interpret mode
    seen = []
    monkeypatch.setattr(projection, "takes_scaled_q", lambda *a: seen.append(a) or True)
    got = projection.project(cfg, w, prompt).q_scaled
    assert seen[-1] == (jnp.dtype(cfg.cache_dtype), cfg.local_heads, cfg.kv_lora_rank, True)
    assert got is not None and got[0].dtype == jnp.float16
    assert got[1].shape == (2, 9, cfg.local_heads) and (np.asarray(got[1]) > 0).all()
    assert projection.project(cfg, w, prompt[:, :cfg.max_verify]).q_scaled is None
    assert projection.project(cfg.replace(implementation="xla"), w, prompt).q_scaled is None
    # bf16 weights: the q_b GEMM writes bf16 q, whose scaled q is that of the f32 q rounded
    cfg16 = cfg.replace(param_dtype="bfloat16")
    w16 = W.fold_weights(cfg16, T.random_hf_numpy(cfg16, np.random.default_rng(0)))
    got = projection.project(cfg16, w16, prompt).q_scaled
    monkeypatch.setattr(projection, "takes_scaled_q", lambda *a: False)
    q_resid = projection.norm(cfg16, projection.matmul(prompt, w16.x_proj), w16.q_a_norm,
                              cfg16.rms_norm_eps, cols=projection.x_columns(cfg16)["q_a"],
                              dtype=jnp.bfloat16)
    q = projection.matmul(q_resid, w16.q_proj).reshape(2, 9, cfg.local_heads, -1)  # f32
    want = projection.scaled_q_abs(q, w16.u_k, cfg16)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
