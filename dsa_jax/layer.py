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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_jax.attend import attend, write_latents
from dsa_jax.bitwise import bitwise_jit
from dsa_jax.config import DsaConfig
from dsa_jax.implementation import meta_matmul_op, resolve, row_gemms, topk_matmul_op
from dsa_jax.indexer import pool_scores, pool_scores_at, write_index_rows
from dsa_jax.mirror import host_numbers, known, remember
from dsa_jax.pallas import row_meta
from dsa_jax.pallas.colaunch import colaunch
from dsa_jax.pallas.index_write import IndexWriteTuning, index_write_parts
from dsa_jax.pallas.latent_write import LatentWriteTuning, latent_write_part, pick_store
from dsa_jax.pallas.matmul import default_tuning, matmul_part, summed_columns_part
from dsa_jax.pallas.pool_topk import KERNEL_MAX_P
from dsa_jax.pallas.rms_norm import RmsNormTuning, rms_norm_part
from dsa_jax.pallas.row_meta import RowMeta
from dsa_jax.projection import (
    Projections,
    absorb_q,
    kernel_rows,
    output_projection,
    project,
    project_kv,
    q_resid_dtype,
    x_columns,
)
from dsa_jax.select import expand_selection, expansion, top_pools
from dsa_jax.stacked import LayerOf, operand
from dsa_jax.state import DsaState, ring_mark_after, ring_mark_after_rewind, ring_rows
from dsa_jax.step_checks import (
    StepError,
    check_out,
    check_rewind,
    check_step,
    is_concrete,
    rows_per_seq,
    vouch,
)
from dsa_jax.weights import DsaWeights


def _write_rows(cfg: DsaConfig, weights: DsaWeights, state: DsaState, proj, n_new: jax.Array,
                meta: RowMeta | None = None):
    """Store the rows' latents and indexer entries at positions `lengths + r`, r < n_new.

    Returns the state, `pos [B, R]` and `valid [B, R]`. An indexer ahead of the sequence (a
    rejected speculation) heals here: its rows are rewritten from `lengths` on (the ring's
    mark moves on in `_advance`). meta: the rows' metadata, computed already
    (`meta_and_x_projection`), which the kernels then read instead of computing it.
    """
    pos, valid = _rows_at(state, n_new, proj.kv_raw.shape[1])
    if proj.xw is None:  # `project_kv`'s rows (a drafter's context: not the hot path)
        state = write_latents(cfg, state, proj.kv_raw, weights.kv_a_norm, pos, valid)
        if weights.has_indexer:
            state = write_index_rows(cfg, weights, state, proj.k_raw, proj.g, pos, valid)
        return state, pos, valid
    # The writes read their columns of the x projection in place (no slice copies).
    at = x_columns(cfg)
    state = write_latents(cfg, state, proj.xw, weights.kv_a_norm, pos, valid, col=at["kv"][0],
                          slots=None if meta is None else meta.slots)
    if weights.has_indexer:
        state = write_index_rows(cfg, weights, state, proj.xw, proj.xw, pos, valid,
                                 cols=(at["k"][0], at["g"][0]),
                                 meta=None if meta is None else meta.index)
    return state, pos, valid


def _rows_at(state: DsaState, n_new: jax.Array, r: int) -> tuple[jax.Array, jax.Array]:
    """`pos [B, R]` (`lengths + r`) and `valid [B, R]` (r < n_new) of the step's rows."""
    pos = state.lengths[:, None] + jnp.arange(r, dtype=jnp.int32)
    return pos, jnp.arange(r)[None, :] < n_new[:, None]


def candidate_pools(cfg: DsaConfig, pos: jax.Array, valid: jax.Array) -> jax.Array:
    """Complete pools visible at `pos [B, R]`: `(t + 1) // KP`; 0 on padded rows, so that the
    pool-score kernel reads no key for them (their selection is masked anyway)."""
    return row_meta.candidate_pools(pos, valid, cfg.index_kpool)


def _advance(cfg: DsaConfig, state: DsaState, n_new: jax.Array,
             meta: RowMeta | None = None) -> DsaState:
    """Lengths after the step; an indexer state's ring mark as `ring_mark_after` says (meta:
    both computed already, by the row metadata's launch)."""
    if meta is not None:
        return state._replace(lengths=meta.lengths, index_lengths=meta.marks)
    lengths = state.lengths + n_new
    marks = (ring_mark_after(cfg, state.lengths, state.index_lengths, n_new)
             if state.index_k.shape[1] else lengths)
    return state._replace(lengths=lengths, index_lengths=marks)


