"""The host-side checks of a step (`dsa_jax.layer.prepare_step` calls them): everything a
concrete state can tell, raised as `StepError` with the value and the limit before anything is
written. Numbers come from the host's copy of the lengths and tables (`dsa_jax.mirror`) when it
has one, else from one device read.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.config import DsaConfig
from dsa_jax.errors import StepError
from dsa_jax.mirror import host_numbers, remember
from dsa_jax.state import (
    DsaState,
    expected_state_fields,
    mapped_twice,
    ring_guard,
    ring_holds,
    ring_reach,
    ring_rows,
)
from dsa_jax.weights import DsaWeights, expected_weight_fields


def check_types(cfg, weights, state) -> None:
    """The three pytrees' types, so that swapped arguments fail naming them (`TypeError`)."""
    for name, value, want in (("cfg", cfg, DsaConfig), ("weights", weights, DsaWeights),
                              ("state", state, DsaState)):
        if not isinstance(value, want):
            raise TypeError(f"{name} must be a {want.__name__}, got {type(value).__name__} "
                            f"(the order is cfg, weights, state, x)")


def check_live(state: DsaState) -> None:
    """The state's arrays are live: a state given to a step is donated to it (its buffers
    become the new state's), so reusing it fails here rather than inside XLA."""
    for name, a in zip(DsaState._fields, state, strict=True):
        if isinstance(a, jax.Array) and a.is_deleted():
            raise StepError(f"state field {name} was donated to an earlier step (or deleted): "
                            f"decode, decode_k, prefill and write_kv_row donate the state they "
                            f"are given; use the state that call returned (or copy one to keep "
                            f"it: jax.tree.map(jnp.copy, state))")


def is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def check_fields(what: str, got: tuple, want: dict) -> None:
    """Every field's shape and dtype as the config implies (`what` names the pytree). A
    leading tensor-parallel axis (weights stacked by `sharding.shard_weights`) is allowed."""
    for name, spec in want.items():
        value = getattr(got, name)
        if spec is None or value is None:
            continue
        shape = tuple(value.shape)
        if len(shape) == len(spec[0]) + 1 and what == "weights":
            shape = shape[1:]
        if shape != spec[0] or value.dtype != spec[1]:
            raise StepError(f"{what} field {name} is {np.dtype(value.dtype).name}"
                            f"{list(value.shape)}, but the config implies {spec[1].name}"
                            f"{list(spec[0])}: were they made for another DsaConfig?")


_FLOATS = frozenset(np.dtype(d) for d in (np.float32, jnp.bfloat16, np.float16))


def check_x(cfg: DsaConfig, state: DsaState, x: jax.Array) -> None:
    b = state.num_seqs
    if x.shape[0] != b or x.shape[-1] != cfg.hidden_size:
        raise StepError(f"x has shape {tuple(x.shape)}; expected leading dim {b} (sequences in "
                        f"the state) and last dim {cfg.hidden_size} (hidden_size)")
    if x.dtype not in _FLOATS and not jnp.issubdtype(x.dtype, jnp.floating):
        raise StepError(f"x has dtype {jnp.dtype(x.dtype).name}; expected a real floating "
                        f"dtype (float32, bfloat16 or float16)")


def check_layer(cfg: DsaConfig, weights: DsaWeights, state: DsaState) -> None:
    """What the shapes and dtypes of the weights and state tell (static: free)."""
    b = state.num_seqs
    # A per-shard view of a sharded state (sharding/steps.py) carries no indexer arrays.
    state_indexer = weights.has_indexer if state.index_k is None else state.index_k.shape[1] > 0
    if weights.has_indexer and not state_indexer:
        raise StepError("these weights run an indexer (a 'full' layer) but the state has no "
                        "indexer cache (init_state(..., has_indexer=False)); build the state "
                        "with has_indexer=True")
    if not weights.has_indexer and state_indexer:
        raise StepError("these weights have no indexer (a 'shared' layer) but the state has an "
                        "indexer cache; build the state with has_indexer=False")
    check_fields("weights", weights, expected_weight_fields(cfg, weights.has_indexer))
    check_fields("state", state, expected_state_fields(cfg, b, state.latent.shape[0],
                                                        state_indexer))


