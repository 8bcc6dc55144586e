"""The block's step, pure and traceable: append rows to every sequence of the state.

`step` writes every row's latent and indexer entries, selects the tokens each row attends
(rows see only pools complete at their own position), gathers and attends, and projects the
output. Its parts are the model's composition of the ops (`dsa_jax.implementation`): the
projections (`projection`), the cache writes (`attend.write_latents`,
`indexer.write_index_rows`), the selection (`indexer.pool_scores`, `select`) and the
gather-attend (`attend`). `dsa_jax.layer` wraps it in the public calls; the model's scan
(`dsa_jax.model`) and the sharded steps (`dsa_jax.sharding`) call it and its parts directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dsa_jax.attend import attend, write_latents
from dsa_jax.config import DsaConfig
from dsa_jax.fp8 import compute_weights
from dsa_jax.implementation import (
    KERNEL_MAX_P,
    RowGeometry,
    RowMeta,
    front_warps,
    meta_matmul_op,
    resolve,
    run_decode_front,
    topk_matmul_op,
)
from dsa_jax.indexer import pool_scores, pool_scores_at, write_index_rows
from dsa_jax.numerics import candidate_pools as visible_pools
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
from dsa_jax.state import DsaState, ring_mark_after, ring_rows
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
    return visible_pools(pos, valid, cfg.index_kpool)


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
    `prefill` and the sharded steps pass their call's row count (the same bits: the attend
    kernels work per row).

    Order within the step: every latent and indexer write, then one selection over all rows
    (row r sees only pools complete at its own position), then one gather-attend. Row r's
    selection holds only tokens <= its position, all written, and no later row's write can
    change them, so this equals processing the rows one after another.
    """
    weights = compute_weights(cfg, weights)  # fp8 fields dequantized (`dsa_jax.fp8`)
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
    `_write_rows`, with the rows' metadata computed beside the x projection's GEMM
    (`meta_and_x_projection`). Where the front's kernels agree on their warps
    (`implementation.front_warps`) the GEMM's readers share two launches
    (`implementation.run_decode_front`): the same results as one launch each.
    -> (state, proj, meta, pos, valid)."""
    qw, qw_at = operand(cfg, weights.qi_proj)
    warps = front_warps(x.shape[1], x.shape[0] * x.shape[1], qw, state.latent.shape,
                        state.latent.dtype)
    if warps is None:
        meta, xw = meta_and_x_projection(cfg, weights, state, x, n_new, attended)
        proj = project(cfg, weights, x, defer_q=True, xw=xw)
        state, pos, valid = _write_rows(cfg, weights, state, proj, n_new, meta)
        return state, proj, meta, pos, valid
    meta, xp = meta_and_x_projection(cfg, weights, state, x, n_new, attended,
                                     summed=False)  # xp [S, B, R, Nx]: the K parts
    pos, valid = _rows_at(state, n_new, x.shape[1])
    at = x_columns(cfg)
    (qn, qn_at), (kn, kn_at) = operand(cfg, weights.q_a_norm), operand(cfg, weights.kv_a_norm)
    (nw, w_at), (nb, _), (ape, _) = (operand(cfg, w) for w in (
        weights.k_norm_w, weights.k_norm_b, weights.ape))
    front = run_decode_front(
        xp, warps=warps, interpret=resolve(cfg.implementation) == "pallas-interpret",
        eps=cfg.rms_norm_eps, q_norm=qn, q_norm_at=qn_at, q_cols=at["q_a"],
        q_dtype=q_resid_dtype(weights), kv_norm=kn, kv_norm_at=kn_at, kv_col=at["kv"][0],
        latent=state.latent, kv_scale=state.kv_scale, block_tables=state.block_tables,
        slots=meta.slots, k_norm_w=nw, k_norm_b=nb, ape=ape, index_weight_at=w_at,
        index_k=state.index_k, index_g=state.index_g, pool_keys=state.pool_keys,
        ring_layers=state.index_k.shape[1] // ring_rows(cfg),
        index_cols=(at["k"][0], at["g"][0]), index_meta=meta.index, w_cols=at["w"],
        qi_weight=qw, qi_weight_at=qw_at, pos=pos, valid=valid)
    state = state._replace(latent=front.latent, index_k=front.index_k, index_g=front.index_g,
                           pool_keys=front.pool_keys)
    qi = front.qi.reshape(*x.shape[:-1], cfg.index_n_heads, cfg.index_head_dim)
    # Only the front's kernels read the x projection (in parts): its columns stay unsummed.
    proj = Projections(None, None, qi, None, None, front.w, None, None, front.q_resid)
    return state, proj, meta, pos, valid


def meta_and_x_projection(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                          n_new: jax.Array, attended: int | None, *, summed: bool = True
                          ) -> tuple[RowMeta, jax.Array]:
    """Where `shares_q_launch` (and the state has a ring): the rows' integer metadata
    (`implementation.RowMeta`: cache slots, the index write's, candidate pools, the top-k's
    positions, the lengths and marks after the step) and the x projection's GEMM `[B, R, Nx]`
    in one launch. The same integers as the consumers compute themselves, and the GEMM's
    bits (`matmul_pallas`'s tiles). summed False: the GEMM's K parts `[S, B, R, Nx]`, for
    readers that add them themselves (`decode_front`)."""
    rr, ring_len, keys_len = ring_rows(cfg), state.index_k.shape[1], state.pool_keys.shape[1]
    g = RowGeometry(rows=x.shape[1], attended=attended or x.shape[1],
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
        # too): without it XLA fused the attend's split merge into the GEMM's operand
        # differently per program, and a max_verify-row verify differed from its serial
        # decodes in y's last bits on the H200; the split merge is a kernel of its own too.
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


# With `cfg.batch_invariant` every attend is planned as for a step of this many rows, whatever
# its own count: the split count (and with it each row's reduction order) is then the same in
# every batch. 64 rows: the serving batch the kernels are tuned for, which this plan fills
# (a lone row runs fewer splits than its own plan would give it: slower, the same bits).
INVARIANT_PLAN_ROWS = 64


def live_rows(cfg: DsaConfig, x: jax.Array) -> int:
    """Rows the gather-attend should plan its work split for: a decode or verify pads every
    sequence to max_verify rows and is planned as one live row per sequence (a K=1 decode is
    the common case; a K-row verify then runs more splits than it needs, at a small cost);
    a prompt chunk's rows are all live; `INVARIANT_PLAN_ROWS` under `cfg.batch_invariant`.
    Static, so decode and verify share one program."""
    if cfg.batch_invariant:
        return INVARIANT_PLAN_ROWS
    b, r = x.shape[0], x.shape[1]
    return b if r <= cfg.max_verify else b * r


def write_kv_rows(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                  n_new: jax.Array) -> DsaState:
    """A drafter's context rows `x [B, S, D]`: latent and indexer entries only (no query,
    selection or attend); pure and traceable like `step`."""
    weights = compute_weights(cfg, weights)
    state, _, _ = _write_rows(cfg, weights, state, project_kv(cfg, weights, x), n_new)
    return _advance(cfg, state, n_new)