def select_pools(cfg: DsaConfig, qi: jax.Array, w: jax.Array, pool_keys: jax.Array,
                 pos: jax.Array, valid: jax.Array) -> jax.Array:
    """The indexer's choice for rows at `pos [B, R]` (`valid`): scores of the pools complete
    at each row's position, then the top-k -> pool ids `[B, R, k]`, best first. Every row's
    result depends on that row's inputs only (the kernels work per row)."""
    scores = pool_scores_at(cfg, qi, w, pool_keys, pos, valid)  # [B, R, P]
    return top_pools(cfg, scores)


def step(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, n_new: jax.Array,
         shared_sel: jax.Array | None = None, *, select=select_pools,
         attend_rows: int | None = None) -> tuple[jax.Array, DsaState, jax.Array]:
    """The block's step: append rows `x [B, R, D]` to every sequence; pure and traceable.

    n_new: [B] int32, the first `n_new[b]` rows of sequence b are real (the rest padding:
    never written, never selected, output 0); shared_sel: [B, R, W] for a layer without an
    indexer. Returns `y [B, R, D]` f32, the new state and `sel [B, R, W]` int32. No checks run
    here (see `prepare_step`); writes past the caches are dropped. Call it inside your own
    `jax.jit` (donate the state) to serve; `decode`, `decode_k` and `prefill` wrap it.
    select: `select_pools` or a function with its arguments and result (the sharded step
    splits the rows' selection over tensor-parallel ranks with it). attend_rows: static; the
    selection and the gather-attend run on the first `attend_rows` rows only (a promise:
    `n_new <= attend_rows` for every sequence; a real row past it gets NaN outputs and selects
    nothing, never a silent value), so that a decode padded to `max_verify` rows skips its
    padded rows' selection and attend (`cut_rows`): `decode`, `decode_k`,
    `prefill` and the sharded steps pass their call's row count (the same bits, measured on
    the H200: benchmarks/results/h200-decode-variants-20261201-s4.json).

    Order within the step: every latent and indexer write, then one selection over all rows
    (row r sees only pools complete at its own position), then one gather-attend. Row r's
    selection holds only tokens <= its position, all written, and no later row's write can
    change them, so this equals processing the rows one after another.
    """
    shared_launch = select is select_pools and shares_q_launch(cfg, weights, x)
    k = cut_rows(cfg, attend_rows, x.shape[1])
    if shared_launch and state.index_k.shape[1]:
        state, proj, meta, pos, valid = decode_front(cfg, weights, state, x, n_new, k)
    else:
        meta = None
        proj = project(cfg, weights, x, defer_q=shared_launch)
        state, pos, valid = _write_rows(cfg, weights, state, proj, n_new)
    if weights.has_indexer:
        qi, w, pos_k, valid_k = first_rows(k, proj.qi, proj.w, pos, valid)
        if shared_launch:  # select_pools with the q_b GEMM in the top-k's launch, which
            # also writes the pools' token slots (`expand_selection`'s)
            n_cand = candidate_pools(cfg, pos_k, valid_k) if meta is None else meta.n_cand
            scores = pool_scores(cfg, qi, w, state.pool_keys, n_cand)  # [B, k, P]
            slots, proj = slots_and_q_abs(cfg, weights, proj, scores, pos_k, valid_k,
                                          None if meta is None else meta.pv)
        else:
            pools = select(cfg, qi, w, state.pool_keys, pos_k, valid_k)  # [B, k, n]
            slots = expand_selection(cfg, pools, pos_k, valid_k)  # [B, k, W]
        sel = pad_rows(slots, x.shape[1])  # [B, R, W]
    else:
        sel = jnp.where(valid[..., None], shared_sel, -1)
    o_latent = attend_first_rows(cfg, state, proj.q_abs, sel, valid, live_rows(cfg, x),
                                 attend_rows, weights.u_v.dtype, proj.q_scaled)  # [B, R, Hl, C]
    y = output_projection(weights, o_latent, cfg)  # [B, R, D]
    return y, _advance(cfg, state, n_new, meta), sel


