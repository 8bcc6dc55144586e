"""The per-layer state pytree (SPEC.md "Storage"), all shapes fixed by the config's ceiling.

`B` is the number of sequence slots the state was built for, `NB` physical latent blocks of
`bs = cfg.block_size` tokens, `MB = cfg.blocks_per_seq` block-table entries per sequence,
`Tmax = cfg.max_context`, `P = cfg.num_pools`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.config import DsaConfig
from dsa_jax.pallas.common import quantize


class StateError(ValueError):
    """A state cannot be built as asked (sizes, scale, block tables); raised before any array
    is made."""


class DsaState(NamedTuple):
    latent: jax.Array  # [NB, bs, C] cache dtype: the paged latent cache
    kv_scale: jax.Array  # [] f32: per-tensor scale, stored = clip(c / s), read = stored * s
    block_tables: jax.Array  # [B, MB] int32: logical block -> physical block, per sequence
    index_k: jax.Array  # [B, Tmax, Di] index dtype: k_norm(W_k x) per token
    index_g: jax.Array  # [B, Tmax, Di] index dtype: gate W_gate x per token
    pool_keys: jax.Array  # [B, P, Di] f32: K_p, written when pool p completes
    lengths: jax.Array  # [B] int32: tokens in the latent cache
    index_lengths: jax.Array  # [B] int32: tokens in the indexer cache (lockstep with lengths)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


def init_state(cfg: DsaConfig, num_seqs: int, *, num_blocks: int | None = None,
               kv_scale: float = 1.0, block_tables: np.ndarray | jax.Array | None = None,
               has_indexer: bool = True) -> DsaState:
    """An empty state for `num_seqs` sequences.

    By default every sequence owns `cfg.blocks_per_seq` contiguous physical blocks (sequence
    `b` maps logical block `i` to `b * MB + i`). An allocator passes its own `block_tables`
    and `num_blocks`; entries it has not handed out may hold any value, since positions are
    only ever written through entries below the sequence's length. A "shared" layer
    (`has_indexer=False`) keeps no indexer cache: its indexer arrays have 0 rows.
    """
    if num_seqs <= 0:
        raise ValueError(f"num_seqs must be positive, got {num_seqs}")
    if not kv_scale > 0:
        raise ValueError(f"kv_scale must be positive, got {kv_scale}")
    mb = cfg.blocks_per_seq
    if num_blocks is None:
        num_blocks = num_seqs * mb
    if block_tables is None:
        block_tables = np.arange(num_seqs * mb, dtype=np.int32).reshape(num_seqs, mb)
    block_tables = jnp.asarray(block_tables, jnp.int32)
    if block_tables.shape != (num_seqs, mb):
        raise ValueError(f"block_tables has shape {block_tables.shape}, expected "
                         f"({num_seqs}, {mb}) = (num_seqs, max_context / block_size)")
    idt = jnp.dtype(cfg.index_cache_dtype)
    Di = cfg.index_head_dim
    rows, pools = (cfg.max_context, cfg.num_pools) if has_indexer else (0, 0)
    return DsaState(
        latent=jnp.zeros((num_blocks, cfg.block_size, cfg.kv_lora_rank), cfg.cache_dtype),
        kv_scale=jnp.asarray(kv_scale, jnp.float32),
        block_tables=block_tables,
        index_k=jnp.zeros((num_seqs, rows, Di), idt),
        index_g=jnp.zeros((num_seqs, rows, Di), idt),
        pool_keys=jnp.zeros((num_seqs, pools, Di), jnp.float32),
        lengths=jnp.zeros((num_seqs,), jnp.int32),
        index_lengths=jnp.zeros((num_seqs,), jnp.int32),
    )


def quantize_latent(cfg: DsaConfig, c: jax.Array, kv_scale: jax.Array) -> jax.Array:
    """fp32 latent -> cache dtype. fp8: `clip(c / s, -448, 448)`; others: a plain cast."""
    return quantize(c, kv_scale, cfg.cache_dtype)


def dequantize_latent(cfg: DsaConfig, stored: jax.Array, kv_scale: jax.Array) -> jax.Array:
    """Cache dtype -> fp32. fp8: `stored * s`."""
    if cfg.cache_dtype == "float8_e4m3fn":
        return stored.astype(jnp.float32) * kv_scale
    return stored.astype(jnp.float32)


def state_bytes_per_seq(cfg: DsaConfig) -> int:
    """Bytes one sequence holds at `max_context` (latent + indexer caches + pool keys)."""
    latent = cfg.max_context * cfg.kv_lora_rank * jnp.dtype(cfg.cache_dtype).itemsize
    index = 2 * cfg.max_context * cfg.index_head_dim * jnp.dtype(cfg.index_cache_dtype).itemsize
    pools = cfg.num_pools * cfg.index_head_dim * 4
    return int(latent + index + pools + cfg.blocks_per_seq * 4 + 8)
