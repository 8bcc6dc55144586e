"""The per-layer state pytree (SPEC.md "Storage"), all shapes fixed by the config's ceiling.

`B` is the number of sequence slots the state was built for, `NB` physical latent blocks of
`bs = cfg.block_size` tokens, `MB = cfg.blocks_per_seq` block-table entries per sequence,
`Tmax = cfg.max_context`, `P = cfg.num_pools`, `Rr = ring_rows(cfg)`.

The indexer ring (docs/decisions.md, "The indexer ring"): once a pool is complete only its key
is read, so the raw indexer rows (`k`, gate) are kept for the last `Rr` positions only, position
`t` at ring slot `t % Rr`. A step reads raw rows only for the pool it completes, and only the
members written before the step (the incomplete pool's, fewer than `KP`); the rest come from the
step's own rows. `index_lengths` is the ring's mark `M`: rows at positions `[M - Rr, lengths)`
are held; positions `[lengths, M)` may hold a rejected speculation's rows (the indexer "ahead").
A rewind keeps the mark, so a later rewind knows how far the ring still reaches; a rewind
whose target pool lost members is refused (`ring_holds`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.config import DsaConfig
from dsa_jax.errors import StateError
from dsa_jax.numerics import mark_after, next_pow2, quantize, round_to


class DsaState(NamedTuple):
    latent: jax.Array  # [NB, bs, C] cache dtype: the paged latent cache
    kv_scale: jax.Array  # [] f32: per-tensor scale, stored = clip(c / s), read = stored * s
    block_tables: jax.Array  # [B, MB] int32: logical block -> physical block, per sequence
    index_k: jax.Array  # [B, Rr, Di] index dtype: ring of k_norm(W_k x), position t at t % Rr
    index_g: jax.Array  # [B, Rr, Di] index dtype: ring of the gate W_gate x, likewise
    pool_keys: jax.Array  # [B, P, Di] index dtype: K_p (fp32 sums, stored rounded) once p completes
    lengths: jax.Array  # [B] int32: tokens in the latent cache
    # [B] int32: the ring's mark M >= lengths (= lengths while a sequence only grows): rows
    # [M - Rr, lengths) are held, [lengths, M) may be a rejected speculation's. A layer without
    # an indexer keeps M = lengths.
    index_lengths: jax.Array

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


def init_state(cfg: DsaConfig, num_seqs: int, *, num_blocks: int | None = None,
               kv_scale: float = 1.0, block_tables: np.ndarray | jax.Array | None = None,
               has_indexer: bool = True, shards: int = 1) -> DsaState:
    """An empty state for `num_seqs` sequences.

    By default every sequence owns `cfg.blocks_per_seq` contiguous physical blocks (sequence
    `b` maps logical block `i` to `b * MB + i`). An allocator passes its own `block_tables`
    `[num_seqs, MB]` and `num_blocks`: every entry is a physical block in `[0, num_blocks)` or
    -1 (not mapped yet), and no physical block is mapped twice (two sequences sharing a block
    would overwrite each other). A "shared" layer (`has_indexer=False`) keeps no indexer
    cache: its indexer arrays have 0 rows. `shards` > 1: a state split over that many data-
    parallel shards (dsa_jax.sharding): sequences and blocks split evenly, and each group's
    table entries are shard-local ids, checked within the shard's own pool of
    `num_blocks / shards` blocks. Bad arguments raise `StateError`.
    """
    if not _is_int(num_seqs) or num_seqs <= 0:
        raise StateError(f"num_seqs must be a positive integer, got {num_seqs!r}")
    if not isinstance(has_indexer, (bool, np.bool_)):
        raise StateError(f"has_indexer must be a bool, got {has_indexer!r}")
    kv_scale = check_kv_scale(kv_scale)
    mb = cfg.blocks_per_seq
    if num_blocks is None:
        num_blocks = num_seqs * mb
    if not _is_int(num_blocks) or num_blocks <= 0:
        raise StateError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    if block_tables is None:
        block_tables = np.arange(num_seqs * mb, dtype=np.int32).reshape(num_seqs, mb)
    elif not hasattr(block_tables, "shape"):
        block_tables = np.asarray(block_tables)
    if tuple(block_tables.shape) != (num_seqs, mb):
        raise StateError(f"block_tables has shape {tuple(block_tables.shape)}, expected "
                         f"({num_seqs}, {mb}) = (num_seqs, max_context / block_size)")
    if not np.issubdtype(np.dtype(block_tables.dtype), np.integer):
        raise StateError(f"block_tables must hold integers, got dtype "
                         f"{np.dtype(block_tables.dtype).name}")
    if not _is_int(shards) or shards < 1 or num_seqs % shards or num_blocks % shards:
        raise StateError(f"shards must be a positive integer dividing num_seqs {num_seqs} and "
                         f"num_blocks {num_blocks}, got {shards!r}")
    if not isinstance(block_tables, jax.core.Tracer):
        tables, rows = np.asarray(block_tables), num_seqs // shards
        for g in range(shards):  # each shard's sequences map into its own pool
            check_block_tables(tables[g * rows:(g + 1) * rows], num_blocks // shards,
                               first_seq=g * rows, shard=g if shards > 1 else None)
    block_tables = jnp.asarray(block_tables, jnp.int32)
    idt = jnp.dtype(cfg.index_cache_dtype)
    Di = cfg.index_head_dim
    rows, pools = (ring_rows(cfg), cfg.num_pools) if has_indexer else (0, 0)
    return DsaState(
        latent=jnp.zeros((num_blocks, cfg.block_size, cfg.kv_lora_rank), cfg.cache_dtype),
        kv_scale=jnp.asarray(kv_scale, jnp.float32),
        block_tables=block_tables,
        index_k=jnp.zeros((num_seqs, rows, Di), idt),
        index_g=jnp.zeros((num_seqs, rows, Di), idt),
        pool_keys=jnp.zeros((num_seqs, pools, Di), idt),
        lengths=jnp.zeros((num_seqs,), jnp.int32),
        index_lengths=jnp.zeros((num_seqs,), jnp.int32),
    )


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_kv_scale(kv_scale) -> float:
    """`kv_scale` as a Python float, or `StateError`: a finite real number > 0 (an int, float,
    numpy real scalar or 0-d real array; never a bool, string or complex number)."""
    value = kv_scale
    if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer) \
            and value.shape == () and np.issubdtype(np.dtype(value.dtype), np.floating):
        value = float(value)
    ok = (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, (bool, np.bool_)) and np.isfinite(value) and value > 0)
    if not ok:
        raise StateError(f"kv_scale must be a finite real number > 0, got {kv_scale!r}")
    return float(value)


def check_block_tables(tables: np.ndarray, num_blocks: int, first_seq: int = 0,
                       shard: int | None = None) -> None:
    """Entries in `[-1, num_blocks)` (-1: not mapped) and no physical block mapped twice.
    `first_seq`, `shard`: the table's first sequence and its dp shard, for the message."""
    bad = (tables < -1) | (tables >= num_blocks)
    if bad.any():
        s, i = (int(v) for v in np.argwhere(bad)[0])
        raise StateError(f"block_tables: sequence {first_seq + s} entry {i} is {tables[s, i]}, "
                         f"outside [-1, {num_blocks}) (-1 = not mapped, else a physical "
                         f"block{'' if shard is None else f' of shard {shard}'})")
    twice = mapped_twice(tables, tables >= 0, num_blocks, first_seq)
    if twice is not None:
        raise StateError(f"block_tables: {twice} (two entries sharing a block overwrite "
                         f"each other)")