def decode_front(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                 n_new: jax.Array, attended: int | None):
    """Where `shares_q_launch` (and the state has a ring): `project(defer_q=True)` and
    `_write_rows` in three launches. (1) The rows' metadata beside the x projection's GEMM
    (`meta_and_x_projection`), its K parts left unsummed; (2) the GEMM's readers, each
    adding the parts in split order itself (`common.load_parts`): the q_a norm, the index
    rows' write, the latent write and the head weights' columns; (3) the pool keys (from the
    index rows) beside the indexer query's GEMM (from the norm). Each part is its kernel's
    own program at its kernel's warps (`colaunch`): the same results as one launch each.
    -> (state, proj, meta, pos, valid)."""
    qw, qw_at = operand(cfg, weights.qi_proj)
    qt = default_tuning(*qw.shape[-2:], 1, x.shape[0] * x.shape[1])
    warps = {RmsNormTuning().num_warps, LatentWriteTuning().warps(x.shape[1]),
             IndexWriteTuning().warps(x.shape[1]), qt.num_warps}
    if len(warps) > 1 or pick_store(LatentWriteTuning(), state.latent.shape,
                                    state.latent.dtype) != "kernel":
        # Parts of other warps would not be their kernels' programs; a cache XLA stores
        # takes no part: one launch each, the same results.
        meta, xw = meta_and_x_projection(cfg, weights, state, x, n_new, attended)
        proj = project(cfg, weights, x, defer_q=True, xw=xw)
        state, pos, valid = _write_rows(cfg, weights, state, proj, n_new, meta)
        return state, proj, meta, pos, valid
    (warps,) = warps
    meta, xp = meta_and_x_projection(cfg, weights, state, x, n_new, attended,
                                     summed=False)  # xp [S, B, R, Nx]: the K parts
    s = xp.shape[0]
    interpret = resolve(cfg.implementation) == "pallas-interpret"
    pos, valid = _rows_at(state, n_new, x.shape[1])
    at = x_columns(cfg)
    qn, qn_at = operand(cfg, weights.q_a_norm)
    norm_part, norm_done = rms_norm_part(xp, qn, cfg.rms_norm_eps, cols=at["q_a"],
                                         dtype=q_resid_dtype(weights), layer=qn_at, parts=s)
    kn, kn_at = operand(cfg, weights.kv_a_norm)
    lat_part, lat_done = latent_write_part(xp, kn, state.latent, state.kv_scale,
                                           state.block_tables, pos, valid,
                                           eps=cfg.rms_norm_eps, col=at["kv"][0],
                                           layer=kn_at, slots=meta.slots, parts=s)
    (nw, w_at), (nb, _), (ape, _) = (operand(cfg, w) for w in (
        weights.k_norm_w, weights.k_norm_b, weights.ape))
    ix = index_write_parts(xp, xp, nw, nb, ape, state.index_k, state.index_g,
                           state.pool_keys, pos, valid,
                           layers=state.index_k.shape[1] // ring_rows(cfg),
                           cols=(at["k"][0], at["g"][0]), weight_layer=w_at, meta=meta.index,
                           parts=s)
    w_part, w_done = summed_columns_part(xp, *at["w"])  # the head weights [B, R, Hi]
    rows_outs, lat_outs, norm_outs, w_outs = colaunch(
        [ix.rows, lat_part, norm_part, w_part], num_warps=warps, num_stages=1,
        interpret=interpret, name="x_readers")
    q_resid = norm_done(norm_outs)  # [B, R, R_q]
    # The barrier as in `project`: XLA:GPU's dot merger must not merge the two q GEMMs.
    qi_part, qi_done = matmul_part(lax.optimization_barrier(q_resid), qw, qw_at, tuning=qt)
    pool_outs, qi_outs = colaunch([ix.pool(rows_outs), qi_part], num_warps=warps,
                                  num_stages=qt.num_stages, interpret=interpret,
                                  name="pool_keys_matmul")
    index_k, index_g, keys = ix.finish(rows_outs, pool_outs)
    state = state._replace(latent=lat_done(lat_outs), index_k=index_k, index_g=index_g,
                           pool_keys=keys)
    qi = qi_done(qi_outs).reshape(*x.shape[:-1], cfg.index_n_heads, cfg.index_head_dim)
    # Only the kernels above read the x projection (in parts): its columns stay unsummed.
    proj = Projections(None, None, qi, None, None, w_done(w_outs), None, None, q_resid)
    return state, proj, meta, pos, valid


