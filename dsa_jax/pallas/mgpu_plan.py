"""The Mosaic GPU attend kernel's plan: its tuning, shared memory, shape support, split
count and the q scaling into f16 (`sparse_attend_mgpu` runs the kernel)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

HEADS_PER_CTA = 64  # the wgmma M of one warpgroup
BLOCK_W = 64  # slots per tile (wgmma N of the logits, K of P @ V), as FlashMLA's
# Heads of a row that share one q scale. Each group's heads are scaled by the power of two
# that brings their own largest |q| into [2^13, 2^14), so the prep runs one program per
# (row, group) rather than one per 64-head row (128 KiB of f32 read by one program), and the
# kernel scales each logit row by its head's 2^-k. A group's q is rounded at its own scale,
# at least its row's, within the same bound as one scale per row.
SCALE_HEADS = 16
SMEM_LIMIT = 227 * 1024  # shared memory one CTA may take on Hopper


@dataclasses.dataclass(frozen=True)
class MgpuTuning:
    """The Mosaic GPU kernel's tuning; `MgpuTuning()` is what the library runs.

    max_splits: most programs one row's slots are split over (`num_splits`): more splits fill
      the GPU for few rows, each split's partial costs a write, a read and a share of the merge.
      64 lets a 2051-slot row run its 33 tiles one per split.
    """

    max_splits: int = 64

    def __post_init__(self):
        if self.max_splits < 1:
            raise ValueError(f"max_splits={self.max_splits} must be >= 1")


def smem_bytes(c: int) -> int:
    """Shared memory the kernel allocates besides the staged slots: Q, two f16 tiles, P and the
    row statistics (Hopper gives a CTA at most 227 KiB)."""
    half = c // 2
    return (2 * HEADS_PER_CTA * half * 2 + 2 * 2 * BLOCK_W * half * 2
            + HEADS_PER_CTA * BLOCK_W * 2 + 2 * HEADS_PER_CTA * 4)


def supports(cache_dtype, c: int) -> str | None:
    """None if the kernel runs these shapes, else why not. C a multiple of 128 also makes
    whole 8-byte chunks of the register gather and 64-column wgmma tiles of each half."""
    if jnp.dtype(cache_dtype) != jnp.float8_e4m3fn:
        return f"cache dtype {jnp.dtype(cache_dtype).name} (the kernel gathers fp8 e4m3 rows)"
    if c % 128 or c // 2 > 256:
        return f"C={c} (needs a multiple of 128 with C/2 <= 256)"
    if smem_bytes(c) > SMEM_LIMIT:
        return f"shared memory {smem_bytes(c)} B > 227 KiB"
    return None


def num_splits(programs_per_split: int, tiles: int, sm_count: int, max_splits: int) -> int:
    """Splits per row and head block: enough CTAs (one per multiprocessor: the kernel takes
    most of its shared memory) to fill the GPU once, at most max_splits and tiles; then the
    fewest splits that keep each one's tiles at that count (no split left with padding only:
    a 33-tile row over 16 splits would run 48 tiles, over 11 it runs 33 in the same time)."""
    fit = sm_count // max(1, programs_per_split)
    most = max(1, min(max_splits, tiles, fit))
    per = -(-tiles // most)  # tiles per split
    return -(-tiles // per)


def row_scales(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [N, H, C] f32 -> (2^k_n, 2^-k_n) [N] f32 each: the power of two that brings each
    row's largest |q| into [2^13, 2^14).

    The kernel's dots take f16 operands (Hopper converts e4m3 to f16, not to bf16, in one
    instruction; e4m3 values are exact in f16, which also rounds q and p 4x finer than bf16).
    f16 has a narrow range, so q is scaled by a power of two before its rounding: exact, and
    undone in the logit scale."""
    amax = jnp.max(jnp.abs(q), axis=(1, 2))  # [N]
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))  # amax = f * 2^e, f in [0.5, 1)
    k = jnp.clip(14 - e, -126, 126).astype(jnp.int32)  # [N]
    one = jnp.ones_like(amax)
    return jnp.ldexp(one, k), jnp.ldexp(one, -k)


def head_scales(q: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """q [N, Hp, C] f32 (Hp a multiple of group) -> (2^k, 2^-k) [N, Hp] f32 each: `row_scales`
    of each group of `group` heads, given to each of its heads (`SCALE_HEADS`)."""
    n, hp, c = q.shape
    up, down = row_scales(q.reshape(n * (hp // group), group, c))  # [N * G] each
    return (jnp.repeat(up.reshape(n, hp // group), group, axis=1),
            jnp.repeat(down.reshape(n, hp // group), group, axis=1))
