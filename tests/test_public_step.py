"""The public decode path: host checks from the host's copy of the lengths and block tables
(no device read once known, never stale), one compiled program per row layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import mirror
from dsa_jax.shapes import ODD

CFG = ODD


def _x(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


def _device_values(state):
    return [np.asarray(a) for a in (state.lengths, state.index_lengths, state.block_tables)]


def test_no_device_read_after_the_first_and_the_copy_is_exact(monkeypatch):
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(1))
    state = dsa_jax.init_state(CFG, 2)
    reads = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(1) or real(x))
    _, state, _ = dsa_jax.prefill(CFG, weights, state, _x(2, 2, 9, CFG.hidden_size),
                                  num_tokens=[9, 4])
    assert len(reads) == 1  # a state built by init_state: read once
    _, state, _ = dsa_jax.decode(CFG, weights, state, _x(3, 2, CFG.hidden_size),
                                 active=[True, False])
    _, state, _ = dsa_jax.decode_k(CFG, weights, state, _x(4, 2, 3, CFG.hidden_size))
    state = dsa_jax.rewind(CFG, state, [11, 6])
    state = dsa_jax.write_kv_row(CFG, weights, state, _x(5, 2, CFG.hidden_size))
    _, state, _ = dsa_jax.decode(CFG, weights, state, _x(6, 2, CFG.hidden_size))
    assert len(reads) == 1
    monkeypatch.setattr(jax, "device_get", real)
    known = mirror.known(state)
    assert known is not None
    for host, device in zip(known[:3], _device_values(state), strict=True):
        assert np.array_equal(host, device)
    assert known.lengths.tolist() == [13, 8]


def test_a_state_edited_by_the_caller_is_read_again():
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(7))
    _, state, _ = dsa_jax.prefill(CFG, weights, dsa_jax.init_state(CFG, 1),
                                  _x(8, 1, 10, CFG.hidden_size))
    assert mirror.known(state).lengths.tolist() == [10]
    edited = state._replace(lengths=jnp.asarray([94], jnp.int32),
                            index_lengths=jnp.asarray([94], jnp.int32))
    assert mirror.known(edited) is None
    with pytest.raises(dsa_jax.StepError, match="would reach 97, past max_context 96"):
        dsa_jax.decode_k(CFG, weights, edited, _x(9, 1, 3, CFG.hidden_size))
    table = np.asarray(state.block_tables).copy()
    table[0, 1] = -1  # a caller's new block table: position 8.. has no block any more
    unmapped = state._replace(block_tables=jnp.asarray(table))
    with pytest.raises(dsa_jax.StepError, match="block table entry 1 is -1"):
        dsa_jax.decode(CFG, weights, unmapped, _x(10, 1, CFG.hidden_size))



def _tree_bits(tree):
    return [np.asarray(a).tobytes() for a in jax.tree.leaves(tree)]


def test_checks_skipped_within_the_slack_still_catch_the_first_bad_step():
    """A decode loop checks lengths and tables once, then runs within the slack that check
    left (dsa_jax.mirror): the step that first reads an unmapped block, or would pass
    max_context, must still be refused, before anything is written."""
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(11))
    bs, mb = CFG.block_size, CFG.blocks_per_seq
    tables = np.arange(2 * mb, dtype=np.int32).reshape(2, mb)
    tables[1, 2:] = -1  # sequence 1 has blocks for 2 * bs tokens only
    state = dsa_jax.init_state(CFG, 2, block_tables=tables)
    _, state, _ = dsa_jax.prefill(CFG, weights, state, _x(12, 2, 5, CFG.hidden_size))
    for i in range(2 * bs - 5):  # sequence 1 fills its two blocks, one token at a time
        _, state, _ = dsa_jax.decode(CFG, weights, state, _x(20 + i, 2, CFG.hidden_size))
        assert mirror.known(state).slack is not None
    assert mirror.known(state).lengths.tolist() == [2 * bs, 2 * bs]
    before = _tree_bits(state)
    with pytest.raises(dsa_jax.StepError, match="block table entry 2 is -1"):
        dsa_jax.decode(CFG, weights, state, _x(40, 2, CFG.hidden_size))
    assert _tree_bits(state) == before  # refused before anything ran (nothing donated)
    # Sequence 1 inactive: sequence 0 goes on to max_context, then is refused.
    for i in range(CFG.max_context - 2 * bs):
        _, state, _ = dsa_jax.decode(CFG, weights, state, _x(50 + i, 2, CFG.hidden_size),
                                     active=[True, False])
    assert mirror.known(state).lengths.tolist() == [CFG.max_context, 2 * bs]
    with pytest.raises(dsa_jax.StepError, match="past max_context 96"):
        dsa_jax.decode(CFG, weights, state, _x(200, 2, CFG.hidden_size), active=[True, False])


def test_the_slack_never_outlives_its_tables_or_a_rewind():
    """The slack belongs to the tables it was checked on: a state with new tables, or a
    rewound one, is checked in full again (here: a block the new table no longer maps)."""
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(13))
    _, state, _ = dsa_jax.prefill(CFG, weights, dsa_jax.init_state(CFG, 1),
                                  _x(14, 1, 3, CFG.hidden_size))
    _, state, _ = dsa_jax.decode(CFG, weights, state, _x(15, 1, CFG.hidden_size))
    assert mirror.known(state).slack == CFG.block_size - 4
    state = dsa_jax.rewind(CFG, state, [2])
    assert mirror.known(state).slack is None
    table = np.asarray(state.block_tables).copy()
    table[0, 0] = -1
    with pytest.raises(dsa_jax.StepError, match="block table entry 0 is -1"):
        dsa_jax.decode(CFG, weights, state._replace(block_tables=jnp.asarray(table)),
                       _x(16, 1, CFG.hidden_size))