def mapped_twice(tables: np.ndarray, mask: np.ndarray, num_blocks: int, first_seq: int = 0
                 ) -> str | None:
    """None, or which physical block two entries `mask`ed in `tables [B, MB]` share (entries
    must be in `[0, num_blocks)` where `mask`). One bincount: cheap enough for every step."""
    blocks = tables[mask]
    if not len(blocks) or np.bincount(blocks, minlength=num_blocks).max() <= 1:
        return None
    seq, col = np.nonzero(mask)  # row-major: sequence, then entry
    order = np.argsort(blocks, kind="stable")
    first = int(np.flatnonzero(blocks[order][1:] == blocks[order][:-1])[0])
    a, b = order[first], order[first + 1]
    return (f"physical block {blocks[a]} is mapped twice: sequence {first_seq + seq[a]} entry "
            f"{col[a]} and sequence {first_seq + seq[b]} entry {col[b]}")


@functools.cache
def expected_state_fields(cfg: DsaConfig, num_seqs: int, num_blocks: int, has_indexer: bool
                          ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Field -> (shape, dtype) of a state built for `cfg` (what `init_state` makes).
    Cached: read it, do not change it."""
    rows, pools = (ring_rows(cfg), cfg.num_pools) if has_indexer else (0, 0)
    di, idt = cfg.index_head_dim, jnp.dtype(cfg.index_cache_dtype)
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    return {
        "latent": ((num_blocks, cfg.block_size, cfg.kv_lora_rank),
                   jnp.dtype(cfg.cache_dtype)),
        "kv_scale": ((), f32),
        "block_tables": ((num_seqs, cfg.blocks_per_seq), i32),
        "index_k": ((num_seqs, rows, di), idt),
        "index_g": ((num_seqs, rows, di), idt),
        "pool_keys": ((num_seqs, pools, di), idt),
        "lengths": ((num_seqs,), i32),
        "index_lengths": ((num_seqs,), i32),
    }


def quantize_latent(cfg: DsaConfig, c: jax.Array, kv_scale: jax.Array) -> jax.Array:
    """fp32 latent -> cache dtype. fp8: `clip(c / s, -448, 448)`; others: a plain cast."""
    return quantize(c, kv_scale, cfg.cache_dtype)


def dequantize_latent(cfg: DsaConfig, stored: jax.Array, kv_scale: jax.Array) -> jax.Array:
    """Cache dtype -> fp32. fp8: `stored * s`."""
    if cfg.cache_dtype == "float8_e4m3fn":
        return stored.astype(jnp.float32) * kv_scale
    return stored.astype(jnp.float32)


def latent_storage(cfg: DsaConfig, kv_scale):
    """The latent cache's storage as a round trip f32 -> f32 (fp8: quantized with `kv_scale`
    and dequantized, as a state of `cfg` stores and reads it; bf16, f16: rounded with
    `round_to`; f32: as it is): for `reference.forward(..., latent_roundtrip=)`."""
    if cfg.cache_dtype == "float8_e4m3fn":
        return lambda c: dequantize_latent(cfg, quantize_latent(cfg, c, kv_scale), kv_scale)
    return lambda c: round_to(jnp.asarray(c, jnp.float32), cfg.cache_dtype)


def index_storage(cfg: DsaConfig):
    """The index cache's storage as a round trip f32 -> f32 (the indexer's k, gate and pool
    keys as a state holds them): for `reference.forward(..., index_roundtrip=)`. Rounds with
    `lax.reduce_precision`, which XLA keeps inside jit; `v.astype(bf16).astype(f32)` there can
    be dropped (excess precision), and the reference would score unrounded keys."""
    return lambda v: round_to(jnp.asarray(v, jnp.float32), cfg.index_cache_dtype)


def state_bytes_per_seq(cfg: DsaConfig) -> int:
    """Bytes one sequence holds at `max_context`: latent, the indexer ring (k and gate), pool
    keys, its block-table row and its two lengths."""
    return int(sum(state_bytes_breakdown(cfg).values()))


def state_bytes_breakdown(cfg: DsaConfig) -> dict[str, int]:
    """`state_bytes_per_seq` by part (bytes)."""
    return {
        "latent": cfg.max_context * cfg.kv_lora_rank * jnp.dtype(cfg.cache_dtype).itemsize,
        "index_ring_k_and_g": 2 * ring_rows(cfg) * cfg.index_head_dim
        * jnp.dtype(cfg.index_cache_dtype).itemsize,
        "pool_keys": cfg.num_pools * cfg.index_head_dim
        * jnp.dtype(cfg.index_cache_dtype).itemsize,
        "block_table": cfg.blocks_per_seq * 4,
        "lengths": 8,
    }


# ------------------------------------------------------------------------- the indexer ring

def ring_guard(cfg: DsaConfig) -> int:
    """G: rows by which a mark may understate the ring's true extent. A `ModelState` keeps no
    mark: its per-layer states (`model.unfold_state`) get mark = lengths, while the serving
    loop may have left up to `max_verify - 1` rejected rows past it."""
    return cfg.max_verify - 1


def ring_rows(cfg: DsaConfig) -> int:
    """Rr, the ring's rows per sequence: a power of two >= KP - 1 + max_verify + G, so that a
    verify of max_verify rows can be rewound to any row of it (its pool's earlier members,
    up to KP - 1 rows before the verify, are still held, with the guard G to spare)."""
    return next_pow2(cfg.index_kpool - 1 + cfg.max_verify + ring_guard(cfg))


def ring_reach(cfg: DsaConfig) -> int:
    """Rows below the mark any rewind may drop (a rewind to a pool boundary may go further):
    Rr - G - (KP - 1)."""
    return ring_rows(cfg) - ring_guard(cfg) - (cfg.index_kpool - 1)


def ring_holds(cfg: DsaConfig, lengths, marks):
    """Whether a sequence at `lengths` with ring mark `marks` (both [B], numpy or jnp) still
    has the rows its next step reads: the incomplete pool's members `q .. lengths - 1`
    (q = lengths // KP * KP; none at a pool boundary), all at or past `marks + G - Rr`."""
    kp = cfg.index_kpool
    first = lengths // kp * kp
    return (first == lengths) | (first >= marks + ring_guard(cfg) - ring_rows(cfg))


def ring_from_rows(cfg: DsaConfig, rows, marks) -> jax.Array:
    """Every raw row `[B, T, Di]` (positions 0..T-1, the layout before the ring) -> the ring
    `[B, Rr, Di]` a ring state with marks `marks [B]` holds: positions `[M - Rr, M)` at their
    slots (slots of negative positions stay zero). For converting old checkpoints."""
    rows_np, marks = np.asarray(rows), np.asarray(marks, np.int64)
    r = ring_rows(cfg)
    pos = marks[:, None] - r + np.arange(r)  # [B, Rr]: distinct slots
    ring = np.zeros((rows_np.shape[0], r, rows_np.shape[2]), rows_np.dtype)
    seq, j = np.nonzero((pos >= 0) & (pos < rows_np.shape[1]))
    ring[seq, pos[seq, j] % r] = rows_np[seq, pos[seq, j]]
    return jnp.asarray(ring)


def ring_mark_after_rewind(cfg: DsaConfig, lengths, marks):
    """The mark after a rewind to `lengths` (numpy or jnp, [B]): kept, so later rewinds still
    count from the rows the ring may hold, but at most `lengths + Rr - G`. Past that (a rewind
    to a pool boundary further back) the steps that follow write every row they later read
    (positions >= lengths, a boundary) after the stale ones, and a kept mark would make the
    guard refuse those fresh rows; rows below `lengths` stay unreachable for rewinds other
    than to a pool boundary, as `ring_holds` then asks for positions >= lengths."""
    xp = np if isinstance(lengths, np.ndarray) else jnp
    return xp.minimum(marks, lengths + (ring_rows(cfg) - ring_guard(cfg)))


def ring_mark_after(cfg: DsaConfig, lengths, marks, n_new):
    """The mark after a step writes `n_new` rows at `lengths` (numpy or jnp, [B]): rows
    `[M' - Rr, lengths + n_new)` are then held (`row_meta.mark_after` at this config's Rr)."""
    return mark_after(lengths, marks, n_new, ring_rows(cfg))
