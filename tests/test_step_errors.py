"""Bad steps raise before anything is written, and the caller's state stays usable."""

import jax
import numpy as np
import pytest

import dsa_jax
from dsa_jax import ImplementationError, StepError
from dsa_jax.shapes import ODD
from dsa_jax.testing import random_rows


@pytest.fixture(scope="module")
def layer():
    cfg = ODD
    return cfg, dsa_jax.init_random_weights(cfg, jax.random.key(0))


def _x(cfg, *shape):
    """Random rows `[*shape, D]`, seeded by their shape."""
    return random_rows(sum(shape), *shape, cfg.hidden_size)


def _assert_usable(cfg, weights, state, lengths):
    assert np.asarray(state.lengths).tolist() == lengths
    y, state, _ = dsa_jax.decode(cfg, weights, state, _x(cfg, len(lengths)))
    assert np.isfinite(np.asarray(y)).all()


def test_writing_past_max_context_is_refused(layer):
    cfg, weights = layer
    _, state, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2), _x(cfg, 2, 90))
    with pytest.raises(StepError, match=r"position 90 would reach 97, past max_context 96"):
        dsa_jax.prefill(cfg, weights, state, _x(cfg, 2, 7))
    _assert_usable(cfg, weights, state, [90, 90])


def test_block_table_must_cover_the_position(layer):
    cfg, weights = layer
    tables = np.arange(2 * cfg.blocks_per_seq, dtype=np.int32).reshape(2, -1)
    tables[1, 2] = -1  # sequence 1 has no block for positions 16..23
    state = dsa_jax.init_state(cfg, 2, block_tables=tables)
    _, state, _ = dsa_jax.prefill(cfg, weights, state, _x(cfg, 2, 14))
    with pytest.raises(StepError, match=r"sequence 1: block table entry 2 is -1, outside"):
        dsa_jax.prefill(cfg, weights, state, _x(cfg, 2, 4))
    _assert_usable(cfg, weights, state, [14, 14])


def test_wrong_input_shapes_are_refused(layer):
    cfg, weights = layer
    state = dsa_jax.init_state(cfg, 2)
    with pytest.raises(StepError, match="leading dim 2"):
        dsa_jax.decode(cfg, weights, state, _x(cfg, 3))
    with pytest.raises(StepError, match="hidden_size"):
        dsa_jax.decode(cfg, weights, state, jax.numpy.ones((2, 7)))
    _assert_usable(cfg, weights, state, [0, 0])


def test_indexer_out_of_lockstep_is_refused(layer):
    cfg, weights = layer
    _, state, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 1), _x(cfg, 1, 5))
    behind = state._replace(index_lengths=state.index_lengths - 1)
    with pytest.raises(StepError, match="indexer length 4 is behind the sequence length 5"):
        dsa_jax.decode(cfg, weights, behind, _x(cfg, 1))


def test_pallas_off_gpu_is_an_error_not_a_fallback(layer):
    cfg, weights = layer
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU pallas can run")
    with pytest.raises(ImplementationError, match="pallas"):
        dsa_jax.decode(cfg.replace(implementation="pallas"), weights,
                       dsa_jax.init_state(cfg, 1), _x(cfg, 1))


def test_unchecked_step_never_writes_out_of_bounds(layer):
    """check=False skips the host reads; an overflowing write is dropped, not performed."""
    cfg, weights = layer
    tables = np.arange(2 * cfg.blocks_per_seq, dtype=np.int32).reshape(2, -1)
    _, state, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2, block_tables=tables),
                                  _x(cfg, 2, 94))
    before = np.asarray(state.latent.astype(np.float32)).copy()
    _, state, _ = dsa_jax.decode_k(cfg, weights, state, _x(cfg, 2, 4), check=False)
    after = np.asarray(state.latent.astype(np.float32))
    # Positions 94, 95 exist and were written; 96, 97 do not and wrote nothing anywhere.
    changed = np.flatnonzero((after != before).any(axis=(1, 2)))
    assert set(changed.tolist()) == {11, 23}  # the last block of each sequence
    with pytest.raises(StepError, match="decode_k takes x"):
        dsa_jax.decode_k(cfg, weights, state, _x(cfg, 2))
