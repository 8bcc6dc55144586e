"""The public entry points, pure functions over the state pytree: `prefill`, `decode`,
`decode_k` (a speculative verify), `rewind`, `write_kv_row` (a drafter's context row).

All append rows to every sequence through one jitted step whose shapes are fixed by the
config's ceiling (live extents are data), so one compile serves every context length, and all
donate the state so the caches are updated in place. `decode` and `decode_k` pad each
sequence's rows to `cfg.max_verify`, so a K-row verify and K serial decodes run the same
shapes, hence the same per-row reductions: bit-identical results.

Two public pieces serve every caller (these functions, the NNX module, the sharded steps,
the engine): `prepare_step` (host side: row layout, row counts, checks) and `step` (the pure,
traceable step over padded rows).

Checks: before the jitted step runs, `prepare_step` validates on the host everything the
caller's concrete state can tell (shapes and dtypes of x, the weights and the state against
the config; capacity; every block the step reads, i.e. all blocks below `length + n_new`,
mapped and mapped once; indexer lockstep; `shared_sel` ids at or before their row's
position) and raises with the value and the limit (docs/errors.md); nothing has been written
then, and the caller's state is untouched. Under an outer `jax.jit` the lengths are traced
and these host checks cannot run (and `check=False` skips them, for a loop that validates on
the host itself); the step then still never writes out of bounds: writes past the caches are
dropped in every implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_jax.attend import attend, write_latents
from dsa_jax.config import DsaConfig
from dsa_jax.indexer import pool_scores, write_index_rows
from dsa_jax.mirror import host_numbers, known, remember
from dsa_jax.projection import output_projection, project, project_kv
from dsa_jax.select import expand_selection, top_pools
from dsa_jax.state import DsaState, expected_state_fields, mapped_twice
from dsa_jax.weights import DsaWeights, expected_weight_fields


class StepError(ValueError):
    """A step's inputs do not fit the state; raised before anything is written."""


def _write_rows(cfg: DsaConfig, weights: DsaWeights, state: DsaState, proj, n_new: jax.Array):
    """Store the rows' latents and indexer entries at positions `lengths + r`, r < n_new.

    Returns the state, `pos [B, R]` and `valid [B, R]`. An indexer ahead of the sequence (a
    rejected speculation) heals here: its rows are rewritten from `lengths` on.
    """
    r = proj.kv_raw.shape[1]
    pos = state.lengths[:, None] + jnp.arange(r, dtype=jnp.int32)  # [B, R]
    valid = jnp.arange(r)[None, :] < n_new[:, None]  # [B, R]
    state = write_latents(cfg, state, proj.kv_raw, weights.kv_a_norm, pos, valid)
    if weights.has_indexer:
        state = write_index_rows(cfg, weights, state, proj.k_raw, proj.g, pos, valid)
    return state, pos, valid


