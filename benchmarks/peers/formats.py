"""Our caches in the peers' byte layouts, built with jnp (no torch), so that a peer reads the
same fp8 bytes our kernels read. The layouts are the peers' documented ones:

- FlashMLA's V32 fp8 sparse cache (`flash_mla_interface.py`): per token 656 bytes, 512
  float8_e4m3 NoPE values, 4 f32 scales (one per 128 values), 64 bf16 RoPE values.
- DeepGEMM's paged fp8 indexer cache (`tests/test_attention.py`): per block of `block_kv`
  keys, their fp8 values, then one f32 scale per key (amax / 448).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

V32_NOPE, V32_TILE, V32_ROPE = 512, 128, 64  # FlashMLA's V32 layout: values, scale tile, RoPE
V32_BYTES = V32_NOPE + 4 * (V32_NOPE // V32_TILE) + 2 * V32_ROPE  # 656
FLASHMLA_TOPK = 64  # FlashMLA's decode takes top-k index lists in multiples of this
FLASHMLA_PREFILL_TOPK = 128  # its sparse prefill: multiples of 2 x its 64-slot block
FP8_MAX = 448.0


def as_bytes(x: jax.Array) -> jax.Array:
    """`x [...]` -> its little-endian bytes `u8 [..., itemsize]` (`[...]` for 1-byte types)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


@jax.jit
def flashmla_v32_cache(latent: jax.Array, kv_scale: jax.Array) -> jax.Array:
    """Our fp8 latent cache `[NB, bs, 512]` (one per-tensor scale `kv_scale []`) -> FlashMLA's
    V32 cache `u8 [NB, bs, 1, 656]`: the same fp8 bytes, every tile scale `kv_scale`, the RoPE
    part zeros (our block has none; with a zero RoPE query it adds nothing to a score)."""
    nb, bs, c = latent.shape  # [NB, bs, C]
    if c != V32_NOPE or latent.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"flashmla_v32_cache: latent {latent.dtype}[..., {c}]; FlashMLA's V32 "
                         f"layout holds float8_e4m3fn[..., {V32_NOPE}]")
    scales = jnp.broadcast_to(kv_scale.astype(jnp.float32), (nb, bs, V32_NOPE // V32_TILE))
    rope = jnp.zeros((nb, bs, 2 * V32_ROPE), jnp.uint8)
    row = jnp.concatenate([as_bytes(latent), as_bytes(scales).reshape(nb, bs, -1), rope], -1)
    return row[:, :, None]  # [NB, bs, 1, 656]


def flashmla_query(q: jax.Array) -> jax.Array:
    """`q [..., H, 512]` -> bf16 `[..., H, 576]`, the RoPE part zeros."""
    pad = [(0, 0)] * (q.ndim - 1) + [(0, V32_ROPE)]
    return jnp.pad(q.astype(jnp.bfloat16), pad)


def token_slots(tokens: jax.Array, block_table: jax.Array, block_size: int) -> jax.Array:
    """One sequence's token positions `[..., W]` (-1: none) -> flat cache slots (`table[t //
    bs] * bs + t % bs`, the paged layout `DsaState` documents); -1 stays -1."""
    logical = jnp.clip(tokens // block_size, 0, block_table.shape[0] - 1)
    return jnp.where(tokens >= 0, block_table[logical] * block_size + tokens % block_size, -1)


def padded_indices(slots: jax.Array, multiple: int = FLASHMLA_TOPK) -> jax.Array:
    """Flat cache slots `[..., W]` (-1: none) padded with -1 to a multiple of `multiple`."""
    w = slots.shape[-1]
    extra = -w % multiple
    pad = [(0, 0)] * (slots.ndim - 1) + [(0, extra)]
    return jnp.pad(slots.astype(jnp.int32), pad, constant_values=-1)


@jax.jit
def dequantized_latents(latent: jax.Array, kv_scale: jax.Array) -> jax.Array:
    """`[NB, bs, C]` fp8 -> bf16 `[NB*bs, 1, C]` (FlashMLA's sparse prefill reads bf16 keys;
    exact where kv_scale is a power of two: an e4m3 value times 2^k fits bf16)."""
    nb, bs, c = latent.shape
    return (latent.astype(jnp.float32) * kv_scale).astype(jnp.bfloat16).reshape(nb * bs, 1, c)


def deepgemm_fp8_keys(keys: jax.Array, block_kv: int = 64) -> tuple[jax.Array, jax.Array]:
    """Pool keys `[B, P, D]` -> (DeepGEMM's paged fp8 cache `u8 [B*P/block_kv, block_kv, 1,
    D + 4]`, its block table `i32 [B, P/block_kv]`): per key fp8(k / s), s = max(amax(k),
    1e-4) / 448 as f32, a block's values first, then its scales."""
    b, p, d = keys.shape
    if p % block_kv:
        raise ValueError(f"deepgemm_fp8_keys: {p} pool keys, not a multiple of {block_kv}")
    return _deepgemm_fp8_keys(keys, block_kv)


@functools.partial(jax.jit, static_argnums=1)
def _deepgemm_fp8_keys(keys, block_kv):
    b, p, d = keys.shape
    nblk = b * p // block_kv
    k = keys.astype(jnp.float32).reshape(nblk, block_kv, d)  # [N, bk, D]
    sf = jnp.maximum(jnp.max(jnp.abs(k), -1), 1e-4) / FP8_MAX  # [N, bk]
    vals = as_bytes((k * (1.0 / sf)[..., None]).astype(jnp.float8_e4m3fn))
    packed = jnp.concatenate([vals.reshape(nblk, block_kv * d),
                              as_bytes(sf).reshape(nblk, block_kv * 4)], -1)
    table = jnp.arange(nblk, dtype=jnp.int32).reshape(b, p // block_kv)
    return packed.reshape(nblk, block_kv, 1, d + 4), table
