"""A small causal model built of DSA blocks, with its layers run by one `lax.scan`.

The model: token embedding, then per layer `h = h + DSA(rms(h))`, a final RMSNorm and an LM
head. Layers whose `indexer_types` entry is "shared" reuse the previous full layer's selection.

Two forms of the same model:
- `ModelWeights` (a tuple of per-layer `DsaWeights`) with per-layer `DsaState`s, run by
  `forward_unrolled`: one `layer.step` per layer in a Python loop. The reference, and the form
  checkpoints store.
- `StackedWeights` with one `ModelState`, run by `forward`: the layers are scanned **by
  group** (a group is one full layer followed by its shared layers: the selection never has to
  cross a scan step). A depth changes the scan's length, not the program; consecutive groups of
  the same size form one segment, so a regular pattern (full, shared, full, shared, ...) is one
  scan and any other pattern a few.

`forward` equals `forward_unrolled` bit for bit (tests/test_model.py, `==`). Both put an
`optimization_barrier` on the hidden rows where each layer starts (and before the LM head), so
that every layer compiles as its own island in both programs: without it XLA:GPU may fuse one
layer's residual add into the next layer's RMSNorm in one program and not in the other (a
scan step boundary already splits them), and the two differ in the last bits. The barrier
only stops fusion across a layer boundary; it adds no op.

The weights are read in place too: XLA's GEMMs read the scan's slice of a stacked weight, and
the Pallas kernels (the row-invariant GEMMs on decode-shaped rows, the RMSNorms and the cache
writes) take the whole stack and the layer's index (`stacked.LayerOf`), since a kernel operand
is a whole buffer and a slice would be a copy per layer and token. Under the row-invariant
GEMMs a row has the same bits at any row count, so a decode-shaped forward runs only the rows
it fills (`step_rows`).

The stacked caches are laid out so that no layer's cache is ever copied out of the stack:
a kernel operand must be a whole buffer, so a per-layer slice of a stacked cache would cost
a copy in and a copy back every step. Instead:
- the latent caches of all L layers are one physical pool `[L*NB, bs, C]`; layer l sees its
  sequences' block tables shifted by `l*NB` (a block table is data, so this is free);
- the full layers' indexer rows are one cache per sequence `[B, Lf*T, Di]`; full layer f
  writes position t at row `f*T + t` (pools likewise at `f*P + p`; `T % KP == 0`).
The pool-score kernels read a full layer's keys at its pool offset in place too
(`pool_scores(..., pools=(f*P, P))`; the copy of them it replaced was 134 MB per full layer and
token at 64 sequences x 16K).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_jax.attend import write_latents
from dsa_jax.config import DsaConfig
from dsa_jax.errors import ModelError
from dsa_jax.implementation import rms_norm_op, row_gemms
from dsa_jax.indexer import pool_scores, write_index_rows
from dsa_jax.projection import (
    kernel_rows,
    matmul,
    norm,
    output_projection,
    per_sequence,
    project,
    x_columns,
)
from dsa_jax.select import expand_selection, top_pools
from dsa_jax.stacked import LayerOf
from dsa_jax.state import DsaState, init_state, ring_guard
from dsa_jax.step import (
    attend_first_rows,
    candidate_pools,
    cut_rows,
    first_rows,
    live_rows,
    pad_rows,
    shares_q_launch,
    slots_and_q_abs,
    step,
)
from dsa_jax.weights import DsaWeights, compute_dtype, init_random_weights


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    dsa: DsaConfig  # the block; len(dsa.indexer_types) is the number of layers
    vocab_size: int = 256

    @property
    def num_layers(self) -> int:
        return len(self.dsa.indexer_types)

    @property
    def num_full(self) -> int:
        return sum(kind == "full" for kind in self.dsa.indexer_types)


class ModelWeights(NamedTuple):
    """The per-layer form (what checkpoints hold and `forward_unrolled` runs)."""
    embed: jax.Array  # [V, D] f32
    norms: jax.Array  # [L, D] f32: pre-block RMSNorm weights
    layers: tuple[DsaWeights, ...]  # L blocks; "shared" ones have no indexer
    final_norm: jax.Array  # [D] f32
    lm_head: jax.Array  # [V, D] param dtype


def init_model(mcfg: ModelConfig, key: jax.Array,
               layers: tuple[DsaWeights, ...] | None = None) -> ModelWeights:
    """Random model weights from `key`; `layers` replaces the random DSA blocks if given."""
    cfg = mcfg.dsa
    d, v = cfg.hidden_size, mcfg.vocab_size
    k_emb, k_norm, k_fin, k_head, k_layers = jax.random.split(key, 5)
    if layers is None:
        layers = tuple(
            init_random_weights(cfg, k, has_indexer=kind == "full")
            for k, kind in zip(jax.random.split(k_layers, mcfg.num_layers), cfg.indexer_types,
                               strict=True))
    if len(layers) != mcfg.num_layers:
        raise ModelError(f"{len(layers)} layer weights for a {mcfg.num_layers}-layer model")
    for i, (lw, kind) in enumerate(zip(layers, cfg.indexer_types, strict=True)):
        if lw.has_indexer != (kind == "full"):
            raise ModelError(f"layer {i} is {kind!r} but its weights "
                             f"{'have' if lw.has_indexer else 'have no'} indexer")
    return ModelWeights(
        embed=jax.random.normal(k_emb, (v, d)),
        norms=1.0 + 0.1 * jax.random.normal(k_norm, (mcfg.num_layers, d)),
        layers=tuple(layers),
        final_norm=1.0 + 0.1 * jax.random.normal(k_fin, (d,)),
        lm_head=(jax.random.normal(k_head, (v, d)) * d ** -0.5).astype(compute_dtype(cfg)),
    )


# ------------------------------------------------------------------------------ the plan

@dataclasses.dataclass(frozen=True)
class Segment:
    """`num_groups` consecutive groups of `group_size` layers (one full, then shared ones),
    starting at model layer `first_layer` and full layer `first_full`."""
    group_size: int
    num_groups: int
    first_layer: int
    first_full: int


def layer_plan(indexer_types: tuple[str, ...]) -> tuple[Segment, ...]:
    """Groups (a full layer and the shared layers after it) merged into equal-size runs."""
    starts = [i for i, kind in enumerate(indexer_types) if kind == "full"]
    sizes = [b - a for a, b in zip(starts, starts[1:] + [len(indexer_types)], strict=True)]
    segments: list[Segment] = []
    for f, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        last = segments[-1] if segments else None
        if last is not None and last.group_size == size:
            segments[-1] = dataclasses.replace(last, num_groups=last.num_groups + 1)
        else:
            segments.append(Segment(size, 1, start, f))
    return tuple(segments)


class Stack(NamedTuple):
    """One segment's weights, stacked: G groups of g layers."""
    full: DsaWeights  # leaves [G, ...]: each group's full layer
    shared: DsaWeights | None  # leaves [G, g-1, ...]: its shared layers (None when g == 1)
    norms: jax.Array  # [G, g, D] f32: the layers' pre-block norms


