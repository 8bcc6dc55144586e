"""The block's step over a `(dp, tp)` mesh: traceable pieces and the host-side entry points.

Per device the step is `layer.step` on its dp shard's sequences with its tp rank's heads; the
`psum` of `y` over `tp` (each rank's o_proj partial sum) is its main collective. The indexer's
projections run on every rank of a dp shard from the same inputs through GEMMs whose shapes do
not depend on the tp degree (weights.py); the state's writes are the same on every rank.

The selection (pool scores and top-k, per row) is either replicated (every rank selects for
all the shard's sequences) or split (`split_selection`): rank i scores and top-k's only its
1/tp of the shard's sequences (the score kernel launches programs for those sequences only:
`pool_scores(..., seqs=(first, count))`), then one all-gather over tp of the chosen pool ids
`[b, R, k]` gives every rank the whole selection. A rank's rows get the bits of the whole
shard's score program (XLA's twin, whose dots' last bits depend on the batch shape, computes
at the shard's full shape and slices) and a row's top-k depends on that row's scores only, so
`sel` is bitwise the same either way.

Three levels:
- `local_step`: the body of a `shard_map` (for a caller that maps its own function, e.g. a
  model step over all layers: call it once per layer).
- `sharded_step`: `local_step` mapped over the mesh; pure and traceable, arrays already placed
  (`layout.py`), so it runs inside the caller's `jax.jit` / `lax.scan` with no host transfer.
- `dp_tp_prefill`, `dp_tp_decode`, `dp_tp_decode_k`: like `dsa_jax.prefill` / `decode` /
  `decode_k` (host checks, row padding, one jitted step with the state donated).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from dsa_jax import layer
from dsa_jax.bitwise import bitwise_jit
from dsa_jax.config import DsaConfig
from dsa_jax.indexer import pool_scores
from dsa_jax.layer import RowLayout, StepError, candidate_pools, prepare_step
from dsa_jax.select import top_pools
from dsa_jax.sharding.layout import (
    ROW_SPEC,
    STATE_SPECS,
    TP,
    WEIGHT_SPEC,
    ShardingError,
    check_config,
    degrees,
    put,
    row_sharding,
)
from dsa_jax.state import DsaState, ring_mark_after_rewind
from dsa_jax.step_checks import check_rewind
from dsa_jax.weights import DsaWeights


def rank_weights(weights_block: DsaWeights) -> DsaWeights:
    """Inside `shard_map`: the `[1, ...]` block of the stacked weights -> this rank's weights."""
    return jax.tree_util.tree_map(lambda a: a[0], weights_block)


def reduce_heads(cfg: DsaConfig, y: jax.Array) -> jax.Array:
    """Inside `shard_map`: this rank's partial output (o_proj over its heads) -> the block's
    output, summed over tp: the step's one collective. At tp = 1 nothing is emitted. A model
    that composes the block itself calls this on each layer's `output_projection`."""
    return lax.psum(y, TP) if cfg.tp_degree > 1 else y


# Fewest sequences per tp rank for which the default rule splits the selection. On the H200
# the pool scores grow with the batch (the split halves them), the top-k barely does below 32
# sequences (one program per row), and the all-gather has a fixed cost: a clear gain at 32 per
# rank, about even near 8 (docs/performance.md).
SPLIT_MIN_SEQS_PER_RANK = 16


def split_rule(cfg: DsaConfig, local_seqs: int, split_selection: bool | None = None) -> bool:
    """Whether a dp shard of `local_seqs` sequences splits its selection over the tp ranks:
    `split_selection` if given (True needs `local_seqs` to be a multiple of tp), else split
    where the sequences divide evenly and each rank gets at least `SPLIT_MIN_SEQS_PER_RANK`."""
    tp = cfg.tp_degree
    if split_selection is None:
        return tp > 1 and local_seqs % tp == 0 and local_seqs // tp >= SPLIT_MIN_SEQS_PER_RANK
    if split_selection and tp > 1 and local_seqs % tp:
        raise ShardingError(f"split_selection=True: a dp shard's {local_seqs} sequences do not "
                            f"split over tp={tp} ranks (they must be a multiple of tp)")
    return bool(split_selection) and tp > 1


