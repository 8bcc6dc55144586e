"""Small definitions the model and its kernels share (no imports of ours): the FP8 storage
rounding, rounding to a narrower float, block sizes, the pools visible at a position and the
indexer ring's mark. The kernels (`dsa_jax.pallas`) and the model's modules both import
them from here, so each has one definition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes are powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def quantize(c: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """fp32 values -> a cache dtype. float8_e4m3fn: `clip(c / scale, -448, 448)`, saturating
    (the cast alone would turn values past 448 into NaN); any other dtype: a plain cast."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        return jnp.clip(c / scale, -FP8_MAX, FP8_MAX).astype(dtype)
    return c.astype(dtype)


def round_to(v: jax.Array, dtype) -> jax.Array:
    """fp32 values rounded to `dtype`'s (bf16, f16: round to nearest even; f32: as they are),
    still fp32: what a store in `dtype` and a read give. By `lax.reduce_precision`, which XLA
    keeps; a cast pair inside one program it may drop (excess precision: on the CPU a
    reference's pool keys stayed fp32)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return v
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"round_to: dtype {dtype.name} is not bfloat16, float16 or float32")
    info = jnp.finfo(dtype)
    return lax.reduce_precision(v, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def candidate_pools(pos: jax.Array, valid: jax.Array, kpool: int) -> jax.Array:
    """Complete pools visible at `pos`: `(t + 1) // KP`; 0 where not valid (the pool-score
    kernel then reads no key)."""
    return jnp.where(valid, (pos + 1) // kpool, 0)


def mark_after(lengths, marks, n_new, ring_rows: int):
    """The ring mark after a step writes `n_new` rows at `lengths` (numpy or jnp; `[B]`, or
    any tile): rows `[M' - Rr, lengths + n_new)` are then held. A mark more than Rr ahead
    (left by a rewind to a pool boundary) says nothing about the rows the step writes, hence
    the min. `state.ring_mark_after` is this at the config's Rr."""
    xp = np if isinstance(lengths, np.ndarray) else jnp
    return xp.maximum(xp.minimum(marks, lengths + ring_rows), lengths + n_new)


def tree_sum(v: jax.Array) -> jax.Array:
    """`v [..., n]` summed over its last axis in a fixed pairwise tree -> `[...]`: halves added
    elementwise (zeros padding `n` to a power of two) until one column is left. Each output's
    association depends on `n` alone, never on how many rows there are or how XLA vectorizes
    a reduction over them (XLA:CPU's reduce gives a row other bits in another batch); the
    batch-invariant definitions sum with it."""
    n = v.shape[-1]
    v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, next_pow2(n) - n)])  # [..., 2^k]
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]