# What passed `check_layer`: the weights by the ids of their leaves (a loop passes the same
# arrays every step; an entry holds weak references whose callbacks drop it when any leaf
# goes, so the ids can never name other arrays) and the state by its shapes and dtypes (its
# arrays are new every step), per config.
_LAYER_OK: dict[tuple, tuple] = {}


def _signature(tree) -> tuple:
    return tuple([None if a is None else (a.shape, a.dtype) for a in tree])


def _remember_layer(key: tuple, weights) -> None:
    def drop(_, key=key, entries=_LAYER_OK):  # the dict itself: see `mirror.remember`
        entries.pop(key, None)
    try:
        refs = tuple(weakref.ref(a, drop) for a in weights if a is not None)
    except TypeError:  # a leaf that takes no weak reference (a numpy array): not cached
        return
    if len(_LAYER_OK) >= 256:
        _LAYER_OK.clear()
    _LAYER_OK[key] = refs


def check_layer_once(cfg: DsaConfig, weights: DsaWeights, state: DsaState) -> None:
    """`check_layer`, skipped for weights and a state signature that already passed."""
    key = (cfg, tuple(map(id, weights)), _signature(state))
    if key in _LAYER_OK:
        return
    check_layer(cfg, weights, state)
    _remember_layer(key, weights)


def check_step(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                n_new: np.ndarray, shared_sel: jax.Array | None, sel_shape: tuple[int, ...]
                ) -> None:
    """Host-side validation of one step (`n_new [B]` rows per sequence); see the docstring."""
    check_x(cfg, state, x)
    if not weights.has_indexer:
        if shared_sel is None:
            raise StepError("these weights have no indexer (a 'shared' layer): pass shared_sel, "
                            "the selection of the previous full layer")
        if tuple(shared_sel.shape) != sel_shape:
            raise StepError(f"shared_sel has shape {tuple(shared_sel.shape)}, expected "
                            f"{sel_shape} (one selection row per input row)")
        if not jnp.issubdtype(shared_sel.dtype, jnp.integer):
            raise StepError(f"shared_sel has dtype {jnp.dtype(shared_sel.dtype).name}; "
                            f"expected integer token ids")
    elif shared_sel is not None:
        raise StepError("shared_sel was given but these weights run their own indexer")
    check_layer_once(cfg, weights, state)
    # Values to check: a concrete array (not traced, not a ShapeDtypeStruct).
    check_sel = isinstance(shared_sel, (np.ndarray, jax.Array)) and is_concrete(shared_sel)
    if not all(is_concrete(a) for a in (state.lengths, state.block_tables, n_new)):
        return
    n_new = np.asarray(n_new)
    # The host's copy when it has one (dsa_jax.mirror), else one device->host read.
    numbers = host_numbers(state)
    lengths = numbers.lengths
    sel = shared_sel_values(shared_sel, lengths) if check_sel else None
    # A step within the slack of an earlier full check needs no check of the lengths and
    # tables (dsa_jax.mirror); else the full check, and the slack it leaves.
    # x's rows per sequence bound n_new (rows_per_seq refuses more): no reduction needed.
    if numbers.slack is None or (1 if x.ndim == 2 else x.shape[1]) > numbers.slack:
        slack = check_numbers(cfg, numbers, n_new, weights.has_indexer, state.latent.shape[0])
        remember(state, lengths, numbers.index_lengths, numbers.block_tables, slack)
    if sel is not None:
        check_shared_sel(sel, lengths, n_new, cfg.max_context)


