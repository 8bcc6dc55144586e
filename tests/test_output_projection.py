"""A prompt's output projection: the U_v product by the per-head Pallas kernel writing bf16
(`projection.prompt_u_v_kernel`), against the definition and against the same kernel's f32
result; where that path is taken and where not."""

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from dsa_jax import fp8, projection, shapes
from dsa_jax import testing as T
from dsa_jax import weights as W
from dsa_jax.pallas import matmul as mm

EPS32 = np.finfo(np.float32).eps


def _block(param_dtype="bfloat16", **kw):
    cfg = shapes.tiny(implementation="pallas-interpret", param_dtype=param_dtype, **kw)
    return cfg, W.fold_weights(cfg, T.random_hf_numpy(cfg, np.random.default_rng(0)))


def _latents(cfg, rows, seed=1):
    shape = (2, rows, cfg.local_heads, cfg.kv_lora_rank)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                       jnp.bfloat16)  # [B, R, Hl, C]: the attend's bf16 result


def test_the_kernel_runs_for_a_prompts_rows_only():
    cfg, w = _block()
    lead_prompt, lead_decode = (2, cfg.max_verify + 3), (2, cfg.max_verify)
    assert projection.prompt_u_v_kernel(cfg, lead_prompt, w.u_v, w.o_proj)
    assert not projection.prompt_u_v_kernel(cfg, lead_decode, w.u_v, w.o_proj)
    assert not projection.prompt_u_v_kernel(cfg.replace(gemm="xla"), lead_prompt, w.u_v,
                                            w.o_proj)
    assert not projection.prompt_u_v_kernel(cfg.replace(implementation="xla"), lead_prompt,
                                            w.u_v, w.o_proj)
    cfg32, w32 = _block("float32")
    assert not projection.prompt_u_v_kernel(cfg32, lead_prompt, w32.u_v, w32.o_proj)
    o = _latents(cfg, 9)
    text = str(jax.make_jaxpr(lambda o: projection.output_projection(w, o, cfg))(o))
    assert text.count("pallas_call") == 1 and "name=matmul" in text.replace("'", "")
    text = str(jax.make_jaxpr(lambda o: projection.output_projection(
        w, o, cfg.replace(gemm="xla")))(o))
    assert "pallas_call" not in text


def test_a_prompts_output_is_the_kernels_bf16_product_through_o_proj():
    """y = o_proj of the kernel's U_v product rounded to bf16, which is the kernel's f32
    product rounded (test_matmul_kernel), within the fp32 accumulation bound of the exact
    product of the operands; the definition's y (XLA's U_v GEMM) is as close."""
    cfg, w = _block()
    o = _latents(cfg, 9)  # [2, 9, Hl, C]
    y = np.asarray(projection.output_projection(w, o, cfg))  # [2, 9, D]
    uv = mm.per_head_pallas(o, w.u_v, 2, interpret=True).astype(jnp.bfloat16)
    want = projection.matmul(uv.reshape(2, 9, -1), w.o_proj)
    np.testing.assert_array_equal(y, np.asarray(want))
    # The U_v product against the exact one: fp32 accumulation over C, then bf16's rounding.
    o64, uv64 = np.asarray(o, np.float64), np.asarray(w.u_v, np.float64)
    exact = np.einsum("brhk,hnk->brhn", o64, uv64)
    mag = np.einsum("brhk,hnk->brhn", np.abs(o64), np.abs(uv64))
    bound = cfg.kv_lora_rank * EPS32 * mag + 2.0 ** -8 * (np.abs(exact) + 1e-30)
    assert (np.abs(np.asarray(uv, np.float64) - exact) <= bound).all()
    # The definition's y: its bf16 U_v product is within the same bound of the exact one, so
    # the two y differ by at most o_proj's reach over twice that bound plus both o_proj
    # GEMMs' fp32 accumulation bounds.
    ref = np.asarray(projection.output_projection(w, o, None))
    wo = np.abs(np.asarray(w.o_proj, np.float64))  # [D, Hl*Dv]
    reach = (2 * bound).reshape(2, 9, -1) @ wo.T
    n_in = wo.shape[1]
    acc = 2 * n_in * EPS32 * (np.abs(np.asarray(uv, np.float64)).reshape(2, 9, -1) @ wo.T)
    assert (np.abs(y - ref) <= reach + acc).all()
    assert not np.array_equal(y, np.zeros_like(y))