class StackedWeights(NamedTuple):
    embed: jax.Array  # [V, D] f32
    segments: tuple[Stack, ...]  # one per `layer_plan` segment
    final_norm: jax.Array  # [D] f32
    lm_head: jax.Array  # [V, D] param dtype


def _stack(trees):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def stack_weights(mcfg: ModelConfig, weights: ModelWeights) -> StackedWeights:
    """The per-layer weights -> the scanned form (one copy of every weight)."""
    if len(weights.layers) != mcfg.num_layers:
        raise ModelError(f"{len(weights.layers)} layer weights for a {mcfg.num_layers}-layer "
                         f"model")
    segments = []
    for seg in layer_plan(mcfg.dsa.indexer_types):
        g = seg.group_size
        firsts = [seg.first_layer + k * g for k in range(seg.num_groups)]
        full = _stack([weights.layers[i] for i in firsts])
        shared = None if g == 1 else _stack(
            [_stack([weights.layers[i + j] for j in range(1, g)]) for i in firsts])
        norms = jnp.stack([weights.norms[i:i + g] for i in firsts])
        segments.append(Stack(full, shared, norms))
    return StackedWeights(weights.embed, tuple(segments), weights.final_norm, weights.lm_head)


# ------------------------------------------------------------------------------ the state

class ModelState(NamedTuple):
    """Every layer's cache for `B` sequence slots (lengths and block tables are shared)."""
    latent: jax.Array  # [L, NB, bs, C] cache dtype: layer l's paged latent pool
    kv_scale: jax.Array  # [L] f32: per-layer latent scale
    block_tables: jax.Array  # [B, MB] int32: logical -> physical block, the same in every layer
    lengths: jax.Array  # [B] int32: tokens cached (every layer, latent and indexer alike)
    index_k: jax.Array  # [B, Lf, Rr, Di] index dtype: the full layers' indexer k rings
    index_g: jax.Array  # [B, Lf, Rr, Di] index dtype: their gate rings (dsa_jax.state)
    pool_keys: jax.Array  # [B, Lf, P, Di] index dtype: their pool keys

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.latent.shape[1]


