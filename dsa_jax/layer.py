"""The public entry points, pure functions over the state pytree: `prefill`, `decode`,
`decode_k` (a speculative verify), `rewind`, `write_kv_row` (a drafter's context row).

All append rows to every sequence through one jitted step whose shapes are fixed by the
config's ceiling (live extents are data), so one compile serves every context length, and all
donate the state so the caches are updated in place (the public calls donate the fields a
step changes; the new state shares the scale and block tables with the old one). `decode`
and `decode_k` pad each sequence's rows to `cfg.max_verify`, so a K-row verify and K serial
decodes run the same shapes, hence the same per-row reductions: bit-identical results (under
the row-invariant GEMMs, `implementation.row_gemms`, whose rows have the same bits at any row
count, a decode runs its one row: `decode_rows`).

Two public pieces serve every caller (these functions, the NNX module, the sharded steps,
the engine): `prepare_step` (host side: row layout, row counts, checks) and `step` (the pure,
traceable step over padded rows, `dsa_jax.step`).

Checks: before the jitted step runs, `prepare_step` validates on the host everything the
caller's concrete state can tell (shapes and dtypes of x, the weights and the state against
the config; capacity; every block the step reads, i.e. all blocks below `length + n_new`,
mapped and mapped once; indexer lockstep; `shared_sel` ids at or before their row's
position) and raises with the value and the limit (docs/errors.md); nothing has been written
then, and the caller's state is untouched. `check=False` skips them (for a loop that validates
on the host itself); the step then still never writes out of bounds: writes past the caches
are dropped in every implementation. Called inside the caller's trace (`jax.jit(decode)`),
these calls run `dsa_jax.serving_step` inline: the same bits, its checks on the device.
"""


from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_jax.bitwise import bitwise_jit
from dsa_jax.config import DsaConfig
from dsa_jax.implementation import resolve, row_gemms
from dsa_jax.mirror import host_numbers, known, remember
from dsa_jax.prompt_chunk import largest_chunk
from dsa_jax.state import DsaState, ring_mark_after, ring_mark_after_rewind
from dsa_jax.step import candidate_pools, select_pools, step, write_kv_rows
from dsa_jax.step_checks import (
    StepError,
    check_live,
    check_out,
    check_rewind,
    check_step,
    check_types,
    is_concrete,
    rows_per_seq,
    vouch,
)
from dsa_jax.weights import DsaWeights

__all__ = ["MOVING_FIELDS", "RowLayout", "StepError", "candidate_pools", "decode", "decode_k",
           "decode_rows", "dispatch_step", "layout_step", "padded_step", "prefill", "prepare_step",
           "public_program", "rewind", "select_pools", "step", "write_kv_row"]


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How a call's rows map onto the step's rows (static: part of the compiled program).

    rows: rows per sequence the step runs (`decode_rows`: `cfg.max_verify` for a decode or
    verify, so K serial decodes and one K-row verify run the same shapes: the bit-identity
    guarantee; 1 for a decode under row-invariant GEMMs); k: the call's real rows per
    sequence; squeeze: a decode (x [B, D], outputs [B, ...]).
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


STEP_KINDS = ("prefill", "decode", "verify", "kv")


def decode_rows(cfg: DsaConfig, kind: str) -> int:
    """Rows per sequence a "decode" or "verify" step runs: `cfg.max_verify`, so that K serial
    decodes and one K-row verify run the same shapes (XLA's GEMMs give a row other bits at
    another row count); a decode's own row under `row_gemms` (row-invariant GEMMs: a row has
    the same bits at any row count, as have the kernels after them)."""
    return 1 if kind == "decode" and row_gemms(cfg) else cfg.max_verify


