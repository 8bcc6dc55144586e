"""The serving paths: K-row verify, chunked prefill, ragged decode, rewind, drafter rows,
compile-once decode, and their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import StepError, layer
from dsa_jax.shapes import ODD

CACHE_DTYPES = ["float32", "bfloat16", "float8_e4m3fn"]


def _layer(cfg, seed=0):
    return dsa_jax.init_random_weights(cfg, jax.random.key(seed))


def _x(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


def _eq(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _copy(state):
    """A second, independent state (the steps donate theirs)."""
    return jax.tree_util.tree_map(jnp.copy, state)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_decode_k_is_bit_identical_to_serial_decodes(cache_dtype):
    cfg = ODD.replace(cache_dtype=cache_dtype, index_cache_dtype="bfloat16")
    weights = _layer(cfg)
    b = 2
    # Prompt lengths straddle pool boundaries (KP = 4): 13 -> rows 13..16 cross 15|16.
    for prompt in (13, 14, 15, 16):
        _, base, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, b, kv_scale=0.1),
                                     _x(prompt, b, prompt, cfg.hidden_size))
        for k in (1, 2, 3, 4):
            rows = _x(100 + k, b, k, cfg.hidden_size)
            y_k, state_k, sel_k = dsa_jax.decode_k(cfg, weights, _copy(base), rows)
            state = _copy(base)
            for r in range(k):
                y, state, sel = dsa_jax.decode(cfg, weights, state, rows[:, r])
                _eq(y_k[:, r], y)
                _eq(sel_k[:, r], sel)
            for a, c in zip(jax.tree_util.tree_leaves(state_k), jax.tree_util.tree_leaves(state),
                            strict=True):
                _eq(a.astype(jnp.float32) if a.dtype == jnp.float8_e4m3fn else a,
                    c.astype(jnp.float32) if c.dtype == jnp.float8_e4m3fn else c)


def test_chunked_prefill_equals_one_prefill_and_per_row_selection():
    cfg = ODD
    weights = _layer(cfg, 1)
    x = _x(2, 2, 61, cfg.hidden_size)
    y_one, state_one, sel_one = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2), x)
    state = dsa_jax.init_state(cfg, 2)
    ys, sels = [], []
    for lo, hi in ((0, 9), (9, 30), (30, 31), (31, 61)):
        y, state, sel = dsa_jax.prefill(cfg, weights, state, x[:, lo:hi])
        ys.append(y)
        sels.append(sel)
    # Batched selection of a chunk: the same sets in the same slots as one row at a time.
    _eq(jnp.concatenate(sels, 1), sel_one)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), y_one, rtol=1e-5, atol=1e-5)
    per_row = dsa_jax.init_state(cfg, 2)
    for t in range(61):
        _, per_row, sel_t = dsa_jax.decode(cfg, weights, per_row, x[:, t])
        _eq(sel_t, sel_one[:, t])
    _eq(state.lengths, state_one.lengths)


def test_ragged_prefill_and_decode_equal_each_sequence_alone():
    cfg = ODD
    weights = _layer(cfg, 3)
    lens = [7, 30, 19]
    x = _x(4, 3, 40, cfg.hidden_size)
    state = dsa_jax.init_state(cfg, 3)
    _, state, _ = dsa_jax.prefill(cfg, weights, state, x[:, :30], num_tokens=lens)
    assert np.asarray(state.lengths).tolist() == lens
    active = np.array([True, False, True])
    y, state, sel = dsa_jax.decode(cfg, weights, state, x[:, 35], active=active)
    assert np.asarray(state.lengths).tolist() == [8, 30, 20]
    assert (np.asarray(sel[1]) == -1).all() and (np.asarray(y[1]) == 0).all()
    for s in (0, 2):
        alone = dsa_jax.init_state(cfg, 1)
        _, alone, _ = dsa_jax.prefill(cfg, weights, alone, x[s:s + 1, :lens[s]])
        y_s, _, sel_s = dsa_jax.decode(cfg, weights, alone, x[s:s + 1, 35])
        _eq(sel[s], sel_s[0])  # no padding token enters the selection
        np.testing.assert_allclose(y[s], y_s[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", ["float32", "float8_e4m3fn"])
def test_speculate_reject_rewind_continue_equals_never_speculating(cache_dtype):
    cfg = ODD.replace(cache_dtype=cache_dtype)
    weights = _layer(cfg, 5)
    x = _x(6, 2, 40, cfg.hidden_size)
    drafts = _x(7, 2, 3, cfg.hidden_size)
    _, base, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2, kv_scale=0.1),
                                 x[:, :14])
    plain = _copy(base)
    plain_y = []
    for t in range(14, 20):
        y, plain, _ = dsa_jax.decode(cfg, weights, plain, x[:, t])
        plain_y.append(y)
    # Verify [x14, wrong, wrong, wrong] (crossing the 15|16 pool boundary): only the first row
    # is accepted, the rest rewound, then decoding continues.
    rows = jnp.concatenate([x[:, 14:15], drafts], axis=1)
    y_k, spec, _ = dsa_jax.decode_k(cfg, weights, base, rows)
    _eq(y_k[:, 0], plain_y[0])
    spec = dsa_jax.rewind(cfg, spec, [15, 15])
    spec_y = [y_k[:, 0]]
    for t in range(15, 20):
        y, spec, _ = dsa_jax.decode(cfg, weights, spec, x[:, t])
        spec_y.append(y)
    for a, c in zip(spec_y, plain_y, strict=True):
        _eq(a, c)


def test_indexer_ahead_heals_and_write_kv_row_matches_decode_caches():
    cfg = ODD
    weights = _layer(cfg, 8)
    x = _x(9, 1, 30, cfg.hidden_size)
    _, state, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 1), x[:, :20])
    # Only the sequence length rewound (as a scheduler that owns lengths would): heals.
    ahead = state._replace(lengths=state.lengths - 3)
    y, healed, _ = dsa_jax.decode(cfg, weights, ahead, x[:, 17])
    assert np.asarray(healed.index_lengths).tolist() == [18]
    _, ref, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 1), x[:, :17])
    y_ref, ref, _ = dsa_jax.decode(cfg, weights, ref, x[:, 17])
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)

    drafted = dsa_jax.write_kv_row(cfg, weights, _copy(ref), x[:, 18])
    _, decoded, _ = dsa_jax.decode(cfg, weights, _copy(ref), x[:, 18])
    assert np.asarray(drafted.lengths).tolist() == [19]
    for name in ("latent", "index_k", "index_g", "pool_keys"):
        np.testing.assert_allclose(getattr(drafted, name), getattr(decoded, name),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def test_decode_compiles_once_across_context_lengths():
    cfg = ODD.replace(max_verify=3)  # a config no other test compiles
    weights = _layer(cfg, 10)
    state = dsa_jax.init_state(cfg, 2)
    before = layer._layout_step._cache_size()
    for t in range(40):  # lengths 0..39, through tails, pool boundaries and the top-k cap
        _, state, _ = dsa_jax.decode(cfg, weights, state, _x(t, 2, cfg.hidden_size))
    assert layer._layout_step._cache_size() - before == 1
    _, state, _ = dsa_jax.decode_k(cfg, weights, state, _x(99, 2, 3, cfg.hidden_size))
    assert layer._layout_step._cache_size() - before == 2  # the 3-row verify's program


def test_state_is_donated_not_copied():
    cfg = ODD
    weights = _layer(cfg, 11)
    state = dsa_jax.init_state(cfg, 1)
    _, new, _ = dsa_jax.decode(cfg, weights, state, _x(1, 1, cfg.hidden_size))
    if jax.default_backend() == "cpu" and not state.latent.is_deleted():
        pytest.skip("this backend does not implement donation")
    assert state.latent.is_deleted() and not new.latent.is_deleted()


def test_serving_errors_name_value_and_limit_and_leave_state_usable():
    cfg = ODD
    weights = _layer(cfg, 12)
    _, state, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2),
                                  _x(1, 2, 10, cfg.hidden_size))
    with pytest.raises(StepError, match=r"a 5-row verify does not fit max_verify 4"):
        dsa_jax.decode_k(cfg, weights, state, _x(2, 2, 5, cfg.hidden_size))
    with pytest.raises(StepError, match=r"cannot rewind to length 11; it must be in \[0, 10\]"):
        dsa_jax.rewind(cfg, state, [9, 11])
    with pytest.raises(StepError, match=r"row counts \[3, 40\] must be 2 values in \[0, 5\]"):
        dsa_jax.prefill(cfg, weights, state, _x(3, 2, 5, cfg.hidden_size), num_tokens=[3, 40])
    shared = dsa_jax.init_random_weights(cfg, jax.random.key(1), has_indexer=False)
    with pytest.raises(StepError, match=r"shared_sel has shape \(2, 2, 15\), expected "
                                        r"\(2, 3, 15\)"):
        dsa_jax.decode_k(cfg, shared, state, _x(4, 2, 3, cfg.hidden_size),
                         shared_sel=jnp.zeros((2, 2, cfg.sel_width), jnp.int32))
    y, state, _ = dsa_jax.decode_k(cfg, weights, state, _x(5, 2, 4, cfg.hidden_size))
    assert np.isfinite(np.asarray(y)).all()
    assert np.asarray(state.lengths).tolist() == [14, 14]