def init_model_state(mcfg: ModelConfig, num_seqs: int, num_blocks: int,
                     block_tables: np.ndarray | None = None, kv_scale: float = 1.0
                     ) -> ModelState:
    """Empty caches; block tables default to unassigned (-1) until an allocator fills them."""
    cfg = mcfg.dsa
    if block_tables is None:
        block_tables = np.full((num_seqs, cfg.blocks_per_seq), -1, np.int32)
    full = init_state(cfg, num_seqs, num_blocks=num_blocks, block_tables=block_tables,
                      kv_scale=kv_scale)
    lf, nl = mcfg.num_full, mcfg.num_layers
    return ModelState(
        latent=jnp.zeros((nl, *full.latent.shape), full.latent.dtype),
        kv_scale=jnp.full((nl,), kv_scale, jnp.float32),
        block_tables=full.block_tables,
        lengths=full.lengths,
        index_k=jnp.zeros((num_seqs, lf, *full.index_k.shape[1:]), full.index_k.dtype),
        index_g=jnp.zeros((num_seqs, lf, *full.index_g.shape[1:]), full.index_g.dtype),
        pool_keys=jnp.zeros((num_seqs, lf, *full.pool_keys.shape[1:]), full.pool_keys.dtype),
    )


def unfold_state(mcfg: ModelConfig, ms: ModelState) -> list[DsaState]:
    """The stacked state -> one `DsaState` per layer (checkpoints, the unrolled reference)."""
    cfg, out, f = mcfg.dsa, [], 0
    b = ms.num_seqs
    for l, kind in enumerate(cfg.indexer_types):
        if kind == "full":
            ik, ig, pk = ms.index_k[:, f], ms.index_g[:, f], ms.pool_keys[:, f]
            f += 1
        else:
            di = cfg.index_head_dim
            ik = jnp.zeros((b, 0, di), ms.index_k.dtype)
            ig = jnp.zeros((b, 0, di), ms.index_g.dtype)
            pk = jnp.zeros((b, 0, di), ms.pool_keys.dtype)
        # Each layer gets its own copies: a step donates its state's arrays.
        out.append(DsaState(latent=ms.latent[l], kv_scale=ms.kv_scale[l],
                            block_tables=jnp.copy(ms.block_tables), index_k=ik, index_g=ig,
                            pool_keys=pk, lengths=jnp.copy(ms.lengths),
                            index_lengths=jnp.copy(ms.lengths)))
    return out