# One object per layout: the jitted step takes it as a static argument, and the same object
# every call is the cheapest cache hit there is.
_row_layout = functools.cache(RowLayout)


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
        layout = _row_layout(decode_rows(cfg, kind), k, kind == "decode")
    else:
        layout = _row_layout(k, k, False)
    if kind == "prefill":
        n_new = rows_per_seq(b, k, counts, "num_tokens")
    else:
        n_new = rows_per_seq(b, k, None, "")
        if counts is not None:
            n_new = n_new * rows_per_seq(b, 1, counts, "active")
    if check:
        sel_shape = (b, cfg.sel_width) if layout.squeeze else (b, k, cfg.sel_width)
        if kind == "kv" and not weights.has_indexer:
            shared_sel = np.full(sel_shape, -1, np.int32)  # a drafter row selects nothing
        check_step(cfg, weights, state, x, n_new, shared_sel, sel_shape)
    return layout, n_new


def padded_step(cfg: DsaConfig, layout: RowLayout, weights: DsaWeights, state: DsaState,
                 x: jax.Array, n_new: jax.Array, shared_sel: jax.Array | None):
    """Pad, step, unpad: one program per layout (what `decode`, `decode_k` and `prefill`
    dispatch after `prepare_step`). The step sits between optimization barriers,
    so XLA neither sees that the padded rows are zero nor moves the unpad into the step: the
    step compiles to the same code in the decode program and in every K-row verify program
    (the bit-identity guarantee, tested with `==`), but for the gather-attend, which runs on
    the call's k rows only (`attend_first_rows`: per-row kernels, the same bits per row)."""
    x, shared_sel = lax.optimization_barrier(layout.pad(x, shared_sel))
    y, state, sel = step(cfg, weights, state, x, n_new, shared_sel, attend_rows=layout.k)
    y, sel = layout.unpad(*lax.optimization_barrier((y, sel)))
    return y, state, sel


layout_step = bitwise_jit(padded_step, static_argnames=("cfg", "layout"),
                          donate_argnames=("state",))

# The state fields a step changes. The public calls donate and return only these: the scale
# and the block tables pass through unchanged, so the new state shares them (two fewer
# donated buffers and outputs for the runtime to handle per call).
MOVING_FIELDS = ("latent", "index_k", "index_g", "pool_keys", "lengths", "index_lengths")


def public_program(cfg: DsaConfig, layout: RowLayout, with_out: bool = False):
    """The jitted program of the public calls for one (config, layout): `padded_step` with
    both bound rather than static arguments (no hashing of them per call), the changing state
    fields donated and returned. Arguments `(weights, kv_scale, block_tables, moving, x,
    n_new, shared_sel)`, `moving` the state's `MOVING_FIELDS` fields in that order, and with
    `with_out` two more, donated: the buffers y and sel are written into; returns `(y, moving,
    sel)`. `dispatch_step` calls it. One program per distinct (config, layout, with_out)."""
    return _public_program(cfg, layout, bool(with_out))


@functools.lru_cache(maxsize=64)
def _public_program(cfg: DsaConfig, layout: RowLayout, with_out: bool):
    def run(weights, kv_scale, block_tables, moving, x, n_new, shared_sel, *out):
        state = DsaState(kv_scale=kv_scale, block_tables=block_tables,
                         **dict(zip(MOVING_FIELDS, moving, strict=True)))
        y, state, sel = padded_step(cfg, layout, weights, state, x, n_new, shared_sel)
        return y, tuple(getattr(state, f) for f in MOVING_FIELDS), sel

    if with_out:  # kept, so that XLA writes y and sel into them (same shapes and dtypes)
        return bitwise_jit(run, donate_argnums=(3, 7, 8), keep_unused=True)
    return bitwise_jit(run, donate_argnums=(3,))


# (id(cfg), id(layout), with_out) -> (cfg, layout, program): the program found by identity,
# as a loop passes the same config object every call (layouts are interned, `_row_layout`);
# the entry holds both, so their ids cannot be reused while it lives.
_PROGRAMS: dict[tuple[int, int, bool], tuple] = {}
# The state's fields in order: the latent (moving), the two shared ones, the other moving ones.
if DsaState._fields != (MOVING_FIELDS[0], "kv_scale", "block_tables", *MOVING_FIELDS[1:]):
    raise ImportError(f"DsaState fields {DsaState._fields} no longer match MOVING_FIELDS")


