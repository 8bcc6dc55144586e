"""The paged XLA path (prefill + decode) against the dense fp32 reference, every cache dtype."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import reference
from dsa_jax import testing as T
from dsa_jax.shapes import ODD
from dsa_jax.state import dequantize_latent, index_storage, quantize_latent

FP32_RTOL = 2e-5  # fp32 everywhere, reductions of <= a few hundred terms


def _run_paged(cfg, weights, x, prompt_len, kv_scale=1.0):
    """Prefill `prompt_len` rows, then decode the rest one token at a time, through shuffled
    block tables."""
    state = dsa_jax.init_state(cfg, x.shape[0], kv_scale=kv_scale,
                               block_tables=T.permuted_block_tables(cfg, x.shape[0], 7))
    return T.prefill_then_decode(cfg, weights, state, x, prompt_len)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("kpool", [pytest.param(1, marks=pytest.mark.long), 4])
def test_fp32_cache_matches_reference(tail, kpool):
    cfg = ODD.replace(index_kpool=kpool, always_select_tail=tail)
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(1))
    weights = dsa_jax.fold_weights(cfg, hf)
    x = T.random_rows(2, 2, 71, cfg.hidden_size)
    y, sel, state = _run_paged(cfg, weights, x, prompt_len=45)
    assert np.asarray(state.lengths).tolist() == [71, 71]
    for b in range(2):
        ref = reference.forward(cfg, hf, x[b])
        chex.assert_trees_all_equal(sel[b], ref.sel)
        for t in range(71):
            T.assert_rel_close(y[b, t], ref.y[t], FP32_RTOL, f"row ({b}, {t})")


def test_selection_bites_and_rows_without_pools_give_zero():
    """Tail off: rows before the first complete pool select nothing and output exactly 0."""
    cfg = ODD.replace(always_select_tail=False)
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(3))
    weights = dsa_jax.fold_weights(cfg, hf)
    x = T.random_rows(4, 1, 40, cfg.hidden_size)
    y, sel, _ = _run_paged(cfg, weights, x, prompt_len=40)
    kp = cfg.index_kpool
    assert (np.asarray(y[0, :kp - 1]) == 0).all()
    assert (np.asarray(sel[0, :kp - 1]) == -1).all()
    # Past topk tokens the selection is capped at select_k pools.
    n_valid = (np.asarray(sel[0]) >= 0).sum(-1)
    assert n_valid[-1] == cfg.index_topk < 40


def _stored_latents(cfg, state, b: int, s: int) -> jax.Array:
    """Sequence b's first s cached latents `[s, C]` f32, in position order (its block table)."""
    t = np.arange(s)
    rows = np.asarray(state.block_tables)[b, t // cfg.block_size] * cfg.block_size
    flat = state.latent.reshape(-1, state.latent.shape[-1])
    return dequantize_latent(cfg, flat[rows + t % cfg.block_size], state.kv_scale)


def test_bf16_cache_matches_reference_on_stored_values():
    """A bf16 latent cache equals the reference run on the latents it stored. The paged path's
    fp32 latent and the reference's differ in their last bits (another summation order), so
    their bf16 roundings may be one bf16 step apart where a value sits at a rounding boundary
    (on one CPU sequence 1's row 2 did, 2e-4 off in y): the stored values are each within one
    step of the reference's rounded latent, and the reference reads the stored ones."""
    cfg = ODD.replace(cache_dtype="bfloat16")
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(5))
    weights = dsa_jax.fold_weights(cfg, hf)
    x = T.random_rows(6, 2, 50, cfg.hidden_size)
    y, sel, state = _run_paged(cfg, weights, x, prompt_len=30)
    for b in range(2):
        stored = _stored_latents(cfg, state, b, x.shape[1])  # [S, C]
        own = {}

        def rounded(c, own=own):
            own["c"] = c.astype(jnp.bfloat16).astype(jnp.float32)
            return c

        reference.forward(cfg, hf, x[b], latent_roundtrip=rounded)
        step = 2.0 ** -7 * np.abs(np.asarray(own["c"]))  # one bf16 step, at most
        gap = np.abs(np.asarray(stored) - np.asarray(own["c"]))
        assert (gap <= step).all() and (gap == 0).mean() > 0.99
        ref = reference.forward(cfg, hf, x[b], latent_roundtrip=lambda c, v=stored: v)
        chex.assert_trees_all_equal(sel[b], ref.sel)
        T.assert_rel_close(y[b], ref.y, FP32_RTOL, f"sequence {b}")