def fold_states(mcfg: ModelConfig, states) -> ModelState:
    """Per-layer states (one sequence length and block table for all) -> the stacked state.

    An indexer ahead of its sequence (a rewound speculation) by at most `max_verify - 1` rows
    is fine: its rows are rewritten before they are read. One behind, further ahead (the
    model state keeps no ring mark: `dsa_jax.state`), or layers that disagree, is a
    `ModelError`.
    """
    cfg = mcfg.dsa
    states = list(states)
    if len(states) != mcfg.num_layers:
        raise ModelError(f"{len(states)} layer states for a {mcfg.num_layers}-layer model")
    lengths = np.asarray(states[0].lengths)
    tables = np.asarray(states[0].block_tables)
    for l, (st, kind) in enumerate(zip(states, cfg.indexer_types, strict=True)):
        if not (np.array_equal(np.asarray(st.lengths), lengths)
                and np.array_equal(np.asarray(st.block_tables), tables)):
            raise ModelError(f"layer {l}'s lengths or block tables differ from layer 0's; "
                             f"a model state shares them across layers")
        if (st.index_k.shape[1] > 0) != (kind == "full"):
            raise ModelError(f"layer {l} is {kind!r} but its state "
                             f"{'has' if st.index_k.shape[1] else 'has no'} indexer cache")
        if kind == "full" and (np.asarray(st.index_lengths) < lengths).any():
            raise ModelError(f"layer {l}: indexer lengths {np.asarray(st.index_lengths)} "
                             f"are behind the sequence lengths {lengths}")
        if kind == "full" and (np.asarray(st.index_lengths) > lengths + ring_guard(cfg)).any():
            # A model state keeps no ring mark (unfold_state gives mark = lengths, within the
            # guard): a mark further ahead would be lost, and with it the ring's reach.
            raise ModelError(f"layer {l}: indexer ring marks {np.asarray(st.index_lengths)} "
                             f"are more than {ring_guard(cfg)} rows (max_verify - 1) ahead of "
                             f"the sequence lengths {lengths}: decode past the mark first")
    full = [st for st, kind in zip(states, cfg.indexer_types, strict=True) if kind == "full"]
    return ModelState(
        latent=jnp.stack([st.latent for st in states]),
        kv_scale=jnp.stack([st.kv_scale for st in states]),
        block_tables=jnp.asarray(tables), lengths=jnp.asarray(lengths),
        index_k=jnp.stack([st.index_k for st in full], axis=1),
        index_g=jnp.stack([st.index_g for st in full], axis=1),
        pool_keys=jnp.stack([st.pool_keys for st in full], axis=1),
    )


# ------------------------------------------------------------------------------ forward

class _Caches(NamedTuple):
    """The scan's carry of caches, flattened so a layer addresses its part by offsets."""
    latent: jax.Array  # [L*NB, bs, C]
    index_k: jax.Array  # [B, Lf*Rr, Di]
    index_g: jax.Array  # [B, Lf*Rr, Di]
    pool_keys: jax.Array  # [B, Lf*P, Di]


class _Rows(NamedTuple):
    """What every layer of one forward shares."""
    pos: jax.Array  # [B, R] int32: each row's position
    valid: jax.Array  # [B, R] bool: real rows
    lengths: jax.Array  # [B] int32
    tables: jax.Array  # [B, MB] int32: block tables, -1 where not a block of the pool
    kv_scale: jax.Array  # [L] f32
    live_rows: int  # static work-split hint for the attend (as `layer.step` gives it)
    attend_rows: int | None  # static: rows per sequence selected and attended (`layer.step`'s)