def _program(cfg: DsaConfig, layout: RowLayout, with_out: bool):
    key = (id(cfg), id(layout), with_out)
    entry = _PROGRAMS.get(key)
    if entry is None or entry[0] is not cfg or entry[1] is not layout:
        if len(_PROGRAMS) >= 64:
            _PROGRAMS.clear()
        entry = _PROGRAMS[key] = (cfg, layout, public_program(cfg, layout, with_out))
    return entry[2]


def dispatch_step(cfg: DsaConfig, layout: RowLayout, weights: DsaWeights, state: DsaState,
                  x: jax.Array, n_new: jax.Array, shared_sel: jax.Array | None,
                  out: tuple[jax.Array, jax.Array] | None = None
                  ) -> tuple[jax.Array, DsaState, jax.Array]:
    """What `decode`, `decode_k` and `prefill` dispatch after `prepare_step` (no checks): one
    call of `public_program`, `(y, new state, sel)` as `layout_step` returns them, bitwise;
    the old state's changing fields are donated, its scale and block tables shared, and `out`
    (y's and sel's buffers, see `decode`) donated too."""
    prog = _program(cfg, layout, out is not None)
    moving = (state.latent, state.index_k, state.index_g, state.pool_keys, state.lengths,
              state.index_lengths)
    args = (weights, state.kv_scale, state.block_tables, moving, x, n_new, shared_sel,
            *(out or ()))
    y, m, sel = prog(*args)
    return y, DsaState(m[0], state.kv_scale, state.block_tables, *m[1:]), sel


# Row counts already on the device, by value: a decode loop passes the same few every step.
_COUNTS: dict[bytes, jax.Array] = {}


def _device_counts(n_new):
    if not isinstance(n_new, np.ndarray):
        return n_new  # traced, under the caller's jit
    key = n_new.astype(np.int32).tobytes()
    if key not in _COUNTS:
        counts = jnp.asarray(n_new, jnp.int32)
        if isinstance(counts, jax.core.Tracer):
            return counts  # made inside a trace: never cached (it dies with the trace)
        if len(_COUNTS) >= 256:
            _COUNTS.clear()
        _COUNTS[key] = counts
    return _COUNTS[key]


def _remember_step(cfg: DsaConfig, before, state: DsaState, n_new, rows: int) -> None:
    """Record the new state's lengths on the host when the old ones were known there, and
    the checks' slack less the `rows` per sequence the step took at most (dsa_jax.mirror)
    while the indexer ring keeps pace (marks == lengths: then neither the ring check nor the
    indexer-behind check can fail before the slack is used up; any other mark is checked in
    full next step). Marks equal to the lengths are recorded as the same array, so the next
    step knows the ring keeps pace by identity, with no arithmetic."""
    if before is None or not isinstance(n_new, np.ndarray):
        return
    lengths = before.lengths + n_new
    lengths.setflags(write=False)
    if before.index_lengths is before.lengths or not state.index_k.shape[1]:
        marks = lengths  # ring_mark_after with marks == lengths gives lengths + n_new
    else:
        marks = ring_mark_after(cfg, before.lengths, before.index_lengths, n_new)
        if np.array_equal(marks, lengths):
            marks = lengths
    slack = None
    if before.slack is not None and marks is lengths:
        slack = before.slack - rows
    remember(state, lengths, marks, before.block_tables, slack)


