"""How far a sharded step's `y` may be from the one-device step's: the derived bound.

With the selection bitwise equal (the indexer runs the same shapes at every degree), the runs
differ where the heads' work is done in GEMMs and reductions of other shapes (per rank `Hl`
heads instead of `H`) and in the output projection's sum over `n = H * Dv` terms (tp partial
sums, then the psum). Weights and the GEMM inputs are bf16, accumulation fp32:

1. The attended latents `o_lat` (fp32) come out of reductions ordered differently; their
   bf16 casts `a` may land on neighbouring values. We assume upstream fp32 differences stay
   below one bf16 ulp, so `|da_c| <= 2 ulp <= 2 * 2^-7 |a_c|` (one ulp is at most `2^-7` of
   the value: 8 significant bits).
2. `o_f = a U_v^T`, a sum of `C` exact products (bf16 x bf16 fits fp32): `|do_f_j| <=
   sum_c |da_c| |U_v[j,c]| + 2 gamma_C T_j`, `T_j = sum_c |a_c| |U_v[j,c]|`;
   `gamma_k = k u / (1 - k u)`, `u = 2^-24`: any order of a k-term fp32 sum is within
   `gamma_{k-1}` of the exact value times the sum of the terms' magnitudes (Higham,
   Accuracy and Stability, 3.1).
3. `o = bf16(o_f)`: `|do_j| <= |do_f_j| + 1 ulp <= |do_f_j| + 2^-7 |o_j|`.
4. `y_e = sum_j o_j W[e,j]`, again exact products, summed in another order (partials + psum):
   `|dy_e| <= sum_j |do_j| |W[e,j]| + 2 gamma_{n-1} S_e`, `S_e = sum_j |o_j| |W[e,j]|`.

Together, with `V_e = sum_j T_j |W[e,j]|`:
`|dy_e| <= (2^-6 + 2 gamma_C) V_e + (2^-7 + 2 gamma_{n-1}) S_e`, each ulp term times
`1 + 2^-7` (a neighbour's ulp). `S` and `V` are computed from a recomputation of the
one-device step's `a` and `o` (the same values up to an ulp: the factor `1 + 2^-7` again).
This is a worst case (every activation a neighbour away, all errors aligned); with random
weights `V` is tens of times `|y|`, so it is a sanity bound, not a sharp one. The sharp check
is `psum_tolerance`: the sharded `y` against the ranks' partial outputs computed one by one
on one device (the same per-rank programs), where only the psum's order of the `tp` partials
is free. Where nothing but the o_proj sum differs (no flips), the error is `2 gamma_{n-1} S_e`
alone; XLA:CPU's attend reduces a different head count in another order, so flips do occur.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dsa_jax import fp8
from dsa_jax.attend import attend
from dsa_jax.config import DsaConfig
from dsa_jax.projection import project
from dsa_jax.state import DsaState
from dsa_jax.weights import DsaWeights

U32 = 2.0 ** -24  # fp32 unit roundoff
BF16_ULP = 2.0 ** -7  # one bf16 ulp, relative, at most


def gamma(k: int) -> float:
    return k * U32 / (1 - k * U32)


def output_terms(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                 sel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(S, V)`, each `[B, R, D]`, of the one-device step that appended rows `x [B, R, D]`
    (`weights`: tp_degree 1; `state`: the state after that step; `sel [B, R, W]`: its
    selection); see the module docstring."""
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    cfg = cfg.replace(implementation="xla")
    weights = fp8.compute_weights(cfg, weights)  # fp8 blocks as the bf16 weights they give
    q_abs = project(cfg, weights, x).q_abs  # [B, R, H, C]
    o_lat = attend(cfg, state, q_abs, sel)  # [B, R, H, C]
    a = o_lat.astype(weights.u_v.dtype).astype(f32)
    u_v = weights.u_v.astype(f32)  # [H, Dv, C]
    o = jnp.einsum("brhc,hvc->brhv", a, u_v, precision=hi)
    o = jnp.abs(o.astype(weights.u_v.dtype).astype(f32))  # [B, R, H, Dv]
    t = jnp.einsum("brhc,hvc->brhv", jnp.abs(a), jnp.abs(u_v), precision=hi)  # [B, R, H, Dv]
    w = jnp.abs(weights.o_proj.astype(f32))  # [D, H*Dv]

    def through_o_proj(v):
        return jnp.einsum("brj,ej->bre", v.reshape(*v.shape[:2], -1), w, precision=hi)

    return through_o_proj(o), through_o_proj(t)


def y_tolerance(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array,
                sel: jax.Array) -> jax.Array:
    """The bound of the module docstring, elementwise `[B, R, D]`, for `y` of a sharded step
    against the one-device step (same arguments as `output_terms`)."""
    n, c = cfg.num_heads * cfg.v_head_dim, cfg.kv_lora_rank
    s, v = output_terms(cfg, weights, state, x, sel)
    ulp = BF16_ULP * (1 + BF16_ULP)
    tol = (2 * ulp + 2 * gamma(c)) * v + (ulp + 2 * gamma(n - 1)) * s
    # (1 + 2^-7): S and V from recomputed activations; (1 + gamma): their own fp32 sums.
    return tol * (1 + BF16_ULP) * (1 + gamma(max(n, c)))


def psum_tolerance(partials: jax.Array) -> jax.Array:
    """`partials [tp, ...]`: each rank's fp32 output. Their fp32 sum in any order is within
    `gamma_{tp-1} * sum_r |y_r|` of the exact sum (computed here in float64 by the caller)."""
    tp = partials.shape[0]
    return gamma(tp - 1) * (1 + gamma(tp)) * jnp.sum(jnp.abs(partials.astype(jnp.float32)),
                                                     axis=0)