def candidate_pools(cfg: DsaConfig, pos: jax.Array, valid: jax.Array) -> jax.Array:
    """Complete pools visible at `pos [B, R]`: `(t + 1) // KP`; 0 on padded rows, so that the
    pool-score kernel reads no key for them (their selection is masked anyway)."""
    return jnp.where(valid, (pos + 1) // cfg.index_kpool, 0)


def _advance(state: DsaState, n_new: jax.Array) -> DsaState:
    lengths = state.lengths + n_new
    return state._replace(lengths=lengths, index_lengths=lengths)


def step(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, n_new: jax.Array,
         shared_sel: jax.Array | None = None) -> tuple[jax.Array, DsaState, jax.Array]:
    """The block's step: append rows `x [B, R, D]` to every sequence; pure and traceable.

    n_new: [B] int32, the first `n_new[b]` rows of sequence b are real (the rest padding:
    never written, never selected, output 0); shared_sel: [B, R, W] for a layer without an
    indexer. Returns `y [B, R, D]` f32, the new state and `sel [B, R, W]` int32. No checks run
    here (see `prepare_step`); writes past the caches are dropped. Call it inside your own
    `jax.jit` (donate the state) to serve; `decode`, `decode_k` and `prefill` wrap it.

    Order within the step: every latent and indexer write, then one selection over all rows
    (row r sees only pools complete at its own position), then one gather-attend. Row r's
    selection holds only tokens <= its position, all written, and no later row's write can
    change them, so this equals processing the rows one after another.
    """
    proj = project(cfg, weights, x)
    state, pos, valid = _write_rows(cfg, weights, state, proj, n_new)
    if weights.has_indexer:
        scores = pool_scores(cfg, proj.qi, proj.w, state.pool_keys,
                             candidate_pools(cfg, pos, valid))  # [B, R, P]
        sel = expand_selection(cfg, top_pools(cfg, scores), pos, valid)  # [B, R, W]
    else:
        sel = jnp.where(valid[..., None], shared_sel, -1)
    o_latent = attend(cfg, state, proj.q_abs, sel, live_rows(cfg, x))  # [B, R, Hl, C]
    y = output_projection(weights, o_latent)  # [B, R, D]
    return y, _advance(state, n_new), sel


def live_rows(cfg: DsaConfig, x: jax.Array) -> int:
    """Rows the gather-attend should plan its work split for: a decode or verify pads every
    sequence to max_verify rows and is planned as one live row per sequence (a K=1 decode is
    the common case; a K-row verify then runs more splits than it needs, at a small cost);
    a prompt chunk's rows are all live. Static, so decode and verify share one program."""
    b, r = x.shape[0], x.shape[1]
    return b if r <= cfg.max_verify else b * r


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How a call's rows map onto the step's rows (static: part of the compiled program).

    rows: rows per sequence the step runs (`cfg.max_verify` for a decode or verify, so K serial
    decodes and one K-row verify run the same shapes: the bit-identity guarantee); k: the
    call's real rows per sequence; squeeze: a decode (x [B, D], outputs [B, ...]).
    """
    rows: int
    k: int
    squeeze: bool = False

    def pad(self, x: jax.Array, shared_sel: jax.Array | None
            ) -> tuple[jax.Array, jax.Array | None]:
        """`x [B, k, D]` (or `[B, D]`) -> `[B, rows, D]`, zeros after row k; `shared_sel`
        likewise with -1."""
        if self.squeeze:
            x = x[:, None]
            shared_sel = None if shared_sel is None else shared_sel[:, None]
        extra = self.rows - self.k
        if extra:
            x = jnp.pad(x, ((0, 0), (0, extra), (0, 0)))
            if shared_sel is not None:
                shared_sel = jnp.pad(shared_sel, ((0, 0), (0, extra), (0, 0)),
                                     constant_values=-1)
        return x, shared_sel

    def unpad(self, y: jax.Array, sel: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The real rows of the step's outputs `y [B, rows, D]`, `sel [B, rows, W]`."""
        if self.squeeze:
            return y[:, 0], sel[:, 0]
        return y[:, :self.k], sel[:, :self.k]


def _is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _check_fields(what: str, got: tuple, want: dict) -> None:
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


def _check_x(cfg: DsaConfig, state: DsaState, x: jax.Array) -> None:
    b = state.num_seqs
    if x.shape[0] != b or x.shape[-1] != cfg.hidden_size:
        raise StepError(f"x has shape {tuple(x.shape)}; expected leading dim {b} (sequences in "
                        f"the state) and last dim {cfg.hidden_size} (hidden_size)")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise StepError(f"x has dtype {jnp.dtype(x.dtype).name}; expected a real floating "
                        f"dtype (float32, bfloat16 or float16)")


def _check_layer(cfg: DsaConfig, weights: DsaWeights, state: DsaState) -> None:
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
    _check_fields("weights", weights, expected_weight_fields(cfg, weights.has_indexer))
    _check_fields("state", state, expected_state_fields(cfg, b, state.latent.shape[0],
                                                        state_indexer))


def _check_step(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                n_new: np.ndarray, shared_sel: jax.Array | None, sel_shape: tuple[int, ...]
                ) -> None:
    """Host-side validation of one step (`n_new [B]` rows per sequence); see the docstring."""
    _check_x(cfg, state, x)
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
    _check_layer(cfg, weights, state)
    # Values to check: a concrete array (not traced, not a ShapeDtypeStruct).
    check_sel = isinstance(shared_sel, (np.ndarray, jax.Array)) and _is_concrete(shared_sel)
    if not all(_is_concrete(a) for a in (state.lengths, state.block_tables, n_new)):
        return
    n_new = np.asarray(n_new)
    # The host's copy when it has one (dsa_jax.mirror), else one device->host read.
    lengths, index_lengths, tables = host_numbers(state)
    sel = _shared_sel_values(shared_sel, lengths) if check_sel else None
    nb = state.latent.shape[0]
    behind = np.flatnonzero(index_lengths < lengths) if weights.has_indexer else []
    if len(behind):
        s = int(behind[0])
        raise StepError(f"sequence {s}: indexer length {index_lengths[s]} is behind the "
                        f"sequence length {lengths[s]}: rows {index_lengths[s]}..{lengths[s] - 1}"
                        f" were never written to the indexer cache")
    over = np.flatnonzero(lengths + n_new > cfg.max_context)
    if len(over):
        s = int(over[0])
        raise StepError(f"sequence {s}: writing {n_new[s]} token(s) at position {lengths[s]} "
                        f"would reach {lengths[s] + n_new[s]}, past max_context "
                        f"{cfg.max_context}")
    _check_tables(cfg, tables, lengths, n_new, nb)
    if sel is not None:
        _check_shared_sel(sel, lengths, n_new, cfg.max_context)


# Selections returned by this module's steps, with the lengths before the step that made
# them (keyed by the array, like dsa_jax.mirror): a "shared" layer given one at those same
# positions needs no device read to check it, since the indexer selects only tokens at or
# before each row's position (and -1 on padding rows).
_VOUCHED: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _vouch(sel, lengths_before: np.ndarray) -> None:
    if not isinstance(sel, jax.Array) or isinstance(sel, jax.core.Tracer):
        return
    key = id(sel)
    ref = weakref.ref(sel, lambda _, key=key: _VOUCHED.pop(key, None))
    _VOUCHED[key] = (ref, np.array(lengths_before))


def _shared_sel_values(shared_sel, lengths: np.ndarray) -> np.ndarray | None:
    """shared_sel's values for the check: a host array as it is; None (nothing to check) for
    a selection a full layer's step returned at these positions; else one device read."""
    if isinstance(shared_sel, np.ndarray):
        return shared_sel
    entry = _VOUCHED.get(id(shared_sel))
    if entry is not None and entry[0]() is shared_sel and np.array_equal(entry[1], lengths):
        return None
    return np.asarray(jax.device_get(shared_sel))


def _check_tables(cfg: DsaConfig, tables: np.ndarray, lengths: np.ndarray, n_new: np.ndarray,
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


def _check_shared_sel(sel: np.ndarray, lengths: np.ndarray, n_new: np.ndarray,
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


def _rows_per_seq(b: int, count: int, given, name: str):
    """Per-sequence row counts: `given` ([B] ints or bools) or `count` for every sequence.
    Concrete counts are checked on the host; traced ones (under a caller's jit) pass as they
    are. Non-integer counts are refused, never truncated."""
    if given is None:
        return np.full((b,), count, np.int32)
    if not hasattr(given, "dtype"):
        given = np.asarray(given)
    dtype = jnp.dtype(given.dtype)
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
        shown = f" {np.asarray(given).tolist()}" if _is_concrete(given) else ""
        raise StepError(f"{name} must be integers, got {dtype.name}{shown}")
    if not _is_concrete(given):
        return jnp.asarray(given).astype(jnp.int32).reshape(b)
    n = np.asarray(given).astype(np.int64).reshape(-1)
    if n.shape != (b,) or (n < 0).any() or (n > count).any():
        raise StepError(f"{name}: per-sequence row counts {n.tolist()} must be {b} values in "
                        f"[0, {count}]")
    return n.astype(np.int32)


STEP_KINDS = ("prefill", "decode", "verify", "kv")


def prepare_step(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
                 kind: str, counts=None, shared_sel: jax.Array | None = None,
                 check: bool = True) -> tuple[RowLayout, np.ndarray | jax.Array]:
    """The host side of a step: row layout, per-sequence row counts, and the checks.

    kind: "prefill" (x [B, S, D]; counts = num_tokens [B], default S), "decode" (x [B, D]),
    "verify" (x [B, K, D], K <= max_verify) or "kv" (a drafter's rows, x [B, S, D]); for the
    last three counts = active [B] bool (default all). Returns the `RowLayout` (decode and
    verify are padded to `cfg.max_verify` rows) and `n_new [B]` int32. With `check`, and a
    concrete state, everything the state can tell is validated here and `StepError` raised
    with the value and the limit before anything is written.
    """
    if kind not in STEP_KINDS:
        raise StepError(f"step kind {kind!r} is not one of {STEP_KINDS}")
    want_ndim = 2 if kind == "decode" else 3
    if x.ndim != want_ndim:
        other = ("; decode_k takes x [B, K, D]" if kind == "decode" else
                 "; decode takes [B, D]" if kind == "verify" else "")
        raise StepError(f"{'decode_k' if kind == 'verify' else kind} takes x "
                        f"{'[B, D]' if want_ndim == 2 else '[B, S, D]'}, got shape "
                        f"{tuple(x.shape)}{other}")
    b, k = x.shape[0], 1 if kind == "decode" else x.shape[1]
    if k == 0:
        raise StepError(f"{kind} of 0 rows: x has shape {tuple(x.shape)}; S must be at least 1")
    if kind in ("decode", "verify"):
        if not 1 <= k <= cfg.max_verify:
            raise StepError(f"a {k}-row verify does not fit max_verify {cfg.max_verify} "
                            f"(rows must be in [1, {cfg.max_verify}])")
        layout = RowLayout(rows=cfg.max_verify, k=k, squeeze=kind == "decode")
    else:
        layout = RowLayout(rows=k, k=k)
    if kind == "prefill":
        n_new = _rows_per_seq(b, k, counts, "num_tokens")
    else:
        n_new = _rows_per_seq(b, k, None, "")
        if counts is not None:
            n_new = n_new * _rows_per_seq(b, 1, counts, "active")
    if check:
        sel_shape = (b, cfg.sel_width) if layout.squeeze else (b, k, cfg.sel_width)
        if kind == "kv" and not weights.has_indexer:
            shared_sel = np.full(sel_shape, -1, np.int32)  # a drafter row selects nothing
        _check_step(cfg, weights, state, x, n_new, shared_sel, sel_shape)
    return layout, n_new


_step_jit = jax.jit(step, static_argnames=("cfg",), donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("state",))
def _layout_step(cfg: DsaConfig, layout: RowLayout, weights: DsaWeights, state: DsaState,
                 x: jax.Array, n_new: jax.Array, shared_sel: jax.Array | None):
    """Pad, step, unpad: one program per layout. The step sits between optimization barriers,
    so XLA neither sees that the padded rows are zero nor moves the unpad into the step: the
    step compiles to the same code in the decode program and in every K-row verify program
    (the bit-identity guarantee, tested with `==`)."""
    x, shared_sel = lax.optimization_barrier(layout.pad(x, shared_sel))
    y, state, sel = step(cfg, weights, state, x, n_new, shared_sel)
    y, sel = layout.unpad(*lax.optimization_barrier((y, sel)))
    return y, state, sel


# Row counts already on the device, by value: a decode loop passes the same few every step.
_COUNTS: dict[bytes, jax.Array] = {}


def _device_counts(n_new):
    if not isinstance(n_new, np.ndarray):
        return n_new  # traced, under the caller's jit
    key = n_new.astype(np.int32).tobytes()
    if key not in _COUNTS:
        if len(_COUNTS) >= 256:
            _COUNTS.clear()
        _COUNTS[key] = jnp.asarray(n_new, jnp.int32)
    return _COUNTS[key]


def _remember_step(before, state: DsaState, n_new) -> None:
    """Record the new state's lengths on the host when the old ones were known there."""
    if before is not None and isinstance(n_new, np.ndarray):
        lengths = before.lengths + n_new
        remember(state, lengths, lengths, before.block_tables)


def _public_step(cfg, weights, state, x, kind, counts, shared_sel, check):
    """Host side (`prepare_step`: checks on the host's copy of the lengths, no device read
    once it has one), then one dispatch: pad, step, unpad."""
    layout, n_new = prepare_step(cfg, weights, state, x, kind=kind, counts=counts,
                                 shared_sel=shared_sel, check=check)
    before = known(state)
    y, state, sel = _layout_step(cfg, layout, weights, state, x, _device_counts(n_new),
                                 shared_sel)
    _remember_step(before, state, n_new)
    if before is not None and weights.has_indexer:
        _vouch(sel, before.lengths)  # a shared layer may take it without a device read
    return y, state, sel


def prefill(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
            num_tokens=None, shared_sel: jax.Array | None = None, check: bool = True
            ) -> tuple[jax.Array, DsaState, jax.Array]:
    """Append a chunk of up to `S` tokens to every sequence; may be called repeatedly.

    x: [B, S, D]; num_tokens: [B] real rows per sequence (default S; rows past it are padding
    and never written or selected); shared_sel: [B, S, W] for a "shared" layer. Returns
    `y [B, S, D]` f32 (0 on padding rows), the new state (the old one is donated), and
    `sel [B, S, W]` int32, the selected token indices of every row (-1 padded;
    W = index_topk + index_kpool - 1 with the tail). `check=False` skips the host-side checks
    that read the state's lengths back (for a loop that validates on the host itself; writes
    out of range are then dropped, never performed).
    """
    return _public_step(cfg, weights, state, x, "prefill", num_tokens, shared_sel, check)


def decode_k(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
             active=None, shared_sel: jax.Array | None = None, check: bool = True
             ) -> tuple[jax.Array, DsaState, jax.Array]:
    """The K rows of a speculative verify: K consecutive tokens of every sequence.

    x: [B, K, D] with `K <= cfg.max_verify`; active: [B] bool, sequences that take part (the
    others write nothing and return zeros); shared_sel: [B, K, W]. Rows are padded to
    `cfg.max_verify`, so the result is bit-identical to K successive `decode` calls.
    Returns `y [B, K, D]`, the new state, `sel [B, K, W]`. `check`: as in `prefill`.
    """
    return _public_step(cfg, weights, state, x, "verify", active, shared_sel, check)


def decode(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
           active=None, shared_sel: jax.Array | None = None, check: bool = True
           ) -> tuple[jax.Array, DsaState, jax.Array]:
    """Append one token to every sequence (ragged: each at its own length).

    x: [B, D]; active: [B] bool (default all); shared_sel: [B, W] for a "shared" layer.
    Returns `y [B, D]` f32, the new state (the old one is donated), and `sel [B, W]` int32.
    `check`: as in `prefill`.
    """
    return _public_step(cfg, weights, state, x, "decode", active, shared_sel, check)


def rewind(cfg: DsaConfig, state: DsaState, lengths) -> DsaState:
    """Drop every row at or past `lengths [B]` (a rejected speculation).

    The latent slots and indexer rows past the new lengths become unreachable: selections only
    reach tokens below a row's position, and a pool key is rewritten when its pool completes
    again. Lengths may only shrink.
    """
    if not hasattr(lengths, "dtype"):
        lengths = np.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        shown = f" {np.asarray(lengths).tolist()}" if _is_concrete(lengths) else ""
        raise StepError(f"rewind lengths must be integers, got "
                        f"{jnp.dtype(lengths.dtype).name}{shown}")
    new = jnp.asarray(lengths, jnp.int32).reshape(-1)
    if new.shape != state.lengths.shape:
        raise StepError(f"rewind lengths have shape {tuple(new.shape)}, expected "
                        f"{tuple(state.lengths.shape)} (one per sequence)")
    if not (_is_concrete(lengths) and _is_concrete(state.lengths)):
        return state._replace(lengths=new, index_lengths=jnp.minimum(state.index_lengths, new))
    numbers = host_numbers(state)
    cur, want = numbers.lengths, np.asarray(lengths, np.int32).reshape(-1)
    bad = (want < 0) | (want > cur)
    if bad.any():
        s = int(np.argmax(bad))
        raise StepError(f"sequence {s}: cannot rewind to length {want[s]}; it must be in "
                        f"[0, {cur[s]}] (the current length)")
    out = state._replace(lengths=new, index_lengths=jnp.minimum(state.index_lengths, new))
    remember(out, want, np.minimum(numbers.index_lengths, want), numbers.block_tables)
    return out


def write_kv_rows(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                  n_new: jax.Array) -> DsaState:
    """A drafter's context rows `x [B, S, D]`: latent and indexer entries only (no query,
    selection or attend); pure and traceable like `step`."""
    state, _, _ = _write_rows(cfg, weights, state, project_kv(cfg, weights, x), n_new)
    return _advance(state, n_new)


_write_kv_rows_jit = jax.jit(write_kv_rows, static_argnames=("cfg",),
                             donate_argnames=("state",))


def write_kv_row(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
                 active=None) -> DsaState:
    """A drafter's context row(s): latent and indexer entry only; no query, selection or attend.

    x: [B, D] (one row per sequence) or [B, S, D]; active: [B] bool. Returns the new state.
    """
    if x.ndim == 2:
        x = x[:, None]
    _, n_new = prepare_step(cfg, weights, state, x, kind="kv", counts=active)
    before = known(state)
    state = _write_kv_rows_jit(cfg, weights, state, x, _device_counts(n_new))
    _remember_step(before, state, n_new)
    return state
