"""Host copies of a state's lengths and block tables, so host checks need no device read.

A `DsaState`'s `lengths`, `index_lengths` and `block_tables` are immutable device arrays. When
the host knows their values (it computed them: `lengths + n_new` after a step, the lengths a
`rewind` was given), it records them here, keyed by those very array objects. A lookup
succeeds only if all three arrays of the state are the ones recorded, so an entry can never
describe other values: a state built or edited by the caller (`init_state`, `_replace`, a
restored checkpoint) is simply not found, and the checks read it from the device once.
Entries go away with their arrays.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import numpy as np


class HostNumbers(NamedTuple):
    lengths: np.ndarray  # [B] int32
    index_lengths: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, MB] int32


_ENTRIES: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref, HostNumbers]] = {}


def _tracked(state) -> tuple:
    return state.lengths, state.index_lengths, state.block_tables


def _concrete(arrays) -> bool:
    return all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
               for a in arrays)


def known(state) -> HostNumbers | None:
    """The recorded host values of `state`'s lengths and tables, or None."""
    arrays = _tracked(state)
    entry = _ENTRIES.get(id(arrays[0]))
    if entry is None or any(ref() is not a for ref, a in zip(entry[:3], arrays, strict=True)):
        return None
    return entry[3]


def remember(state, lengths, index_lengths, block_tables) -> None:
    """Record host values (numpy) for `state`'s arrays; a traced state records nothing."""
    arrays = _tracked(state)
    if not _concrete(arrays):
        return
    numbers = HostNumbers(*(np.array(v, np.int32) for v in (lengths, index_lengths,
                                                            block_tables)))
    for v in numbers:
        v.setflags(write=False)
    key = id(arrays[0])
    # The entry goes when the lengths array does (its id may then be reused).
    first = weakref.ref(arrays[0], lambda _, key=key: _ENTRIES.pop(key, None))
    _ENTRIES[key] = (first, weakref.ref(arrays[1]), weakref.ref(arrays[2]), numbers)


def host_numbers(state) -> HostNumbers:
    """`state`'s lengths, indexer lengths and block tables on the host: the recorded values,
    or one device read (then recorded)."""
    numbers = known(state)
    if numbers is None:
        numbers = HostNumbers(*(np.asarray(a) for a in jax.device_get(_tracked(state))))
        remember(state, *numbers)
        numbers = known(state) or numbers
    return numbers