def check_numbers(cfg: DsaConfig, numbers, n_new: np.ndarray, has_indexer: bool,
                  nb: int) -> int:
    """Lengths and tables (`numbers`: `dsa_jax.mirror.HostNumbers`) for a step of `n_new
    [B]` rows: raises `StepError`, else returns the slack (tokens every sequence can append
    before a check of these values could fail: the end of its checked blocks)."""
    lengths, index_lengths, tables = numbers.lengths, numbers.index_lengths, numbers.block_tables
    # Marks recorded as the lengths array itself (dsa_jax.mirror) are in lockstep: never
    # behind, and a ring at its mark holds the pool being filled (Rr >= KP - 1 + G).
    if has_indexer and index_lengths is not lengths:
        if (index_lengths < lengths).any():
            s = int(np.flatnonzero(index_lengths < lengths)[0])
            raise StepError(f"sequence {s}: indexer length {index_lengths[s]} is behind the "
                            f"sequence length {lengths[s]}: rows {index_lengths[s]}.."
                            f"{lengths[s] - 1} were never written to the indexer cache")
        check_ring(cfg, lengths, index_lengths)
    ends = lengths + n_new  # [B]
    if (ends > cfg.max_context).any():
        s = int(np.flatnonzero(ends > cfg.max_context)[0])
        raise StepError(f"sequence {s}: writing {n_new[s]} token(s) at position {lengths[s]} "
                        f"would reach {lengths[s] + n_new[s]}, past max_context "
                        f"{cfg.max_context}")
    blocks_read = -(-ends // cfg.block_size)  # [B]
    if not tables_fit(tables, blocks_read, nb):
        check_tables(cfg, tables, lengths, n_new, nb)
    # Blocks below ceil(ends / bs) are checked: a sequence may grow to their end.
    checked_end = np.minimum(blocks_read * cfg.block_size, cfg.max_context)
    return int((checked_end - lengths).min(initial=cfg.max_context))


# Per read-only host table (the mirror's, passed on from step to step): each sequence's count
# of leading entries in [0, nb), and whether those entries are all distinct blocks. Keyed by
# the array (an entry goes with it).
_TABLE_FACTS: dict[int, tuple[weakref.ref, int, np.ndarray, bool]] = {}


def tables_fit(tables: np.ndarray, blocks_read: np.ndarray, nb: int) -> bool:
    """True when every sequence's first `blocks_read [B]` entries are mapped (in `[0, nb)`)
    and no two of them are the same block; False means `check_tables` must look (it may still
    pass). Cached per read-only table: a loop checks the same one every step."""
    entry = _TABLE_FACTS.get(id(tables))
    if entry is None or entry[0]() is not tables or entry[1] != nb:
        ok = (tables >= 0) & (tables < nb)  # [B, MB]
        prefix = np.where(ok.all(axis=1), ok.shape[1], np.argmin(ok, axis=1))  # [B]
        mask = np.arange(tables.shape[1])[None, :] < prefix[:, None]
        distinct = mapped_twice(tables, mask, nb) is None
        if tables.flags.writeable or not isinstance(tables, np.ndarray):
            return bool(distinct and (blocks_read <= prefix).all())
        key = id(tables)
        if len(_TABLE_FACTS) >= 256:
            _TABLE_FACTS.clear()
        entry = (weakref.ref(tables, lambda _, key=key, facts=_TABLE_FACTS: facts.pop(key, None)),
                 nb, prefix, distinct)
        _TABLE_FACTS[key] = entry
    return bool(entry[3] and (blocks_read <= entry[2]).all())


def ring_message(cfg: DsaConfig, s: int, length: int, mark: int) -> str:
    """Why sequence `s` at `length` with ring mark `mark` lacks rows its next step reads."""
    kp, rows, guard = cfg.index_kpool, ring_rows(cfg), ring_guard(cfg)
    first = length // kp * kp
    return (f"sequence {s}: at length {length} the pool being filled needs the indexer rows "
            f"{first}..{length - 1}, but the indexer ring ({rows} rows, mark {mark}, guard "
            f"{guard}) holds raw rows only from position {mark + guard - rows} on: a rewind "
            f"may drop at most {ring_reach(cfg)} rows below the mark, or go to a pool "
            f"boundary (a multiple of index_kpool {kp})")


def check_ring(cfg: DsaConfig, lengths: np.ndarray, marks: np.ndarray) -> None:
    """Every sequence's ring holds the rows its next step reads (`state.ring_holds`)."""
    lost = np.flatnonzero(~ring_holds(cfg, lengths, marks))
    if len(lost):
        s = int(lost[0])
        raise StepError(ring_message(cfg, s, int(lengths[s]), int(marks[s])))


def check_rewind(cfg: DsaConfig, lengths: np.ndarray, marks: np.ndarray, want: np.ndarray,
                 ring: bool, first_seq: int = 0) -> None:
    """A rewind from `lengths` to `want` (host [B] arrays; ring marks `marks`) keeps every
    length in [0, current] and, for an indexer state (`ring`), within the ring's reach.
    `first_seq`: the first sequence's number, for the message."""
    bad = (want < 0) | (want > lengths)
    if bad.any():
        s = int(np.argmax(bad))
        raise StepError(f"sequence {first_seq + s}: cannot rewind to length {want[s]}; it "
                        f"must be in [0, {lengths[s]}] (the current length)")
    if not ring:
        return
    lost = np.flatnonzero((want < lengths) & ~ring_holds(cfg, want, marks))
    if len(lost):
        s = int(lost[0])
        raise StepError(f"cannot rewind to length {want[s]}: "
                        + ring_message(cfg, first_seq + s, int(want[s]), int(marks[s])))


# Selections returned by this module's steps, with the lengths before the step that made
# them (keyed by the array, like dsa_jax.mirror): a "shared" layer given one at those same
# positions needs no device read to check it, since the indexer selects only tokens at or
# before each row's position (and -1 on padding rows).
_VOUCHED: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def vouch(sel, lengths_before: np.ndarray) -> None:
    if not isinstance(sel, jax.Array) or isinstance(sel, jax.core.Tracer):
        return
    key = id(sel)
    ref = weakref.ref(sel, lambda _, key=key, vouched=_VOUCHED: vouched.pop(key, None))
    if lengths_before.flags.writeable:
        lengths_before = np.array(lengths_before)
    _VOUCHED[key] = (ref, lengths_before)


def shared_sel_values(shared_sel, lengths: np.ndarray) -> np.ndarray | None:
    """shared_sel's values for the check: a host array as it is; None (nothing to check) for
    a selection a full layer's step returned at these positions; else one device read."""
    if isinstance(shared_sel, np.ndarray):
        return shared_sel
    entry = _VOUCHED.get(id(shared_sel))
    if entry is not None and entry[0]() is shared_sel and np.array_equal(entry[1], lengths):
        return None
    return np.asarray(jax.device_get(shared_sel))


def check_tables(cfg: DsaConfig, tables: np.ndarray, lengths: np.ndarray, n_new: np.ndarray,
                  nb: int) -> None:
    """Every block the step reads (positions < length + n_new: a row may select any earlier
    token) is mapped to a physical block, and no two of them are the same block."""
    bs = cfg.block_size
    cols = np.arange(tables.shape[1])[None, :]
    read = cols < -(-(lengths + n_new) // bs)[:, None]  # [B, MB]
    bad = read & ((tables < 0) | (tables >= nb))
    if bad.any():
        s = int(np.flatnonzero(bad.any(axis=1))[0])
        i = int(np.argmax(bad[s]))
        written = n_new[s] > 0 and (i + 1) * bs > lengths[s]
        where = (f"position {max(i * bs, int(lengths[s]))} is to be written there" if written
                 else f"position {i * bs} is read")
        raise StepError(f"sequence {s}: block table entry {i} is {tables[s, i]}, outside "
                        f"[0, {nb}) physical blocks, but {where}")
    twice = mapped_twice(tables, read, nb)
    if twice is not None:
        raise StepError(f"{twice}: two sequences (or positions) sharing a physical block "
                        f"overwrite each other")


def check_shared_sel(sel: np.ndarray, lengths: np.ndarray, n_new: np.ndarray,
                      max_context: int) -> None:
    """Every id of a real row is -1 or a token at or before the row's position (written, or
    written by this step): `sel [B, W]` (a decode) or `[B, R, W]`."""
    rows = sel if sel.ndim == 3 else sel[:, None]
    pos = lengths[:, None] + np.arange(rows.shape[1])[None, :]  # [B, R]
    real = np.arange(rows.shape[1])[None, :] < n_new[:, None]
    bad = real[..., None] & ((rows < -1) | (rows > pos[..., None]) | (rows >= max_context))
    if bad.any():
        s, r, j = (int(v) for v in np.argwhere(bad)[0])
        row = f" row {r} (position {pos[s, r]})" if sel.ndim == 3 else ""
        raise StepError(f"sequence {s}{row}: shared_sel slot {j} holds token {rows[s, r, j]}; "
                        f"ids must be -1 or in [0, {pos[s, r]}] (at or before the row's "
                        f"position, below max_context {max_context})")


@functools.cache
def _all_rows(b: int, count: int) -> np.ndarray:
    """`count` rows for each of `b` sequences: one read-only array per value (a loop asks for
    the same one every step)."""
    n = np.full((b,), count, np.int32)
    n.setflags(write=False)
    return n


def rows_per_seq(b: int, count: int, given, name: str):
    """Per-sequence row counts: `given` ([B] ints or bools) or `count` for every sequence.
    Concrete counts are checked on the host; traced ones (under a caller's jit) pass as they
    are. Non-integer counts are refused, never truncated."""
    if given is None:
        return _all_rows(b, count)
    if not hasattr(given, "dtype"):
        given = np.asarray(given)
    dtype = jnp.dtype(given.dtype)
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
        shown = f" {np.asarray(given).tolist()}" if is_concrete(given) else ""
        raise StepError(f"{name} must be integers, got {dtype.name}{shown}")
    if not is_concrete(given):
        return jnp.asarray(given).astype(jnp.int32).reshape(b)
    n = np.asarray(given).astype(np.int64).reshape(-1)
    if n.shape != (b,) or (n < 0).any() or (n > count).any():
        raise StepError(f"{name}: per-sequence row counts {n.tolist()} must be {b} values in "
                        f"[0, {count}]")
    return n.astype(np.int32)


def check_out(cfg: DsaConfig, x, out, inputs) -> tuple[jax.Array, jax.Array]:
    """`out` for a decode or verify of `x` (`[B, D]` or `[B, K, D]`): two distinct concrete,
    live jax arrays `(y, sel)` of y's shape `x.shape[:-1] + (D,)` float32 and sel's
    `x.shape[:-1] + (W,)` int32, none of them an array of `inputs` (they are donated)."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise StepError(f"out must be a pair (y, sel) of arrays, got {type(out).__name__}"
                        f"{f' of {len(out)}' if isinstance(out, (tuple, list)) else ''}")
    lead = tuple(x.shape[:-1])
    want = (("y", lead + (cfg.hidden_size,), np.dtype(np.float32)),
            ("sel", lead + (cfg.sel_width,), np.dtype(np.int32)))
    for a, (name, shape, dtype) in zip(out, want, strict=True):
        if not isinstance(a, jax.Array) or not is_concrete(a):
            raise StepError(f"out {name} must be a concrete jax.Array (it is donated: a call "
                            f"at the top level, not under jit), got {type(a).__name__}")
        if tuple(a.shape) != shape or a.dtype != dtype:
            raise StepError(f"out {name} is {np.dtype(a.dtype).name}{list(a.shape)}, expected "
                            f"{dtype.name}{list(shape)}")
        if a.is_deleted():
            raise StepError(f"out {name} was donated to a step (or deleted): pass a live array")
    taken = {id(a) for a in jax.tree.leaves(inputs)}
    if out[0] is out[1] or id(out[0]) in taken or id(out[1]) in taken:
        raise StepError("out y and sel must be two arrays of their own: neither one another nor "
                        "the weights, the state, x or shared_sel (out is donated)")
    return tuple(out)