def _block(cfg: DsaConfig, w: DsaWeights, caches: _Caches, rows: _Rows, layer, full,
           x: jax.Array, shared_sel: jax.Array | None):
    """One DSA block on the flattened caches: `layer.step`'s computation, with layer `layer`
    (full layer `full`) addressed by offsets. Returns `(y [B, R, D], caches, sel [B, R, W])`."""
    nb = caches.latent.shape[0] // rows.kv_scale.shape[0]
    tmax, npool = cfg.max_context, cfg.num_pools
    view = DsaState(latent=caches.latent, kv_scale=rows.kv_scale[layer],
                    block_tables=jnp.where(rows.tables >= 0, rows.tables + layer * nb, -1),
                    index_k=caches.index_k, index_g=caches.index_g,
                    pool_keys=caches.pool_keys, lengths=rows.lengths,
                    index_lengths=rows.lengths)
    shared_launch = shares_q_launch(cfg, w, x)  # as `layer.step`: q_b beside the top-k
    proj = project(cfg, w, x, defer_q=shared_launch)
    at = x_columns(cfg)  # the writes read their columns of the x projection in place
    view = write_latents(cfg, view, proj.xw, w.kv_a_norm, rows.pos, rows.valid,
                         col=at["kv"][0])
    if w.has_indexer:
        # A row past max_context is dropped here, as in a one-layer cache: it must not land
        # in the next full layer's rows.
        view = write_index_rows(cfg, w, view, proj.xw, proj.xw, rows.pos,
                                rows.valid & (rows.pos < tmax), full,
                                cols=(at["k"][0], at["g"][0]))
        # As `layer.step` selects: the first rows it promised to fill (`cut_rows`).
        k = cut_rows(cfg, rows.attend_rows, x.shape[1])
        qi, wh, pos, valid = first_rows(k, proj.qi, proj.w, rows.pos, rows.valid)
        scores = pool_scores(cfg, qi, wh, view.pool_keys, candidate_pools(cfg, pos, valid),
                             pools=(full * npool, npool))  # [B, k, P]: keys read in place
        if shared_launch:
            slots, proj = slots_and_q_abs(cfg, w, proj, scores, pos, valid)  # [B, k, W]
        else:
            slots = expand_selection(cfg, top_pools(cfg, scores), pos, valid)  # [B, k, W]
        sel = pad_rows(slots, x.shape[1])  # [B, R, W]
    else:
        sel = jnp.where(rows.valid[..., None], shared_sel, -1)
    # As `layer.step` hands it to the output projection (the same ops in both programs).
    o_latent = attend_first_rows(cfg, view, proj.q_abs, sel, rows.valid, rows.live_rows,
                                 rows.attend_rows, w.u_v.dtype, proj.q_scaled)  # [B, R, Hl, C]
    caches = _Caches(view.latent, view.index_k, view.index_g, view.pool_keys)
    return output_projection(w, o_latent, cfg), caches, sel


# The block's weights its kernels read in place in a stack (`dsa_jax.stacked`): the GEMMs'
# (`projection.matmul` / `per_head`), the q_a RMSNorm's (`projection.norm`), the latent
# write's norm (`attend.write_latents`) and the indexer write's LayerNorm and ape
# (`indexer.write_index_rows`): every weight of a layer.
IN_PLACE_FIELDS = ("x_proj", "q_proj", "qi_proj", "u_k", "u_v", "o_proj", "q_a_norm",
                   "kv_a_norm", "k_norm_w", "k_norm_b", "ape")


def _in_place(stack: DsaWeights, index: jax.Array, layer: DsaWeights) -> DsaWeights:
    """The scan's slice `layer` of the stacked weights, with its `IN_PLACE_FIELDS` as
    `LayerOf`s of `stack` at `index` (read in place by the kernels, the slice by XLA: the
    same numbers)."""
    return layer._replace(**{f: LayerOf(getattr(stack, f), index, getattr(layer, f))
                             for f in IN_PLACE_FIELDS if getattr(layer, f) is not None})


def _island(h: jax.Array) -> jax.Array:
    """The hidden rows `h [B, R, D]` where a layer starts: a fusion boundary."""
    return lax.optimization_barrier(h)