def _traced_step(cfg, weights, state, x, kind, counts, shared_sel, out):
    """A public call inside the caller's trace (`jax.jit(dsa_jax.decode)`, a scan): the host
    sees no values, so it runs `dsa_jax.serving_step` (the same bits, its checks on the
    device) inline in the caller's program."""
    from dsa_jax.serving_step import serving_step  # that module builds on this one

    if out is not None:
        raise StepError("out= buffers need the eager call; inside jax.jit XLA places the "
                        "outputs itself: drop out=")
    rows = 1 if kind == "decode" else x.shape[1]
    counts_kw = {"num_tokens": counts} if kind == "prefill" else {"active": counts}
    return serving_step(cfg, kind, rows=rows)(weights, state, x, shared_sel=shared_sel,
                                              **counts_kw)


def _public_step(cfg, weights, state, x, kind, counts, shared_sel, check, out=None):
    """Host side (`prepare_step`: checks on the host's copy of the lengths, no device read
    once it has one; `out` checked), then one dispatch: pad, step, unpad. Inside a trace:
    `_traced_step`."""
    check_types(cfg, weights, state)
    if not hasattr(x, "ndim"):  # a list or tuple of numbers
        x = np.asarray(x)
    if any(isinstance(a, jax.core.Tracer) for a in (x, *state, *weights) if a is not None):
        return _traced_step(cfg, weights, state, x, kind, counts, shared_sel, out)
    check_live(state)
    layout, n_new = prepare_step(cfg, weights, state, x, kind=kind, counts=counts,
                                 shared_sel=shared_sel, check=check)
    if kind == "prefill" and resolve(cfg.implementation) != "xla":
        chunk = largest_chunk(cfg, state.num_seqs, state.latent.shape[0], x.shape[1])
        if chunk < x.shape[1]:
            return _prefill_in_chunks(cfg, weights, state, x, n_new, shared_sel, check, chunk)
    if out is not None:
        out = check_out(cfg, x, out, (weights, state, x, shared_sel))
    before = known(state)
    y, state, sel = dispatch_step(cfg, layout, weights, state, x, _device_counts(n_new),
                                  shared_sel, out)
    _remember_step(cfg, before, state, n_new, layout.k)
    if before is not None and weights.has_indexer:
        vouch(sel, before.lengths)  # a shared layer may take it without a device read
    return y, state, sel


def _prefill_in_chunks(cfg, weights, state, x, n_new, shared_sel, check, chunk):
    """A prefill too wide for the kernels' addressing (`dsa_jax.prompt_chunk`) as prefills of
    `chunk` rows, `y` and `sel` joined: a chunked prefill (the selections of one prefill, the
    outputs within fp32 rounding)."""
    ys, sels = [], []
    for lo in range(0, x.shape[1], chunk):
        part = np.clip(np.asarray(n_new) - lo, 0, chunk).astype(np.int32)  # [B] rows here
        sel_part = None if shared_sel is None else shared_sel[:, lo:lo + chunk]
        y, state, sel = _public_step(cfg, weights, state, x[:, lo:lo + chunk], "prefill", part,
                                     sel_part, check)
        ys.append(y), sels.append(sel)
    return jnp.concatenate(ys, axis=1), state, jnp.concatenate(sels, axis=1)


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
             active=None, shared_sel: jax.Array | None = None, check: bool = True,
             out: tuple[jax.Array, jax.Array] | None = None
             ) -> tuple[jax.Array, DsaState, jax.Array]:
    """The K rows of a speculative verify: K consecutive tokens of every sequence.

    x: [B, K, D] with `K <= cfg.max_verify`; active: [B] bool, sequences that take part (the
    others write nothing and return zeros); shared_sel: [B, K, W]. Rows are padded to
    `cfg.max_verify`, so the result is bit-identical to K successive `decode` calls.
    Returns `y [B, K, D]`, the new state, `sel [B, K, W]`. `check`: as in `prefill`; `out`:
    as in `decode`, `(y [B, K, D] f32, sel [B, K, W] int32)`.
    """
    return _public_step(cfg, weights, state, x, "verify", active, shared_sel, check, out)