def test_a_decodes_rows_keep_the_row_invariant_product():
    """At max_verify rows or fewer the U_v product is `per_head`'s (the row-invariant kernel
    under row_gemms, f32): a decode's bits do not move with this path."""
    cfg, w = _block()
    o = _latents(cfg, cfg.max_verify)
    y = projection.output_projection(w, o, cfg)
    uv = projection.per_head(o, w.u_v, 2, cfg)
    assert uv.dtype == jnp.float32
    want = projection.matmul(uv.reshape(2, cfg.max_verify, -1), w.o_proj, cfg)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_a_stacked_u_v_is_read_in_place_with_the_slices_bits():
    """The model's scan holds U_v as a `LayerOf` (the stack read in place by the kernel at the
    layer's index): a prompt's y equals that of the layer's own weight, bit for bit."""
    from dsa_jax.stacked import LayerOf
    cfg, w = _block()
    other = jnp.asarray(np.random.default_rng(7).standard_normal(w.u_v.shape) * 0.05,
                        w.u_v.dtype)
    stack = jnp.stack([other, w.u_v, other])  # [3, Hl, Dv, C]: this layer at index 1
    o = _latents(cfg, 9)
    want = np.asarray(projection.output_projection(w, o, cfg))
    w_in_place = w._replace(u_v=LayerOf(stack, jnp.int32(1), stack[1]))
    got = np.asarray(projection.output_projection(w_in_place, o, cfg))
    np.testing.assert_array_equal(got, want)


def _pallas_operand_dtypes(jaxpr) -> list[list[str]]:
    """Per pallas_call of `jaxpr` (nested jaxprs too): its operands' dtypes."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            out.append([v.aval.dtype.name for v in e.invars])
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                out += _pallas_operand_dtypes(inner)
    return out


def test_a_prompts_fp8_u_v_is_dequantized_once_before_the_kernel():
    """fp8 weights: a prompt's U_v kernel reads this layer's U_v dequantized to bf16 once,
    before it (`projection.prompt_operand`), not the fp8 blocks that each tile of the
    prompt's rows would dequantize again; y `==` the block's on the same checkpoint
    dequantized at load."""
    cfg = shapes.tiny(implementation="pallas-interpret", param_dtype="float8_e4m3fn",
                      weight_block=(32, 32))
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(0))
    w8 = W.fold_weights(cfg, hf)
    cfg16 = cfg.replace(param_dtype="bfloat16")
    w16 = W.fold_weights(cfg16, hf)
    assert isinstance(w8.u_v, fp8.Fp8Block)
    o = _latents(cfg, cfg.max_verify + 5)  # [2, R, Hl, C]
    assert projection.prompt_u_v_kernel(cfg, o.shape[:2], w8.u_v, w8.o_proj)
    calls = _pallas_operand_dtypes(jax.make_jaxpr(
        lambda o: projection.output_projection(w8, o, cfg))(o).jaxpr)
    assert len(calls) == 1 and "float8_e4m3fn" not in calls[0], calls
    np.testing.assert_array_equal(np.asarray(projection.output_projection(w8, o, cfg)),
                                  np.asarray(projection.output_projection(w16, o, cfg16)))


def test_a_stacked_fp8_weight_of_a_prompt_is_its_own_layer_dequantized():
    """`projection.prompt_operand` under the model's scan (a `LayerOf` over an fp8 stack):
    this layer's weight dequantized, no index (not the whole stack, not another layer's);
    a bf16 stack stays read in place at its index. A prompt's y and scaled U_k product over
    the fp8 stack `==` those over this layer's bf16 weight."""
    from dsa_jax.stacked import LayerOf
    cfg = shapes.tiny(implementation="pallas-interpret", param_dtype="float8_e4m3fn",
                      weight_block=(32, 32))
    w8 = W.fold_weights(cfg, dsa_jax.init_random_hf_tensors(cfg, jax.random.key(0)))
    other = W.fold_weights(cfg, dsa_jax.init_random_hf_tensors(cfg, jax.random.key(1)))

    def stacked(name):  # this layer at index 1 of [other, this, other]
        ws = [getattr(other, name), getattr(w8, name), getattr(other, name)]
        stack = fp8.Fp8Block(jnp.stack([x.values for x in ws]),
                             jnp.stack([x.scale for x in ws]), ws[1].block)
        return LayerOf(stack, jnp.int32(1), fp8.Fp8Block(stack.values[1], stack.scale[1],
                                                          stack.block))

    u_v, u_k = stacked("u_v"), stacked("u_k")
    got, at = projection.prompt_operand(cfg, u_v)
    assert at is None and got.shape == w8.u_v.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w8.u_v.dequantize()))
    bf16 = LayerOf(jnp.stack([w8.u_v.dequantize()] * 2), jnp.int32(1), w8.u_v.dequantize())
    assert projection.prompt_operand(cfg, bf16)[0] is bf16.stack
    o = _latents(cfg, cfg.max_verify + 5)  # [2, R, Hl, C]
    dense = w8._replace(u_v=w8.u_v.dequantize(), o_proj=w8.o_proj.dequantize())
    np.testing.assert_array_equal(
        np.asarray(projection.output_projection(w8._replace(u_v=u_v), o, cfg)),
        np.asarray(projection.output_projection(dense, o, cfg)))
    q = jax.random.normal(jax.random.key(2), (2, 9, cfg.local_heads, cfg.qk_nope_head_dim))
    for a, b in zip(projection.scaled_q_abs(q, u_k, cfg),
                    projection.scaled_q_abs(q, w8.u_k.dequantize(), cfg), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
