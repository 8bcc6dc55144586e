"""Helpers every kernel file shares: padding sizes, the FP8 quantize, tuning overrides, the
device's multiprocessor count."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Multiprocessors of an H100 / H200 SXM, the GPUs the kernels are tuned on: the count assumed
# where the device does not report its own (CPU, interpret mode).
DEFAULT_SM_COUNT = 132

T = TypeVar("T")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes are powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def quantize(c: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """fp32 values -> a cache dtype. float8_e4m3fn: `clip(c / scale, -448, 448)`, saturating
    (the cast alone would turn values past 448 into NaN); any other dtype: a plain cast."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        return jnp.clip(c / scale, -FP8_MAX, FP8_MAX).astype(dtype)
    return c.astype(dtype)


def sm_count(device: jax.Device | None = None) -> int:
    """Multiprocessors of `device` (default: the first device) as the GPU reports them
    (`core_count`), `DEFAULT_SM_COUNT` where the device reports none."""
    device = jax.devices()[0] if device is None else device
    count = getattr(device, "core_count", None)
    return int(count) if count else DEFAULT_SM_COUNT


def with_overrides(tuning: T, overrides: dict[str, Any]) -> T:
    """`tuning` (a frozen dataclass) with the fields named in `overrides` replaced: the kernels'
    individual tuning keywords. An unknown name raises, naming the fields there are."""
    if not overrides:
        return tuning
    names = [f.name for f in dataclasses.fields(tuning)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"{type(tuning).__name__} has no field(s) {unknown}; its fields are "
                        f"{names}")
    return dataclasses.replace(tuning, **overrides)