def _fp8_bound(cfg, hf, x, kv_scale):
    """A rigorous bound on |y_fp8 - y_exact| per row, from the data (elementwise, max norm).

    e4m3 keeps 3 mantissa bits: a normal value is stored with relative error <= u = 2^-4 and a
    subnormal (|c/s| < 2^-6, spaced 2^-9) with absolute error <= 2^-10 * s, so
    |dc| <= u*|c| + 2^-10*s. Scores move by |ds_j| <= scale * sum_c |a_c| |dc_c| =: delta; a softmax
    whose logits move by at most delta changes p by ||dp||_1 <= exp(2*delta) - 1. The latent
    sum then moves by <= max|dc| + (exp(2 delta) - 1) * max|c|, and y by at most that times
    the max row sum of |W_o U_v| (the output map from the attended latent).
    """
    w = {k: jnp.asarray(v, jnp.float32) for k, v in hf.items()}
    H, C, Dn, Dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    u, s = T.unit_roundoff(jnp.float8_e4m3fn), kv_scale
    q_resid = reference.rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"],
                                 cfg.rms_norm_eps)
    q = (q_resid @ w["q_b_proj.weight"].T).reshape(-1, H, Dn)
    kv_b = w["kv_b_proj.weight"].reshape(H, Dn + Dv, C)
    a = jnp.einsum("thd,hdc->thc", q, kv_b[:, :Dn])  # [S, H, C]
    c = reference.rms_norm((x @ w["kv_a_proj_with_mqa.weight"].T)[:, :C],
                           w["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    dc = u * jnp.abs(c) + 2.0 ** -10 * s  # [S, C]
    delta = Dn ** -0.5 * jnp.max(jnp.einsum("thc,jc->thj", jnp.abs(a), dc), axis=(1, 2))
    # Output map per head: y = W_o[:, h] U_v[h] o_lat[h]; bound by max row abs-sum.
    wo = w["o_proj.weight"].reshape(-1, H, Dv)
    out_map = jnp.einsum("dhv,hvc->dhc", wo, kv_b[:, Dn:])  # [D, H, C]
    gain = jnp.max(jnp.sum(jnp.abs(out_map), axis=(1, 2)))
    cmax, dcmax = jnp.max(jnp.abs(c)), jnp.max(dc)
    return gain * (dcmax + (jnp.exp(2 * delta) - 1) * cmax)  # [S]


def test_fp8_cache_exact_on_stored_values_and_within_derived_bound():
    cfg = ODD.replace(cache_dtype="float8_e4m3fn")
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(8))
    weights = dsa_jax.fold_weights(cfg, hf)
    x = T.random_rows(9, 2, 50, cfg.hidden_size)
    kv_scale = 0.05  # latents reach ~|4|: stored values land near the top of e4m3's range
    y, sel, state = _run_paged(cfg, weights, x, prompt_len=30, kv_scale=kv_scale)
    assert state.latent.dtype == jnp.float8_e4m3fn
    scale = jnp.asarray(kv_scale, jnp.float32)
    roundtrip = lambda c: dequantize_latent(cfg, quantize_latent(cfg, c, scale), scale)
    for b in range(2):
        stored = reference.forward(cfg, hf, x[b], latent_roundtrip=roundtrip)
        chex.assert_trees_all_equal(sel[b], stored.sel)
        T.assert_rel_close(y[b], stored.y, FP32_RTOL, f"sequence {b}")
        exact = reference.forward(cfg, hf, x[b])
        bound = _fp8_bound(cfg, hf, x[b], kv_scale)
        err = jnp.max(jnp.abs(y[b] - exact.y), axis=-1)
        assert bool(jnp.all(err <= bound)), (err, bound)
        assert float(jnp.max(err)) > 0  # the cache really quantized


def test_fp8_write_clips_to_e4m3_range():
    cfg = ODD.replace(cache_dtype="float8_e4m3fn")
    c = jnp.asarray([[1e6, -1e6, 3.0]], jnp.float32)
    stored = quantize_latent(cfg, c, jnp.asarray(0.5, jnp.float32))
    np.testing.assert_array_equal(np.asarray(stored.astype(jnp.float32)), [[448, -448, 6]])


def test_bf16_weights_match_reference_within_bf16_rounding():
    """bf16 weights (the GLM default): the reference on the same bf16-rounded weights, within
    the activations' own bf16 roundings. Five sit on the path (x, q_resid, q, o_latent, o),
    each <= u = 2^-8 relative (bf16 keeps 8 significant bits), so the normwise error stays
    under 5 u to first order."""
    from dsa_jax.hf_oracle import boundary_gaps

    cfg = ODD.replace(param_dtype="bfloat16")
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(12))
    hf16 = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32))
            for k, v in hf.items()}
    weights = dsa_jax.fold_weights(cfg, hf)
    assert weights.x_proj.dtype == jnp.bfloat16
    x = T.random_rows(13, 2, 60, cfg.hidden_size)
    y, sel, _ = _run_paged(cfg, weights, x, prompt_len=40)
    for b in range(2):
        ref = reference.forward(cfg, hf16, x[b])
        T.assert_rel_close(y[b], ref.y, 5 * T.unit_roundoff(jnp.bfloat16), f"sequence {b}")
        # Sets (slot order follows scores, which bf16 may reorder) on rows without a near-tie
        # at the top-k boundary.
        clear = boundary_gaps(np.asarray(ref.pool_scores), cfg.select_k) > 0.05
        assert clear.mean() > 0.5
        for t in np.flatnonzero(clear):
            assert set(np.asarray(sel[b, t]).tolist()) == set(np.asarray(ref.sel[t]).tolist())


