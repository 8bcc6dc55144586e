"""The XLA compile options under which a step's bits do not depend on the program around it.

XLA's GPU compiler picks each GEMM's split-K (how many K-chunks it sums, and so the order of
the sum) per program: from the row count, the other work in the program and autotuning. The
same projection then rounds differently in a prefill of 128 rows and one of 64 (a dp=2
device), in a tp=2 rank's program and one GPU's, in the scanned model and the unrolled one,
and a row whose pools sit at a near-tie selects another pool. Forcing split-K to 1 makes the
GEMMs sum in one order whatever the program (on the H200 the scanned model and the unrolled
one, and a prefill at 128 and at 64 rows, then agreed bit for bit).

Every program this library compiles (`decode`, `decode_k`, `prefill`, `write_kv_row`, the
sharded steps, the serving programs, the NNX module) uses `BITWISE_OPTIONS`; a caller who jits
`dsa_jax.layer.step` into a program of their own gets the same guarantee with `bitwise_jit`.
The options are GPU compiler options: other backends ignore them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

BITWISE_OPTIONS: dict[str, Any] = {"xla_gpu_experimental_force_split_k": 1}
# What jax says when a jit with compile options is called inside another trace.
NESTED_REFUSAL = "can only be passed to top-level"


class BitwiseJitted:
    """A function jitted twice: with `BITWISE_OPTIONS` when called with concrete arrays (a
    top-level program), plainly when called inside another trace (jax takes compile options
    only at the top level; there the outer program's options decide, see `bitwise_jit`)."""

    def __init__(self, fn, compiler_options: dict[str, Any], jit_kwargs: dict[str, Any]):
        self.top = jax.jit(fn, compiler_options=compiler_options, **jit_kwargs)
        self.nested = jax.jit(fn, **jit_kwargs)
        self.compiler_options = compiler_options
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        try:  # the top-level call is the hot path: no look at the arguments first
            return self.top(*args, **kwargs)
        except ValueError as e:
            if NESTED_REFUSAL not in str(e):
                raise
        return self.nested(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.top.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.top.trace(*args, **kwargs)

    def _cache_size(self) -> int:
        return self.top._cache_size()


def bitwise_jit(fn, *, compiler_options: dict[str, Any] | None = None,
                **jit_kwargs) -> BitwiseJitted:
    """`jax.jit(fn, **jit_kwargs)` compiled with `BITWISE_OPTIONS` (plus `compiler_options`,
    which may not override them) when called at the top level. Called inside the caller's own
    `jax.jit`, it inlines into that program, whose compile options then decide: jit the
    outermost function with `bitwise_jit` (or `compiler_options=BITWISE_OPTIONS`) to keep the
    guarantee."""
    extra = dict(compiler_options or {})
    clash = sorted(k for k in extra if k in BITWISE_OPTIONS and extra[k] != BITWISE_OPTIONS[k])
    if clash:
        raise ValueError(f"compiler_options {clash} would override BITWISE_OPTIONS "
                         f"{ {k: BITWISE_OPTIONS[k] for k in clash} }")
    return BitwiseJitted(fn, {**extra, **BITWISE_OPTIONS}, jit_kwargs)
