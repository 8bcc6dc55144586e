"""The NNX module: bit-identical to the functional API, eagerly and under `nnx.jit`; caches
update in place; reset, shared layers, checks, and a checkpoint round trip through the module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsa_jax
from dsa_jax import StepError, checkpoint
from dsa_jax.nnx import DsaAttention, DsaCache
from dsa_jax.shapes import ODD
from dsa_jax.testing import assert_trees_bitwise_equal, permuted_block_tables, random_rows

CFG = ODD.replace(cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16")
B = 2


def _tables():
    return permuted_block_tables(CFG, B, 5)


@pytest.fixture(scope="module")
def weights():
    return dsa_jax.init_random_weights(CFG, jax.random.key(1))


# One script of steps: ragged prefill, decodes, a 3-row verify, a rewind, an inactive row.
PREFILL = random_rows(2, B, 29, CFG.hidden_size)
DECODES = [random_rows(10 + t, B, CFG.hidden_size) for t in range(3)]
VERIFY = random_rows(20, B, 3, CFG.hidden_size)
LAST = random_rows(30, B, CFG.hidden_size)


def _functional(weights, cfg=CFG):
    state = dsa_jax.init_state(cfg, B, kv_scale=0.1, block_tables=_tables())
    outs = []
    y, state, sel = dsa_jax.prefill(cfg, weights, state, PREFILL, num_tokens=[29, 17])
    outs.append((y, sel))
    for x in DECODES:
        y, state, sel = dsa_jax.decode(cfg, weights, state, x)
        outs.append((y, sel))
    y, state, sel = dsa_jax.decode_k(cfg, weights, state, VERIFY)
    outs.append((y, sel))
    state = dsa_jax.rewind(cfg, state, [31, 21])
    y, state, sel = dsa_jax.decode(cfg, weights, state, LAST, active=[True, False])
    outs.append((y, sel))
    return outs, state


def _module(model, prefill, decode, decode_k, rewind):
    outs = [prefill(model, PREFILL, np.asarray([29, 17]))]
    outs += [decode(model, x, None) for x in DECODES]
    outs.append(decode_k(model, VERIFY))
    rewind(model, np.asarray([31, 21]))
    outs.append(decode(model, LAST, np.asarray([True, False])))
    return outs, model.state


@pytest.fixture(scope="module")
def functional(weights):
    return _functional(weights)


def test_eager_steps_bit_identical_to_functional(weights, functional):
    want, want_state = functional
    model = DsaAttention.from_weights(CFG, weights, B, kv_scale=0.1, block_tables=_tables())
    got, got_state = _module(
        model,
        lambda m, x, n: m.prefill(x, num_tokens=n),
        lambda m, x, a: m.decode(x, active=a),
        lambda m, x: m.decode_k(x),
        lambda m, n: m.rewind(n))
    assert_trees_bitwise_equal(got, want)
    assert_trees_bitwise_equal(got_state, want_state)
    assert got_state.latent.dtype == jnp.float8_e4m3fn
    assert np.asarray(model.lengths.get_value()).tolist() == [32, 21]


@nnx.jit
def _prefill(m, x, n):
    return m.prefill(x, num_tokens=n)


@nnx.jit
def _decode(m, x, a):
    return m.decode(x, active=a)


@nnx.jit
def _decode_k(m, x):
    return m.decode_k(x)


@nnx.jit
def _rewind(m, n):
    m.rewind(n)


def test_nnx_jit_steps_bit_identical_to_functional(weights, functional):
    want, want_state = functional
    model = DsaAttention.from_weights(CFG, weights, B, kv_scale=0.1, block_tables=_tables())
    got, got_state = _module(model, _prefill, _decode, _decode_k, _rewind)
    assert_trees_bitwise_equal(got, want)
    assert_trees_bitwise_equal(got_state, want_state)


def test_fp8_weights_in_the_module_give_the_bits_of_their_bf16_weights():
    """fp8 weights (`param_dtype="float8_e4m3fn"`) as the module's params, kept as blocks,
    under `nnx.jit`: every output and the state `==` the functional API on the same
    checkpoint dequantized to bf16 at load."""
    from dsa_jax import fp8

    c8 = CFG.replace(param_dtype="float8_e4m3fn", weight_block=(4, 8))
    c16 = c8.replace(param_dtype="bfloat16")
    hf = dsa_jax.init_random_hf_tensors(c8, jax.random.key(4))
    want, want_state = _functional(dsa_jax.fold_weights(c16, hf), c16)
    model = DsaAttention.from_weights(c8, dsa_jax.fold_weights(c8, hf), B, kv_scale=0.1,
                                      block_tables=_tables())
    assert isinstance(model.o_proj.get_value(), fp8.Fp8Block)
    got, got_state = _module(model, _prefill, _decode, _decode_k, _rewind)
    assert_trees_bitwise_equal(got, want)
    assert_trees_bitwise_equal(got_state, want_state)


def test_random_init_variables_reset_and_checks():
    model = DsaAttention(CFG, rngs=nnx.Rngs(params=3), num_seqs=B)
    assert_trees_bitwise_equal(model.weights,
                               dsa_jax.init_random_weights(CFG, nnx.Rngs(params=3).params()))
    params = nnx.state(model, nnx.Param)
    caches = nnx.state(model, DsaCache)
    assert len(jax.tree_util.tree_leaves(params)) == len(dsa_jax.DsaWeights._fields)
    assert len(jax.tree_util.tree_leaves(caches)) == len(dsa_jax.DsaState._fields)
    assert isinstance(model.latent, nnx.Cache)

    x = random_rows(40, B, 29, CFG.hidden_size)  # the prefill shape above: compiled once
    y0, sel0 = model.prefill(x)
    y1, _ = model.decode(random_rows(41, B, CFG.hidden_size))
    assert np.asarray(model.lengths.get_value()).tolist() == [30, 30]
    assert float(jnp.max(jnp.abs(y1))) > 0
    # reset: the next prefill is exactly a fresh module's.
    model.reset()
    assert np.asarray(model.lengths.get_value()).tolist() == [0, 0]
    y2, sel2 = model.prefill(x)
    assert_trees_bitwise_equal((y2, sel2), (y0, sel0))
    # Eager calls check before writing: past max_context is a StepError, the cache unchanged.
    before = model.state
    with pytest.raises(StepError, match="past max_context 96"):
        model.prefill(random_rows(42, B, 80, CFG.hidden_size))
    assert_trees_bitwise_equal(model.state, before)
    with pytest.raises(StepError, match="does not fit max_verify"):
        model.decode_k(random_rows(43, B, 5, CFG.hidden_size))


def test_shared_layer_and_checkpoint_through_module(weights, tmp_path):
    shared_w = dsa_jax.init_random_weights(CFG, jax.random.key(6), has_indexer=False)
    full = DsaAttention.from_weights(CFG, weights, B)
    shared = DsaAttention.from_weights(CFG, shared_w, B)
    assert full.has_indexer and not shared.has_indexer and shared.ape is None
    x = random_rows(50, B, 29, CFG.hidden_size)
    y0, sel = full.prefill(x)
    y1, sel1 = shared.prefill(y0, shared_sel=sel)
    assert_trees_bitwise_equal(sel1, sel)
    # Functional reference of the shared layer.
    ref_y, _, _ = dsa_jax.prefill(CFG, shared_w, dsa_jax.init_state(CFG, B, has_indexer=False),
                                  y0, shared_sel=sel)
    assert_trees_bitwise_equal(y1, ref_y)

    # Save both modules' caches, restore into fresh modules, decode both pairs equally.
    checkpoint.save_state(tmp_path / "prefix", CFG, [full.state, shared.state])
    states, _ = checkpoint.restore_state(tmp_path / "prefix", CFG)
    full2 = DsaAttention.from_weights(CFG, weights, B)
    shared2 = DsaAttention.from_weights(CFG, shared_w, B)
    full2.set_state(states[0])
    shared2.set_state(states[1])
    for t in range(2):
        xt = random_rows(60 + t, B, CFG.hidden_size)
        a0, s_a = full.decode(xt)
        a1, _ = shared.decode(a0, shared_sel=s_a)
        b0, s_b = full2.decode(xt)
        b1, _ = shared2.decode(b0, shared_sel=s_b)
        assert_trees_bitwise_equal((a1, s_a), (b1, s_b))
    assert_trees_bitwise_equal([full2.state, shared2.state], [full.state, shared.state])
