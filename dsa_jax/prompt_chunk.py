"""How many prompt rows per sequence one step can take: the Pallas Triton kernels address their
arrays with 32-bit offsets (`pallas.common.check_triton_addressable`, raised while tracing), so
a chunk of `B` sequences x `S` rows must keep every kernel array of the step below 2^31
elements (at GLM-5.3-Flash shapes: the per-head products' `[B*S, 64, 512]`, i.e. fewer than
65536 rows). The kernels' own checks decide: the step is traced on shapes alone
(`jax.eval_shape`, no array is made) at a chunk, and a chunk that does not fit is cut to the
largest that does. A prompt cut into chunks is a chunked prefill: the same selections as
one prefill, the outputs within fp32 rounding (docs/decisions.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsa_jax.config import DsaConfig
from dsa_jax.errors import KernelLimitError
from dsa_jax.state import DsaState, expected_state_fields
from dsa_jax.step import step
from dsa_jax.weights import DsaWeights, expected_weight_fields

__all__ = ["fits", "largest_chunk"]


def _shapes(fields: dict) -> dict:
    return {k: None if v is None else jax.ShapeDtypeStruct(v[0], v[1]) for k, v in fields.items()}


@functools.lru_cache(maxsize=256)
def fits(cfg: DsaConfig, num_seqs: int, num_blocks: int, rows: int) -> bool:
    """Whether a full layer's step of `num_seqs` sequences x `rows` prompt rows traces without
    a `KernelLimitError` (a full layer runs every kernel a shared one does, and more)."""
    weights = DsaWeights(**_shapes(expected_weight_fields(cfg, True)))
    state = DsaState(**_shapes(expected_state_fields(cfg, num_seqs, num_blocks, True)))
    x = jax.ShapeDtypeStruct((num_seqs, rows, cfg.hidden_size), jnp.float32)  # [B, S, D]
    n_new = jax.ShapeDtypeStruct((num_seqs,), jnp.int32)  # [B]
    try:
        jax.eval_shape(lambda w, s, x, n: step(cfg, w, s, x, n), weights, state, x, n_new)
    except KernelLimitError:
        return False
    return True


def largest_chunk(cfg: DsaConfig, num_seqs: int, num_blocks: int, want: int) -> int:
    """`want` if a step of `num_seqs` x `want` prompt rows fits the kernels, else the largest
    chunk below it that does (a bisection: about log2(want) shape-only traces);
    `KernelLimitError` if not even one row per sequence fits."""
    if fits(cfg, num_seqs, num_blocks, want):
        return want
    if not fits(cfg, num_seqs, num_blocks, 1):
        raise KernelLimitError(f"a prompt step of {num_seqs} sequences does not fit the "
                               f"kernels' addressing even at one row each: serve fewer "
                               f"sequences at once, or use implementation='xla'")
    lo, hi = 1, want  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(cfg, num_seqs, num_blocks, mid) else (lo, mid)
    return lo
