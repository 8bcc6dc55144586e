"""Helpers every kernel file shares: padding sizes, the FP8 quantize (`dsa_jax.numerics`),
addressing limits, tuning overrides, the device's multiprocessor count."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

# The model's shared definitions, which the kernels import from here too.
from dsa_jax.errors import KernelLimitError
from dsa_jax.numerics import FP8_MAX, next_pow2, quantize, round_to  # noqa: F401

# Multiprocessors of an H100 / H200 SXM, the GPUs the kernels are tuned on: the count assumed
# where the device does not report its own (CPU, interpret mode).
DEFAULT_SM_COUNT = 132

T = TypeVar("T")


def load_parts(ref, parts: int, *index, mask, other=0.0):
    """`ref [S, ...]` loaded at `index` in each of its first `parts` parts and summed in part
    order (((p0 + p1) + p2) + ...): the f32 adds `matmul`'s split sum makes, so the same
    values as loading that sum. Inside a Pallas Triton kernel."""
    v = plt.load(ref.at[(0, *index)], mask=mask, other=other)
    for s in range(1, parts):
        v = v + plt.load(ref.at[(s, *index)], mask=mask, other=other)
    return v


def check_triton_blocks(tuning, names: tuple[str, ...]) -> None:
    """Refuse a tuning whose block fields `names` are not powers of two >= 16 (Triton's block
    shapes and dot tiles), naming the field and its value."""
    for name in names:
        b = getattr(tuning, name)
        if b < 16 or b & (b - 1):
            raise ValueError(f"{type(tuning).__name__}.{name}={b} must be a power of two >= 16 "
                             f"(Triton)")


# jax's Pallas Triton lowering computes element offsets in 32-bit integers for any array of at
# most 2**32 bytes (64-bit only above), so an array of 2**31 or more elements in that range
# (fp8: 2..4 GiB; bf16: exactly 4 GiB) is addressed with offsets that wrap: the kernel writes
# out of bounds. Pallas Triton cannot bitcast a ref; a word view made in jnp is a free bitcast
# on the GPU, but a write packing words there stored other bits than the per-element kernel,
# so the latent write stores through XLA in that zone (latent_write.py) and the Triton attend
# refuses.

TRITON_OFFSET_ELEMENTS = 2 ** 31
TRITON_64BIT_BYTES = 2 ** 32


def triton_offsets_wrap(shape, dtype) -> bool:
    """Whether a Pallas Triton kernel would address an array of `shape` and `dtype` with 32-bit
    element offsets that wrap: 2**31 or more elements (conservative by one: the last offset
    is elements - 1) in at most 2**32 bytes."""
    elements = 1
    for d in shape:
        elements *= int(d)
    nbytes = elements * jnp.dtype(dtype).itemsize
    return elements >= TRITON_OFFSET_ELEMENTS and nbytes <= TRITON_64BIT_BYTES


def check_triton_addressable(shape, dtype, what: str) -> None:
    """Raise `KernelLimitError`, before anything runs, if a Pallas Triton kernel would address an
    array of `shape` and `dtype` with 32-bit offsets that wrap (`triton_offsets_wrap`)."""
    if triton_offsets_wrap(shape, dtype):
        nbytes = jnp.dtype(dtype).itemsize
        for d in shape:
            nbytes *= int(d)
        raise KernelLimitError(
            f"{what} {tuple(shape)} {jnp.dtype(dtype).name} is {nbytes} bytes: the Pallas "
            f"Triton kernels address arrays of at most {TRITON_64BIT_BYTES} bytes with 32-bit "
            f"offsets, which wrap past {TRITON_OFFSET_ELEMENTS} elements; this array needs "
            f"fewer elements (fewer rows in the call), or implementation='xla'")


def sm_count(device: jax.Device | None = None) -> int:
    """Multiprocessors of `device` (default: the first device) as the GPU reports them
    (`core_count`), `DEFAULT_SM_COUNT` where the device reports none."""
    device = jax.devices()[0] if device is None else device
    count = getattr(device, "core_count", None)
    return int(count) if count else DEFAULT_SM_COUNT


def gpu_is_not_hopper(device: jax.Device | None = None) -> bool:
    """True where `device` (default: the first device) reports a CUDA compute capability whose
    major version is not 9: the Mosaic GPU kernels compile for sm_90a only, so the `auto`
    backend rules take the Triton kernels there. A device reporting none (a CPU) counts as
    Hopper, so the rule stays the Hopper one wherever the attribute is missing (jax's CUDA
    devices carry it as a string such as "9.0")."""
    device = jax.devices()[0] if device is None else device
    cc = getattr(device, "compute_capability", None)
    return bool(cc) and str(cc).split(".")[0] != "9"


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


def check_register_budgets(consumers: int, consumer_regs: int, producer_regs: int) -> None:
    """Refuse `setmaxnreg` budgets a warp-specialized Mosaic GPU kernel (`consumers` compute
    warpgroups and one producer, 128 threads each) cannot be granted: each a multiple of 8 in
    [24, 256], and together within the registers the CTA is launched with (65536 over its
    threads, at most 255 each, rounded down to a multiple of 8): `setmaxnreg` only moves
    registers within that pool, so a consumer's increase beyond it waits forever (the kernel
    hangs)."""
    for name, v in (("consumer_regs", consumer_regs), ("producer_regs", producer_regs)):
        if v % 8 or not 24 <= v <= 256:
            raise ValueError(f"{name}={v} must be a multiple of 8 in [24, 256] (setmaxnreg)")
    warpgroups = consumers + 1
    launch = min(255, 65536 // (128 * warpgroups)) // 8 * 8  # registers per thread at launch
    total = consumers * consumer_regs + producer_regs
    if total > warpgroups * launch:
        raise ValueError(f"registers {consumers} * {consumer_regs} + {producer_regs} = {total} "
                         f"per thread exceed the CTA's {warpgroups} * {launch} at launch: "
                         f"setmaxnreg.inc would wait forever")


def stacked_weight(w: jax.Array, layer: jax.Array | None, one: tuple[int, ...], what: str
                   ) -> jax.Array | None:
    """Check a weight of one layer's shape `one`, or with `layer` a stack `[G, *one]` and a
    scalar integer index; returns the index clamped to [0, G) (as XLA's dynamic index), or
    None."""
    if layer is None:
        if w.shape != one:
            raise ValueError(f"{what} has shape {w.shape}, expected {one}")
        return None
    if w.shape[1:] != one or w.ndim != len(one) + 1:
        raise ValueError(f"a stacked {what} must be [G, {', '.join(map(str, one))}]; got "
                         f"{w.shape}")
    return layer_index(layer, w.shape[0], f"{what}'s ")


def layer_index(layer: jax.Array, g: int, prefix: str) -> jax.Array:
    """A stacked weight's layer index: a scalar integer (else ValueError, its message starting
    with `prefix`), clamped to [0, g) as XLA's dynamic index clamps it, as int32."""
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"{prefix}layer must be a scalar integer index; got shape "
                         f"{list(jnp.shape(layer))}, dtype {jnp.result_type(layer)}")
    return jnp.clip(layer, 0, g - 1).astype(jnp.int32)