def meta_and_x_projection(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                          n_new: jax.Array, attended: int | None, *, summed: bool = True
                          ) -> tuple[RowMeta, jax.Array]:
    """Where `shares_q_launch` (and the state has a ring): the rows' integer metadata
    (`pallas/row_meta.py`: cache slots, the index write's, candidate pools, the top-k's
    positions, the lengths and marks after the step) and the x projection's GEMM `[B, R, Nx]`
    in one launch. The same integers as the consumers compute themselves, and the GEMM's
    bits (`matmul_pallas`'s tiles). summed False: the GEMM's K parts `[S, B, R, Nx]`, for
    readers that add them themselves (`decode_front`)."""
    rr, ring_len, keys_len = ring_rows(cfg), state.index_k.shape[1], state.pool_keys.shape[1]
    g = row_meta.RowGeometry(rows=x.shape[1], attended=attended or x.shape[1],
                             block_size=state.latent.shape[1], kpool=cfg.index_kpool,
                             ring_rows=rr, ring_len=ring_len,
                             num_pools=keys_len // (ring_len // rr), keys_len=keys_len)
    w = weights.x_proj
    stack, at = (w.stack, w.index) if isinstance(w, LayerOf) else (w, None)
    return meta_matmul_op(cfg, g, state.lengths, state.index_lengths, n_new,
                          state.block_tables, x, stack, at,
                          kernel_options=None if summed else dict(summed=False))


def shares_q_launch(cfg: DsaConfig, weights: DsaWeights, x: jax.Array) -> bool:
    """Whether `step` (with `select_pools`) and the model's scan run the q_b GEMM in the
    top-k's launch (`pallas/topk_matmul.py`; `cfg.colaunch`): a decode's or verify's rows
    under the row-invariant GEMMs (the kernels on), a layer with an indexer, and rows of at
    most the top-k kernel's pools. The same results either way."""
    return (cfg.colaunch and weights.has_indexer and kernel_rows(cfg, x.shape[:-1])
            and cfg.num_pools <= KERNEL_MAX_P)


def slots_and_q_abs(cfg: DsaConfig, weights: DsaWeights, proj, scores: jax.Array,
                    pos: jax.Array, valid: jax.Array, pv: jax.Array | None = None):
    """Where `shares_q_launch`: the selection's token slots from `scores [B, k, P]` (rows at
    `pos`, `valid` [B, k]) and the q_b GEMM of `proj.q_resid` in one launch (the top-k's
    kernel writes the slots), then the absorbed query -> (slots [B, k, W], proj with
    q_abs). `expand_selection(top_pools(...))` and `project`'s q_abs, bit for bit."""
    w = weights.q_proj
    stack, at = (w.stack, w.index) if isinstance(w, LayerOf) else (w, None)
    slots, q = topk_matmul_op(cfg, scores, min(cfg.select_k, scores.shape[-1]), proj.q_resid,
                              stack, at, expand=expansion(cfg), pos=pos,
                              valid=valid,
                              kernel_options=None if pv is None else dict(pv=pv)
                              )  # [B, k, W], [B, R, Hl*Dn]
    return slots, proj._replace(q_abs=absorb_q(cfg, weights, q))


def attend_first_rows(cfg: DsaConfig, state: DsaState, q_abs: jax.Array, sel: jax.Array,
                      valid: jax.Array, live: int, rows: int | None, dtype=jnp.float32,
                      q_scaled: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`attend` of the first `rows` rows of `q_abs [B, R, Hl, C]` and `sel [B, R, W]`, cast to
    `dtype` (the output projection's operand dtype: the cast it would make anyway, made before
    the padding so that the padded rows are written at its width); the other rows' outputs
    are 0 (padding) or NaN where `valid [B, R]` says the row is real (a broken `attend_rows`
    promise). Every attend kernel works per row (its split plan comes from `live`, not from the
    row count), so a row's output is the same bits whether 1 or R rows are attended. The "xla"
    implementation attends every row: XLA compiles the dots of another row count in another
    order (on the H200 a 1-row decode and a K-row verify then differed in their last bits).
    q_scaled: `Projections.q_scaled` (a prompt's rows: never cut), `attend`'s."""
    r = q_abs.shape[1]
    if resolve(cfg.implementation) == "xla":
        return attend(cfg, state, q_abs, sel, live, dtype=dtype)
    if cut_rows(cfg, rows, r) is None:
        # Behind a barrier like the cut's block below: the U_v GEMM takes the same plain
        # operand in every program, whatever `rows` is (and the model's scan, which calls this
        # too). A max_verify-row verify differed from its serial decodes in y's last bits on
        # the H200 (benchmarks/notes.md, 2026-12-01 fifth); the attend's split merge is now a
        # kernel of its own for that reason.
        return lax.optimization_barrier(attend(cfg, state, q_abs, sel, live, dtype=dtype,
                                               q_scaled=q_scaled))
    past = valid & (jnp.arange(r) >= rows)  # [B, R]: real rows past the promise
    fill = jnp.where(past, jnp.nan, 0.0)  # [B, R] f32
    # The attended rows read in place and the padded block written whole by the attend (on
    # the Mosaic path, by its prep and its split merge): no slice, fill or update passes.
    o = attend(cfg, state, q_abs, sel, live, dtype=dtype, rows=rows, fill=fill)
    return lax.optimization_barrier(o)  # [B, R, Hl, C]: the U_v GEMM's operand, plain


def cut_rows(cfg: DsaConfig, rows: int | None, r: int) -> int | None:
    """The rows per sequence that a step of `r` rows promised to fill (`attend_rows`) selects
    and attends, or None for all of them. The kernels work per row, so a row's selection and
    attention are the same bits whether 1 or r rows run (decode == K-row verify); "xla" never
    cuts (XLA compiles the dots of another row count in another order)."""
    if rows is None or rows >= r or resolve(cfg.implementation) == "xla":
        return None
    return rows


def first_rows(k: int | None, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Each `[B, R, ...]` array's first `k` rows per sequence (all of them when k is None)."""
    return arrays if k is None else tuple(a[:, :k] for a in arrays)


def pad_rows(sel: jax.Array, r: int) -> jax.Array:
    """A selection of the first rows `[B, k, W]` -> `[B, r, W]`, the rows past k empty (-1)."""
    if sel.shape[1] == r:
        return sel
    return jnp.pad(sel, ((0, 0), (0, r - sel.shape[1]), (0, 0)), constant_values=-1)


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


def _layout_step(cfg: DsaConfig, layout: RowLayout, weights: DsaWeights, state: DsaState,
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


layout_step = bitwise_jit(_layout_step, static_argnames=("cfg", "layout"),
                          donate_argnames=("state",))

# The state fields a step changes. The public calls donate and return only these: the scale
# and the block tables pass through unchanged, so the new state shares them (two fewer
# donated buffers and outputs for the runtime to handle per call).
MOVING_FIELDS = ("latent", "index_k", "index_g", "pool_keys", "lengths", "index_lengths")


def public_program(cfg: DsaConfig, layout: RowLayout, with_out: bool = False):
    """The jitted program of the public calls for one (config, layout): `_layout_step` with
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
        y, state, sel = _layout_step(cfg, layout, weights, state, x, n_new, shared_sel)
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
        if len(_COUNTS) >= 256:
            _COUNTS.clear()
        _COUNTS[key] = jnp.asarray(n_new, jnp.int32)
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


def _public_step(cfg, weights, state, x, kind, counts, shared_sel, check, out=None):
    """Host side (`prepare_step`: checks on the host's copy of the lengths, no device read
    once it has one; `out` checked), then one dispatch: pad, step, unpad."""
    layout, n_new = prepare_step(cfg, weights, state, x, kind=kind, counts=counts,
                                 shared_sel=shared_sel, check=check)
    if out is not None:
        out = check_out(cfg, x, out, (weights, state, x, shared_sel))
    before = known(state)
    y, state, sel = dispatch_step(cfg, layout, weights, state, x, _device_counts(n_new),
                                  shared_sel, out)
    _remember_step(cfg, before, state, n_new, layout.k)
    if before is not None and weights.has_indexer:
        vouch(sel, before.lengths)  # a shared layer may take it without a device read
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


def write_kv_rows(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                  n_new: jax.Array) -> DsaState:
    """A drafter's context rows `x [B, S, D]`: latent and indexer entries only (no query,
    selection or attend); pure and traceable like `step`."""
    state, _, _ = _write_rows(cfg, weights, state, project_kv(cfg, weights, x), n_new)
    return _advance(cfg, state, n_new)


_write_kv_rows_jit = bitwise_jit(write_kv_rows, static_argnames=("cfg",),
                             donate_argnames=("state",))


def write_kv_row(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
                 active=None) -> DsaState:
    """A drafter's context row(s): latent and indexer entry only; no query, selection or attend.

    x: [B, D] (one row per sequence) or [B, S, D]; active: [B] bool. Returns the new state.
    """
    if x.ndim == 2:
        x = x[:, None]
    layout, n_new = prepare_step(cfg, weights, state, x, kind="kv", counts=active)
    before = known(state)
    state = _write_kv_rows_jit(cfg, weights, state, x, _device_counts(n_new))
    _remember_step(cfg, before, state, n_new, layout.k)
    return state