def split_select(cfg: DsaConfig, qi: jax.Array, w: jax.Array, pool_keys: jax.Array,
                 pos: jax.Array, valid: jax.Array) -> jax.Array:
    """Inside `shard_map`: `layer.select_pools` with the rows split over tp by sequence
    (same arguments; `B` a multiple of tp). Returns every row's pool ids `[B, R, k]`, bitwise
    those of `select_pools`: the score kernel runs for this rank's sequences only
    (`seqs=(rank * n, n)`), each row's scores the bits of the whole batch's program, and a
    row's top-k depends on its scores only."""
    b, tp = qi.shape[0], cfg.tp_degree
    n = b // tp
    first = lax.axis_index(TP) * n
    scores = pool_scores(cfg, qi, w, pool_keys, candidate_pools(cfg, pos, valid),
                         seqs=(first, n))  # [n, R, P]
    pools = top_pools(cfg, scores)  # [n, R, k]
    return lax.all_gather(pools, TP, axis=0, tiled=True)  # [B, R, k]


def local_step(cfg: DsaConfig, weights_block: DsaWeights, state: DsaState, x: jax.Array,
               n_new: jax.Array | int | None = None, shared_sel: jax.Array | None = None, *,
               out_rows: int | None = None, split_selection: bool | None = None
               ) -> tuple[jax.Array, DsaState, jax.Array]:
    """One device's step, inside `shard_map` over a `mesh(dp, tp)` with the specs of
    `layout.py` (weights `WEIGHT_SPEC`, state `STATE_SPECS`, rows `ROW_SPEC`).

    x: [b, R, D] this shard's rows (padded as for `layer.step`); n_new: [b] int32, or an int
    for every sequence (built on the device), default R; shared_sel: [b, R, W].
    out_rows: keep only the first rows of `y` and `sel` (a decode's 1 of max_verify): the psum
    then moves only those, and the gather-attend runs on those rows only (`layer.step`'s
    attend_rows; the rows past them are dropped anyway, their writes still made). The rest of the
    step is the same program whatever out_rows is (a barrier keeps XLA from narrowing it), so
    a decode and a K-row verify keep their bits.
    split_selection: split the rows' selection over the tp ranks (`split_rule`; None: its
    default rule); `sel` is the same either way.
    Returns `y [b, out_rows, D]` (summed over tp), the new state and `sel [b, out_rows, W]`.
    """
    if n_new is None or isinstance(n_new, int):
        n_new = jnp.full((x.shape[0],), x.shape[1] if n_new is None else n_new, jnp.int32)
    select = (split_select if split_rule(cfg, x.shape[0], split_selection)
              else layer.select_pools)
    y, state, sel = layer.step(cfg, rank_weights(weights_block), state, x, n_new, shared_sel,
                               select=select, attend_rows=out_rows)
    if out_rows is not None and out_rows < x.shape[1]:
        y, sel = lax.optimization_barrier((y, sel))
        y, sel = y[:, :out_rows], sel[:, :out_rows]
    return reduce_heads(cfg, y), state, sel


@functools.cache
def _mapped(cfg: DsaConfig, m: Mesh, count, has_n_new: bool, has_shared: bool,
            out_rows: int | None, split_selection: bool | None):
    def body(weights, state, x, n_new, shared_sel):
        return local_step(cfg, weights, state, x, n_new if has_n_new else count, shared_sel,
                          out_rows=out_rows, split_selection=split_selection)

    return jax.shard_map(
        body, mesh=m,
        in_specs=(WEIGHT_SPEC, STATE_SPECS, ROW_SPEC, ROW_SPEC if has_n_new else None,
                  ROW_SPEC if has_shared else None),
        out_specs=(ROW_SPEC, STATE_SPECS, ROW_SPEC),
        # y is summed over tp; state and sel are equal on every tp rank by construction.
        check_vma=False)


def _check_shapes(cfg: DsaConfig, m: Mesh, weights: DsaWeights, state: DsaState,
                  x: jax.Array) -> None:
    dp, tp = check_config(cfg, m)
    lead = weights.x_proj.shape[0]
    if weights.x_proj.ndim != 3 or lead != tp:
        raise ShardingError(f"weights.x_proj has shape {tuple(weights.x_proj.shape)}; expected "
                            f"the ranks stacked on a leading axis of {tp} (shard_weights)")
    b = state.num_seqs
    if x.ndim != 3 or x.shape[0] != b:
        raise StepError(f"x has shape {tuple(x.shape)}; expected [B={b}, R, D] rows (the "
                        f"sequences in the state)")
    if b % dp or state.latent.shape[0] % dp:
        raise ShardingError(f"{b} sequences and {state.latent.shape[0]} blocks must both be "
                            f"multiples of dp={dp}")