def decode(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
           active=None, shared_sel: jax.Array | None = None, check: bool = True,
           out: tuple[jax.Array, jax.Array] | None = None
           ) -> tuple[jax.Array, DsaState, jax.Array]:
    """Append one token to every sequence (ragged: each at its own length).

    x: [B, D]; active: [B] bool (default all); shared_sel: [B, W] for a "shared" layer.
    Returns `y [B, D]` f32, the new state (the old one is donated), and `sel [B, W]` int32.
    `check`: as in `prefill`. `out`: optional buffers `(y [B, D] f32, sel [B, W] int32)` the
    results are written into, donated like the state (e.g. the previous call's y and sel,
    once read): a loop that passes them back keeps every buffer of the program in place, so
    XLA need not update its command buffer (CUDA graph) for new output addresses each call.
    """
    return _public_step(cfg, weights, state, x, "decode", active, shared_sel, check, out)


def rewind(cfg: DsaConfig, state: DsaState, lengths) -> DsaState:
    """Drop every row at or past `lengths [B]` (a rejected speculation).

    The latent slots and indexer rows past the new lengths become unreachable: selections only
    reach tokens below a row's position, and a pool key is rewritten when its pool completes
    again. Lengths may only shrink, and only as far as the indexer ring still holds the raw
    rows of the pool the new length falls in (`dsa_jax.state.ring_holds`: any rewind of at most
    `ring_reach(cfg)` rows below the ring's mark, or to a pool boundary); otherwise
    `StepError` names the limit, before anything changes. Traced lengths (under the caller's
    jit) are not checked: keeping within the reach is then the caller's contract.
    """
    if not hasattr(lengths, "dtype"):
        lengths = np.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        shown = f" {np.asarray(lengths).tolist()}" if is_concrete(lengths) else ""
        raise StepError(f"rewind lengths must be integers, got "
                        f"{jnp.dtype(lengths.dtype).name}{shown}")
    new = jnp.asarray(lengths, jnp.int32).reshape(-1)
    if new.shape != state.lengths.shape:
        raise StepError(f"rewind lengths have shape {tuple(new.shape)}, expected "
                        f"{tuple(state.lengths.shape)} (one per sequence)")
    ring = state.index_k is not None and state.index_k.shape[1] > 0
    # A ring keeps its mark (it says how far the ring still reaches; `ring_mark_after_rewind`
    # bounds it); no ring: lockstep.
    marks = (ring_mark_after_rewind(cfg, new, state.index_lengths) if ring
             else jnp.minimum(state.index_lengths, new))
    if not (is_concrete(lengths) and is_concrete(state.lengths)):
        return state._replace(lengths=new, index_lengths=marks)
    numbers = host_numbers(state)
    want = np.asarray(lengths, np.int32).reshape(-1)
    check_rewind(cfg, numbers.lengths, numbers.index_lengths, want, ring)
    out = state._replace(lengths=new, index_lengths=marks)
    remember(out, want, ring_mark_after_rewind(cfg, want, numbers.index_lengths) if ring else
             np.minimum(numbers.index_lengths, want), numbers.block_tables)
    return out


_write_kv_rows_jit = bitwise_jit(write_kv_rows, static_argnames=("cfg",),
                             donate_argnames=("state",))


def write_kv_row(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
                 active=None) -> DsaState:
    """A drafter's context row(s): latent and indexer entry only; no query, selection or attend.

    x: [B, D] (one row per sequence) or [B, S, D]; active: [B] bool. Returns the new state.
    """
    check_types(cfg, weights, state)
    check_live(state)
    if not hasattr(x, "ndim"):  # a list or tuple of numbers
        x = np.asarray(x)
    if x.ndim == 2:
        x = x[:, None]
    layout, n_new = prepare_step(cfg, weights, state, x, kind="kv", counts=active)
    before = known(state)
    state = _write_kv_rows_jit(cfg, weights, state, x, _device_counts(n_new))
    _remember_step(cfg, before, state, n_new, layout.k)
    return state
