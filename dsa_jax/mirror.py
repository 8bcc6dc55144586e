"""Host copies of a state's lengths and block tables, so host checks need no device read.

A `DsaState`'s `lengths`, `index_lengths` and `block_tables` are immutable device arrays. When
the host knows their values (it computed them: `lengths + n_new` after a step, the lengths a
`rewind` was given), it records them here, keyed by those very array objects. A lookup
succeeds only if all three arrays of the state are the ones recorded, so an entry can never
describe other values: a state built or edited by the caller (`init_state`, `_replace`, a
restored checkpoint) is simply not found, and the checks read it from the device once.
Entries go away with their arrays.

An entry may also carry `slack`, set by `dsa_jax.step_checks` after a full check of these
values: a lower bound on the tokens every sequence can still append while every check of the
lengths and tables passes (past max_context, an unmapped or shared block, the indexer
behind). A step of at most `slack` rows per sequence needs no check of them; a step that
appends `n` rows passes `slack - n` on to the new state's entry (same tables, lockstep
indexer).

Lockstep marks (index_lengths == lengths, a state that only grew) are recorded as the very
same array as the lengths (`dsa_jax.layer`), so a check knows them to be in lockstep by
identity, with no arithmetic: such marks are never behind and the ring holds the pool being
filled.
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
    slack: int | None = None  # tokens every sequence can append unchecked (module docstring)


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


def _frozen(v) -> np.ndarray:
    """`v` as a read-only int32 array: itself if it already is one (entries share them)."""
    if isinstance(v, np.ndarray) and v.dtype == np.int32 and not v.flags.writeable:
        return v
    v = np.array(v, np.int32)
    v.setflags(write=False)
    return v


def remember(state, lengths, index_lengths, block_tables, slack: int | None = None) -> None:
    """Record host values (numpy) for `state`'s arrays; a traced state records nothing.
    `slack`: only from a check of these very values, or an entry's slack less the rows its
    step appended (module docstring)."""
    arrays = _tracked(state)
    if not _concrete(arrays):
        return
    numbers = HostNumbers(_frozen(lengths), _frozen(index_lengths), _frozen(block_tables),
                          slack)
    key = id(arrays[0])
    # The entry goes when the lengths array does (its id may then be reused). The callback
    # holds the dict itself: at interpreter exit the module's globals are cleared before the
    # last arrays die.
    first = weakref.ref(arrays[0], lambda _, key=key, entries=_ENTRIES: entries.pop(key, None))
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