def test_reference_states_its_input_contract():
    cfg = ODD
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(1))
    with pytest.raises(AssertionError, match=r"\(5, 7\) but expected \(None, 80\)"):
        reference.forward(cfg, hf, jnp.ones((5, 7)))
    with pytest.raises(AssertionError, match=r"\(5, 14\) but expected \(5, 15\)"):
        reference.forward(cfg, hf, jnp.ones((5, 80)), shared_sel=jnp.zeros((5, 14), jnp.int32))


def _bf16_index_case(roundtrip_of):
    """The tiny shipped config (bf16 index cache), as the notebook runs it: the paged path
    against the jitted reference given `roundtrip_of(cfg)` as the index storage -> (rows
    compared, rows whose sets differ)."""
    from dsa_jax.hf_oracle import boundary_gaps
    from dsa_jax.shapes import tiny

    cfg = tiny()
    assert cfg.index_cache_dtype == "bfloat16"
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(0))
    weights = dsa_jax.fold_weights(cfg, hf)
    x = jax.random.normal(jax.random.key(1), (1, 160, cfg.hidden_size))
    _, sel, _ = T.prefill_then_decode(cfg, weights, dsa_jax.init_state(cfg, 1), x, 144)
    ref = jax.jit(lambda x: reference.forward(cfg, hf, x, index_roundtrip=roundtrip_of(cfg)))(
        x[0])
    # Rows clear of a near-tie at the top-k boundary: a pool key the two paths summed in
    # another order could round to the neighbouring bf16 value (2^-8 of one channel).
    clear = boundary_gaps(np.asarray(ref.pool_scores), cfg.select_k) > 1e-4
    rows = np.flatnonzero(clear)
    differ = sum(set(np.asarray(sel[0, t]).tolist()) != set(np.asarray(ref.sel[t]).tolist())
                 for t in rows)
    return len(rows), differ


def test_bf16_index_cache_matches_reference_on_the_stored_values():
    """The reference given `state.index_storage` rounds its k, gate and pool keys as the state
    stores them, inside jit too (`lax.reduce_precision`): the paged path's sets on every row
    clear of a near-tie. With `v.astype(bf16).astype(f32)` instead, XLA kept this program's
    pool keys at fp32 (excess precision) and 2 of these rows selected other pools."""
    compared, differ = _bf16_index_case(index_storage)
    assert compared > 50 and differ == 0, (compared, differ)


def test_index_storage_rounds_as_a_bf16_store_does_inside_jit():
    """`state.index_storage`: inside jit, after arithmetic XLA could fuse with the rounding,
    each value is the bf16 value a store keeps (round to nearest even, ties included; XLA
    flushes subnormals either way); fp32
    passes through; other dtypes are refused by name."""
    from dsa_jax.pallas.common import round_to

    rng = np.random.default_rng(5)
    v = rng.standard_normal(4096).astype(np.float32) * 3
    v[:4] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1e30]  # ties to even, a large one
    want = np.asarray(jnp.asarray(v * 2).astype(jnp.bfloat16).astype(jnp.float32)) / 2
    got = jax.jit(lambda a: index_storage(ODD.replace(index_cache_dtype="bfloat16"))(a * 2) / 2)(v)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(index_storage(ODD)(v)), v)  # fp32 index cache
    with pytest.raises(ValueError, match="float8_e4m3fn is not bfloat16"):
        round_to(jnp.asarray(v), jnp.float8_e4m3fn)


def test_reference_as_stored_is_the_one_call_comparison():
    """`reference.forward(..., as_stored=state)`: the reference on the values a state of the
    config stores (fp8 latent with the state's scale, bf16 index keys), the comparison the
    README shows: selections equal, outputs within fp32 rounding. Unrounded, the reference
    differs by the fp8 storage error (larger than fp32 rounding by orders of magnitude)."""
    cfg = ODD.replace(cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16")
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(11))
    weights = dsa_jax.fold_weights(cfg, hf)
    x = T.random_rows(12, 2, 40, cfg.hidden_size)
    y, sel, state = _run_paged(cfg, weights, x, prompt_len=25, kv_scale=0.05)
    for b in range(2):
        for stored in (state, state.kv_scale, 0.05):
            ref = reference.forward(cfg, hf, x[b], as_stored=stored)
            chex.assert_trees_all_equal(sel[b], ref.sel)
            T.assert_rel_close(y[b], ref.y, FP32_RTOL, f"sequence {b}")
        assert T.rel_err(y[b], reference.forward(cfg, hf, x[b]).y) > 100 * FP32_RTOL
    with pytest.raises(ValueError, match="as_stored sets both round trips"):
        reference.forward(cfg, hf, x[0], as_stored=state, index_roundtrip=lambda v: v)
