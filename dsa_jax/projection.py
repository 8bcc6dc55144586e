"""The weight-heavy projections: one GEMM over the input, two over `q_resid` (the heads' query,
the indexer's query), the output.

Matmuls take the weights' dtype and accumulate in fp32; norms and everything after the GEMMs
are fp32. Row shapes are whatever the caller passes: decode and verify pass the same padded
`[B, max_verify]` rows so that each row's reductions are identical in both (docs/spec.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import rms_norm_op
from dsa_jax.pallas.rms_norm import rms_norm_xla as rms_norm  # the definition (public)
from dsa_jax.weights import DsaWeights

__all__ = ["Projections", "matmul", "output_projection", "per_head", "project", "project_kv",
           "rms_norm", "x_columns"]


class Projections(NamedTuple):
    q_abs: jax.Array  # [..., Hl, C] f32: absorbed query a_h = U_k[h]^T q_h
    kv_raw: jax.Array  # [..., C] f32: W_kva x (the latent write applies its RMSNorm)
    qi: jax.Array | None  # [..., Hi, Di] f32: indexer queries (None on a shared layer)
    k_raw: jax.Array | None  # [..., Di] f32: W_k x (the indexer write applies k_norm)
    g: jax.Array | None  # [..., Di] f32: gate W_gate x
    w: jax.Array | None  # [..., Hi] f32: head weights, scales folded
    xw: jax.Array | None = None  # [..., Nx] f32: the x projection's output, which the cache
    # writes read in place at `x_columns(cfg)` (kv_raw, k_raw and g are slices of it)


def x_columns(cfg: DsaConfig) -> dict[str, tuple[int, int]]:
    """`(start, width)` of each projection in the x projection's output columns
    (`DsaWeights.x_proj`'s rows): q_a, kv_a, then on a layer with an indexer k, gate, w."""
    R, C, Hi, Di = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    return {"q_a": (0, R), "kv": (R, C), "k": (R + C, Di), "g": (R + C + Di, Di),
            "w": (R + C + 2 * Di, Hi)}


def _cols(xw: jax.Array, where: tuple[int, int]) -> jax.Array:
    return xw[..., where[0]:where[0] + where[1]]


# fp32 weights mean fp32 arithmetic: without HIGHEST a GPU runs fp32 dots as tf32 (~1e-3).
# For bf16 weights the precision flag changes nothing.
HIGHEST = lax.Precision.HIGHEST


def matmul(v: jax.Array, w: jax.Array) -> jax.Array:
    """`v [..., in] @ w.T` for an `[out, in]` weight -> `[..., out]` f32: operands in the
    weight dtype, fp32 accumulation. Every GEMM of the block is this one op (public so that a
    benchmark can time other arrangements of the same GEMMs)."""
    return jnp.einsum("...i,oi->...o", v.astype(w.dtype), w, precision=HIGHEST,
                      preferred_element_type=jnp.float32)


def per_head(v: jax.Array, w: jax.Array, w_contract: int) -> jax.Array:
    """`v [..., H, K]` times each head's `w [H, ., .]` (contracting `w`'s axis `w_contract`)
    -> `[..., H, N]`, fp32 accumulation: the per-head products with `U_k` and `U_v`.

    Written as a dot_general with the head axis as its batch axis: XLA:CPU has no bf16 dot
    for the operand order that `einsum` lowers this to.
    """
    lead = v.shape[:-2]
    rows = v.reshape(-1, *v.shape[-2:]).astype(w.dtype)  # [N, H, K]
    out = lax.dot_general(rows, w, (((2,), (w_contract,)), ((1,), (0,))), precision=HIGHEST,
                          preferred_element_type=jnp.float32)  # [H, N, Nout]
    return jnp.swapaxes(out, 0, 1).reshape(*lead, *out.shape[::2])


def project(cfg: DsaConfig, weights: DsaWeights, x: jax.Array) -> Projections:
    """`x [..., D]` -> every per-token quantity the block needs."""
    Hl, Dn, Hi, Di = cfg.local_heads, cfg.qk_nope_head_dim, cfg.index_n_heads, cfg.index_head_dim
    at = x_columns(cfg)
    xw = matmul(x, weights.x_proj)  # [..., Nx]
    # The norm reads its columns of xw in place and writes the q GEMMs' operand dtype (the
    # rounding they would apply): no slice, no conversion pass. fp32 where the two differ.
    dt = {w.dtype for w in (weights.q_proj, weights.qi_proj) if w is not None}
    q_resid = rms_norm_op(cfg, xw, weights.q_a_norm, cfg.rms_norm_eps, cols=at["q_a"],
                          dtype=dt.pop() if len(dt) == 1 else jnp.float32)  # [..., R_q]
    kv_raw = _cols(xw, at["kv"])  # [..., C]
    q = matmul(q_resid, weights.q_proj).reshape(*xw.shape[:-1], Hl, Dn)  # [..., Hl, Dn]
    q_abs = per_head(q, weights.u_k, 1)  # [..., Hl, C]
    if not weights.has_indexer:
        return Projections(q_abs, kv_raw, None, None, None, None, xw)
    # The indexer's query: its own GEMM, of one shape at every TP degree (weights.py). The
    # barrier gives it an operand of its own: XLA:GPU's dot merger would otherwise merge it
    # with the q_b GEMM above (shared operand, a small weight) into one GEMM of a
    # degree-dependent shape over a concatenation of the two weights copied every call.
    qi = matmul(lax.optimization_barrier(q_resid), weights.qi_proj)  # [..., Hi*Di]
    qi = qi.reshape(*xw.shape[:-1], Hi, Di)
    return Projections(q_abs, kv_raw, qi, _cols(xw, at["k"]), _cols(xw, at["g"]),
                       _cols(xw, at["w"]), xw)


def project_kv(cfg: DsaConfig, weights: DsaWeights, x: jax.Array) -> Projections:
    """Only what a context row stores: the raw latent and the indexer's raw k and gate."""
    R, C, Di = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_head_dim
    rows = C + (2 * Di if weights.has_indexer else 0)
    xw = matmul(x, weights.x_proj[R:R + rows])  # [..., C (+ 2 Di)]
    if not weights.has_indexer:
        return Projections(None, xw[..., :C], None, None, None, None)
    return Projections(None, xw[..., :C], None, xw[..., C:C + Di], xw[..., C + Di:C + 2 * Di],
                       None)


def output_projection(weights: DsaWeights, o_latent: jax.Array) -> jax.Array:
    """Attended latents `[..., Hl, C]` -> `y [..., D]` (this rank's partial sum under TP)."""
    o = per_head(o_latent, weights.u_v, 2)  # [..., Hl, Dv]
    return matmul(o.reshape(*o.shape[:-2], -1), weights.o_proj)
