"""The public entry points: `prefill` and `decode`, pure functions over the state pytree.

Both append rows to every sequence through one jitted step, `_append_rows`, whose shapes are
fixed by the config's ceiling (live extents are data), so one compile serves every context
length. Decode pads each sequence's row to `cfg.max_verify` rows so that a K-row verify and K
serial decodes run the same shapes, hence the same per-row reductions.

Checks: before the jitted step runs, `_check_step` validates on the host everything the
caller's concrete state can tell (capacity, block-table coverage, indexer lockstep) and
raises with the value and the limit; nothing has been written then, and the caller's state
is untouched. Under an outer `jax.jit` the lengths are traced and these host checks cannot
run; the step then still never writes out of bounds (out-of-range writes are dropped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.attend import attend, write_latents
from dsa_jax.config import DsaConfig
from dsa_jax.indexer import pool_scores, write_index_rows
from dsa_jax.projection import output_projection, project
from dsa_jax.select import expand_selection, top_pools
from dsa_jax.state import DsaState
from dsa_jax.weights import DsaWeights


class StepError(ValueError):
    """A step's inputs do not fit the state; raised before anything is written."""


def _append_rows(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                 n_new: jax.Array, shared_sel: jax.Array | None
                 ) -> tuple[jax.Array, DsaState, jax.Array]:
    """Append rows `x [B, R, D]` (the first `n_new [B]` of each sequence are real).

    Order within the step: every latent and indexer write, then one selection over all rows
    (row r sees only pools complete at its own position), then one gather-attend. Row r's
    selection holds only tokens <= its position, all written, and no later row's write can
    change them, so this equals processing the rows one after another.
    """
    b, r, _ = x.shape
    pos = state.lengths[:, None] + jnp.arange(r, dtype=jnp.int32)  # [B, R]
    valid = jnp.arange(r)[None, :] < n_new[:, None]  # [B, R]
    proj = project(cfg, weights, x)
    state = write_latents(cfg, state, proj.latent, pos, valid)
    if weights.has_indexer:
        state = write_index_rows(cfg, weights.ape, state, proj.k, proj.g, pos, valid)
        scores = pool_scores(cfg, proj.qi, proj.w, state.pool_keys,
                             (pos + 1) // cfg.index_kpool)  # [B, R, P]
        sel = expand_selection(cfg, top_pools(cfg, scores), pos, valid)  # [B, R, W]
        index_lengths = state.index_lengths + n_new
    else:
        sel = jnp.where(valid[..., None], shared_sel, -1)
        index_lengths = state.index_lengths + n_new
    o_latent = attend(cfg, state, proj.q_abs, sel)  # [B, R, Hl, C]
    y = output_projection(weights, o_latent)  # [B, R, D]
    state = state._replace(lengths=state.lengths + n_new, index_lengths=index_lengths)
    return y, state, sel


_append_rows_jit = jax.jit(_append_rows, static_argnames=("cfg",), donate_argnames=("state",))


def _is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _check_step(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                rows: int, shared_sel: jax.Array | None, sel_shape: tuple[int, ...]) -> None:
    """Host-side validation of one step; see the module docstring."""
    b = state.num_seqs
    if x.shape[0] != b or x.shape[-1] != cfg.hidden_size:
        raise StepError(f"x has shape {tuple(x.shape)}; expected leading dim {b} (sequences in "
                        f"the state) and last dim {cfg.hidden_size} (hidden_size)")
    if not weights.has_indexer:
        if shared_sel is None:
            raise StepError("these weights have no indexer (a 'shared' layer): pass shared_sel, "
                            "the selection of the previous full layer")
        if tuple(shared_sel.shape) != sel_shape:
            raise StepError(f"shared_sel has shape {tuple(shared_sel.shape)}, expected "
                            f"{sel_shape}")
    elif shared_sel is not None:
        raise StepError("shared_sel was given but these weights run their own indexer")
    if not (_is_concrete(state.lengths) and _is_concrete(state.block_tables)):
        return
    lengths = np.asarray(state.lengths)
    index_lengths = np.asarray(state.index_lengths)
    for s in range(b):
        if weights.has_indexer and index_lengths[s] != lengths[s]:
            raise StepError(f"sequence {s}: indexer length {index_lengths[s]} differs from "
                            f"sequence length {lengths[s]}; the two caches must advance in "
                            f"lockstep")
        end = int(lengths[s]) + rows
        if end > cfg.max_context:
            raise StepError(f"sequence {s}: writing {rows} token(s) at position {lengths[s]} "
                            f"would reach {end}, past max_context {cfg.max_context}")
    nb = state.latent.shape[0]
    tables = np.asarray(state.block_tables)
    for s in range(b):
        first, last = int(lengths[s]) // cfg.block_size, (int(lengths[s]) + rows - 1) // \
            cfg.block_size
        entries = tables[s, first:last + 1]
        bad = (entries < 0) | (entries >= nb)
        if rows and bad.any():
            i = first + int(np.argmax(bad))
            raise StepError(f"sequence {s}: block table entry {i} is {tables[s, i]}, outside "
                            f"[0, {nb}) physical blocks, but position "
                            f"{max(i * cfg.block_size, int(lengths[s]))} is to be written there")


def prefill(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
            shared_sel: jax.Array | None = None
            ) -> tuple[jax.Array, DsaState, jax.Array]:
    """Append `S` tokens to every sequence.

    x: [B, S, D]; shared_sel: [B, S, W] for a "shared" layer. Returns `y [B, S, D]` f32, the
    new state (the old one is donated), and `sel [B, S, W]` int32, the selected token indices
    of every row (-1 padded; W = index_topk + index_kpool - 1 with the tail).
    """
    b, s = x.shape[0], x.shape[1]
    _check_step(cfg, weights, state, x, s, shared_sel, (b, s, cfg.sel_width))
    n_new = jnp.full((b,), s, jnp.int32)
    return _append_rows_jit(cfg, weights, state, x, n_new, shared_sel)


def decode(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
           shared_sel: jax.Array | None = None
           ) -> tuple[jax.Array, DsaState, jax.Array]:
    """Append one token to every sequence.

    x: [B, D]; shared_sel: [B, W] for a "shared" layer. Returns `y [B, D]` f32, the new state
    (the old one is donated), and `sel [B, W]` int32.
    """
    b = x.shape[0]
    _check_step(cfg, weights, state, x, 1, shared_sel, (b, cfg.sel_width))
    rows = cfg.max_verify
    x_rows = jnp.zeros((b, rows, x.shape[-1]), x.dtype).at[:, 0].set(x)  # [B, K, D]
    if shared_sel is not None:
        shared_sel = jnp.full((b, rows, cfg.sel_width), -1, jnp.int32).at[:, 0].set(shared_sel)
    y, state, sel = _append_rows_jit(cfg, weights, state, x_rows, jnp.ones((b,), jnp.int32),
                                     shared_sel)
    return y[:, 0], state, sel[:, 0]