def _segment(cfg: DsaConfig, seg: Segment, stack: Stack, h, caches: _Caches, rows: _Rows,
             hidden: bool):
    """Scan the segment's groups: each runs its full layer, then (scanned) its shared ones.
    Returns h, the caches, `sels [G, B, R, W]` and (if `hidden`) every layer's input rows
    `[G * g, B, R, D]`, else None."""
    g, eps = seg.group_size, cfg.rms_norm_eps
    # The shared layers' stacks [G, g-1, ...] as [G*(g-1), ...] (a bitcast): group i's shared
    # layer j is entry i*(g-1) + j, which the row-invariant GEMMs read in place.
    shared_stack = None if g == 1 else jax.tree.map(
        lambda a: a.reshape(-1, *a.shape[2:]), stack.shared)
    norm_stack = stack.norms.reshape(-1, stack.norms.shape[-1])  # [G*g, D]: layer j of group i
    # at i*g + j, read in place by the RMSNorm kernel

    def group(carry, xs):
        h, caches = carry
        wf, ws, norms, layer, full, gi = xs
        h = _island(h)
        h_in = h
        pre = norm(cfg, h, LayerOf(norm_stack, gi * g, norms[0]), eps)
        y, caches, sel = _block(cfg, _in_place(stack.full, gi, wf), caches, rows, layer, full,
                                pre, None)
        h = h + y
        hs = h_in[None] if hidden else None  # [1, B, R, D]
        if g > 1:
            def shared(carry, xs):
                h, caches = carry
                w, norm_w, l, j = xs
                h = _island(h)
                w = _in_place(shared_stack, gi * (g - 1) + j, w)
                pre = norm(cfg, h, LayerOf(norm_stack, gi * g + 1 + j, norm_w), eps)
                y, caches, _ = _block(cfg, w, caches, rows, l, None, pre, sel)
                return (h + y, caches), h if hidden else None

            (h, caches), shared_hs = lax.scan(
                shared, (h, caches),
                (ws, norms[1:], layer + 1 + jnp.arange(g - 1), jnp.arange(g - 1)))
            if hidden:
                hs = jnp.concatenate([hs, shared_hs])  # [g, B, R, D]
        return (h, caches), (sel, hs)

    layers = seg.first_layer + g * jnp.arange(seg.num_groups)
    fulls = seg.first_full + jnp.arange(seg.num_groups)
    (h, caches), (sels, hs) = lax.scan(
        group, (h, caches),
        (stack.full, stack.shared, stack.norms, layers, fulls, jnp.arange(seg.num_groups)))
    if hidden:
        hs = hs.reshape(-1, *hs.shape[2:])
    return h, caches, sels, hs


def lm_head(mcfg: ModelConfig, final_norm: jax.Array, head: jax.Array, h: jax.Array
            ) -> jax.Array:
    """Hidden rows `h [B, R, D]` -> logits `[B, R, V]` f32."""
    cfg = mcfg.dsa
    h = rms_norm_op(cfg, h, final_norm, cfg.rms_norm_eps)
    if kernel_rows(cfg, h.shape[:-1]):
        # Decode-shaped rows under the row-invariant GEMMs: a row's logits have the same bits
        # in a plain step (1 row), a speculative round (1 + k) and a draft model's step.
        return matmul(h, head, cfg)
    return per_sequence(cfg, lambda hb: jnp.einsum("...d,vd->...v", hb.astype(head.dtype), head,
                                                   preferred_element_type=jnp.float32), h, 1)


def step_rows(cfg: DsaConfig, rows: int) -> int:
    """Rows per sequence of a decode-shaped forward that fills at most `rows` of them (a plain
    loop step 1, a speculative round 1 + k): `rows` under the row-invariant GEMMs
    (`implementation.row_gemms`: a row has the same bits at any row count, as in
    `layer.decode_rows`), else `max_verify` (XLA's GEMMs give a row other bits at another row
    count, so every such forward runs the same padded rows)."""
    if not 1 <= rows <= cfg.max_verify:
        raise ModelError(f"a decode-shaped forward fills 1..max_verify={cfg.max_verify} rows "
                         f"per sequence; asked for {rows}")
    return rows if row_gemms(cfg) else cfg.max_verify