def sharded_step(cfg: DsaConfig, m: Mesh, weights: DsaWeights, state: DsaState, x: jax.Array,
                 n_new: jax.Array | int | None = None, shared_sel: jax.Array | None = None, *,
                 out_rows: int | None = None, split_selection: bool | None = None
                 ) -> tuple[jax.Array, DsaState, jax.Array]:
    """`layer.step` over the mesh, for arrays already placed (`shard_weights`, `init_state` /
    `shard_state`, rows with `row_sharding`); pure and traceable: call it inside your own
    `jax.jit` (donate the state) or `lax.scan`, with no host transfer per step.

    x: [B, R, D] padded rows (B = all sequences of the mesh); n_new: [B] int32 (split like the
    rows), or an int for every sequence (no array at all), default R. split_selection: see
    `split_rule` (None: its default). Returns `y [B, out_rows, D]` f32 (default R rows), the
    new state and `sel [B, out_rows, W]`.
    """
    _check_shapes(cfg, m, weights, state, x)
    split_rule(cfg, x.shape[0] // degrees(m)[0], split_selection)  # raises before tracing
    has_n_new = n_new is not None and not isinstance(n_new, int)
    count = None if has_n_new else n_new
    f = _mapped(cfg, m, count, has_n_new, shared_sel is not None, out_rows, split_selection)
    return f(weights, state, x, n_new if has_n_new else None, shared_sel)


def _step_impl(cfg, m, weights, state, x, n_new, shared_sel, count, out_rows, split):
    return sharded_step(cfg, m, weights, state, x, count if n_new is None else n_new,
                        shared_sel, out_rows=out_rows, split_selection=split)


_step_jit = bitwise_jit(_step_impl, static_argnames=("cfg", "m", "count", "out_rows", "split"),
                    donate_argnames=("state",))


@functools.cache
def _pad_jit(layout: RowLayout, m: Mesh, has_shared: bool):
    rows = row_sharding(m)
    return jax.jit(layout.pad, out_shardings=(rows, rows if has_shared else None))


def _local_rows(a: jax.Array) -> dict[int, np.ndarray]:
    """This process's pieces of a `[B, ...]` array split along dp: first row -> values."""
    out = {}
    for shard in a.addressable_shards:
        start = shard.index[0].start or 0
        if start not in out:
            out[start] = np.asarray(shard.data)
    return out


def _check_shards(cfg, m, weights, state, x, kind, counts, shared_sel) -> None:
    """`prepare_step`'s checks, per dp shard held by this process, on the shard's own view
    (its sequences, its block pool, its shard-local block tables)."""
    dp, _ = degrees(m)
    b, nb = state.num_seqs, state.latent.shape[0]
    bl, nbl = b // dp, nb // dp
    lengths, index_lengths, tables = (_local_rows(a) for a in (
        state.lengths, state.index_lengths, state.block_tables))
    counts = None if counts is None else np.asarray(counts)
    for start in sorted(lengths):
        view = DsaState(latent=jax.ShapeDtypeStruct((nbl, *state.latent.shape[1:]),
                                                    state.latent.dtype),
                        kv_scale=None, block_tables=tables[start], index_k=None, index_g=None,
                        pool_keys=None, lengths=lengths[start],
                        index_lengths=index_lengths[start])
        xs = jax.ShapeDtypeStruct((bl, *x.shape[1:]), x.dtype)
        ss = (None if shared_sel is None else
              jax.ShapeDtypeStruct((bl, *shared_sel.shape[1:]), shared_sel.dtype))
        cs = None if counts is None else counts.reshape(-1)[start:start + bl]
        try:
            prepare_step(cfg, weights, view, xs, kind=kind, counts=cs, shared_sel=ss, check=True)
        except StepError as e:
            raise StepError(f"dp shard {start // bl} (sequences {start}..{start + bl - 1}; "
                            f"sequence numbers below count from {start}, block ids are the "
                            f"shard's own, < {nbl}): {e}") from None


def _host_step(cfg, m, weights, state, x, kind, counts, shared_sel, check, split):
    if x.ndim >= 1 and x.shape[0] != state.num_seqs:
        raise StepError(f"x has shape {tuple(x.shape)}; expected leading dim "
                        f"{state.num_seqs} (sequences in the state)")
    dp, _ = check_config(cfg, m)
    split_rule(cfg, state.num_seqs // dp, split)
    layout, n_new = prepare_step(cfg, weights, state, x, kind=kind, counts=counts,
                                 shared_sel=shared_sel, check=False)
    if check:
        _check_shards(cfg, m, weights, state, x, kind, counts, shared_sel)
    rows = row_sharding(m)
    x = put(x, rows)
    shared_sel = None if shared_sel is None else put(shared_sel, rows)
    if layout.rows != layout.k or layout.squeeze:
        x, shared_sel = _pad_jit(layout, m, shared_sel is not None)(x, shared_sel)
    # Every sequence takes all k rows unless counts say otherwise: then no array is sent.
    n_new = None if counts is None else put(np.asarray(n_new, np.int32), rows)
    out_rows = None if layout.k == layout.rows else layout.k
    y, state, sel = _step_jit(cfg, m, weights, state, x, n_new, shared_sel, count=layout.k,
                              out_rows=out_rows, split=split)
    if layout.squeeze:
        y, sel = y[:, 0], sel[:, 0]
    return y, state, sel


def dp_tp_prefill(cfg: DsaConfig, m: Mesh, weights: DsaWeights, state: DsaState, x, *,
                  num_tokens=None, shared_sel=None, check: bool = True,
                  split_selection: bool | None = None
                  ) -> tuple[jax.Array, DsaState, jax.Array]:
    """`dsa_jax.prefill` over the mesh: x [B, S, D] (host or device; the same value in every
    process), num_tokens [B]; `y`, `sel` come back split along dp, the state donated.
    split_selection: see `split_rule` (None: its default; `sel` is the same either way)."""
    return _host_step(cfg, m, weights, state, x, "prefill", num_tokens, shared_sel, check,
                      split_selection)


def dp_tp_decode(cfg: DsaConfig, m: Mesh, weights: DsaWeights, state: DsaState, x, *,
                 active=None, shared_sel=None, check: bool = True,
                 split_selection: bool | None = None
                 ) -> tuple[jax.Array, DsaState, jax.Array]:
    """`dsa_jax.decode` over the mesh: x [B, D]; active [B] bool."""
    return _host_step(cfg, m, weights, state, x, "decode", active, shared_sel, check,
                      split_selection)


def dp_tp_decode_k(cfg: DsaConfig, m: Mesh, weights: DsaWeights, state: DsaState, x, *,
                   active=None, shared_sel=None, check: bool = True,
                   split_selection: bool | None = None
                   ) -> tuple[jax.Array, DsaState, jax.Array]:
    """`dsa_jax.decode_k` over the mesh: x [B, K, D] (or [B, D]: a decode). Bit-identical to
    K successive `dp_tp_decode` calls (the same padded step program)."""
    kind = "decode" if x.ndim == 2 else "verify"
    return _host_step(cfg, m, weights, state, x, kind, active, shared_sel, check,
                      split_selection)


# The tensor-parallel names of the first release: the same functions (a dp=1 mesh).
tp_prefill = dp_tp_prefill
tp_decode_k = dp_tp_decode_k

_minimum = jax.jit(jnp.minimum)


def rewind(cfg: DsaConfig, state: DsaState, lengths) -> DsaState:
    """`dsa_jax.rewind` for a state on a mesh: lengths [B] (host, the same in every process)
    are placed like `state.lengths` (no per-call move of a one-device array), and checked
    against this process's shards. Traced lengths go straight to `layer.rewind`."""
    if isinstance(lengths, jax.core.Tracer) or isinstance(state.lengths, jax.core.Tracer):
        return layer.rewind(cfg, state, lengths)
    new = np.asarray(jax.device_get(lengths)).astype(np.int32).reshape(-1)
    if new.shape != tuple(state.lengths.shape):
        raise StepError(f"rewind lengths have shape {new.shape}, expected "
                        f"{tuple(state.lengths.shape)} (one per sequence)")
    ring = state.index_k.shape[1] > 0  # an indexer's ring keeps its mark (dsa_jax.state)
    marks = _local_rows(state.index_lengths)
    for start, cur in _local_rows(state.lengths).items():
        check_rewind(cfg, cur, marks[start], new[start:start + len(cur)], ring, start)
    placed = put(new, state.lengths.sharding)
    return state._replace(lengths=placed, index_lengths=(
        ring_mark_after_rewind(cfg, placed, state.index_lengths) if ring
        else _minimum(state.index_lengths, placed)))