def forward(mcfg: ModelConfig, weights: StackedWeights, ms: ModelState, tokens: jax.Array,
            n_new: jax.Array, *, hidden: bool = False, attend_rows: int | None = None):
    """tokens [B, R] (first n_new [B] real) -> (logits [B, R, V] f32, state, sel [B, R, W]).

    `sel` is the first layer's selection. Pure and traceable; no checks (the caller's host
    side validates: lengths + n_new <= max_context, block tables cover the rows).
    Each layer starts at a fusion boundary (module docstring). hidden: also return
    every layer's input rows `[L, B, R, D]` (a fourth output, to find the first layer two
    programs differ in; it changes the program). attend_rows: static, `layer.step`'s promise
    (`n_new <= attend_rows`): every layer's selection and gather-attend run on the first
    `attend_rows` rows only, the same bits for those rows (with XLA's GEMMs a plain decode
    loop pads to max_verify rows and fills one; under the row-invariant GEMMs it runs 1 row:
    `step_rows`)."""
    cfg = mcfg.dsa
    b, r = tokens.shape
    nl, nb = ms.latent.shape[:2]
    rows = _Rows(pos=ms.lengths[:, None] + jnp.arange(r, dtype=jnp.int32),
                 valid=jnp.arange(r)[None, :] < n_new[:, None],
                 lengths=ms.lengths,
                 tables=jnp.where(ms.block_tables < nb, ms.block_tables, -1),
                 kv_scale=ms.kv_scale, live_rows=live_rows(cfg, tokens),
                 attend_rows=attend_rows)
    caches = _Caches(ms.latent.reshape(nl * nb, *ms.latent.shape[2:]),
                     ms.index_k.reshape(b, -1, ms.index_k.shape[-1]),
                     ms.index_g.reshape(b, -1, ms.index_g.shape[-1]),
                     ms.pool_keys.reshape(b, -1, ms.pool_keys.shape[-1]))
    h = weights.embed[tokens]  # [B, R, D]
    sel0, hs = None, []
    for seg, stack in zip(layer_plan(cfg.indexer_types), weights.segments, strict=True):
        h, caches, sels, seg_hs = _segment(cfg, seg, stack, h, caches, rows, hidden)
        sel0 = sels[0] if sel0 is None else sel0
        hs.append(seg_hs)
    logits = lm_head(mcfg, weights.final_norm, weights.lm_head, _island(h))
    ms = ms._replace(latent=caches.latent.reshape(ms.latent.shape),
                     index_k=caches.index_k.reshape(ms.index_k.shape),
                     index_g=caches.index_g.reshape(ms.index_g.shape),
                     pool_keys=caches.pool_keys.reshape(ms.pool_keys.shape),
                     lengths=ms.lengths + n_new)
    if hidden:
        return logits, ms, sel0, jnp.concatenate(hs)
    return logits, ms, sel0


def forward_unrolled(mcfg: ModelConfig, weights: ModelWeights, states, tokens: jax.Array,
                     n_new: jax.Array, *, hidden: bool = False,
                     attend_rows: int | None = None):
    """The reference: `forward` with one `layer.step` per layer over per-layer states (the
    same fusion boundaries as `forward`; `hidden` and
    `attend_rows` likewise)."""
    cfg = mcfg.dsa
    h = weights.embed[tokens]  # [B, R, D]
    new_states, sel, sel0, hs = [], None, None, []
    for i, (lw, st) in enumerate(zip(weights.layers, states, strict=True)):
        shared = None if lw.has_indexer else sel
        h = _island(h)
        hs.append(h)
        y, st, sel = step(cfg, lw, st, rms_norm_op(cfg, h, weights.norms[i], cfg.rms_norm_eps),
                          n_new, shared, attend_rows=attend_rows)
        sel0 = sel if sel0 is None else sel0
        h = h + y
        new_states.append(st)
    logits = lm_head(mcfg, weights.final_norm, weights.lm_head, _island(h))
    if hidden:
        return logits, tuple(new_states), sel0, jnp.stack(hs)
    return logits, tuple(new_states), sel0
