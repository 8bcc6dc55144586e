"""The weight-heavy projections: one GEMM over the input, two over `q_resid` (the heads' query,
the indexer's query), the output.

Matmuls take the weights' dtype and accumulate in fp32; norms and everything after the GEMMs
are fp32. Row shapes are whatever the caller passes. With XLA's GEMMs decode and verify pass
the same padded `[B, max_verify]` rows so that each row's reductions are identical in both
(docs/spec.md); under `row_gemms(cfg)` the rows of a decode or verify (at most
max_verify per sequence) go through the row-invariant kernels (`pallas/matmul.py`), whose
rows have the same bits at any row count, and a decode passes its one row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dsa_jax.config import DsaConfig
from dsa_jax.fp8 import dense, is_fp8
from dsa_jax.implementation import (
    matmul_op,
    per_head_op,
    resolve,
    rms_norm_op,
    row_gemms,
    scaled_q_abs_op,
    takes_scaled_q,
)
from dsa_jax.implementation import q_abs_bound as kernel_q_abs_bound
from dsa_jax.stacked import LayerOf, operand
from dsa_jax.weights import DsaWeights

matmul_xla = matmul_op.reference  # the definitions (XLA's ops)
per_head_xla = per_head_op.reference
rms_norm = rms_norm_op.reference  # public: the block's RMSNorm

__all__ = ["Projections", "absorb_q", "kernel_rows", "matmul", "norm", "output_projection",
           "per_head", "per_sequence", "project", "project_kv", "prompt_operand", "prompt_rows",
           "prompt_u_v_kernel", "q_abs_bound", "q_resid_dtype", "rms_norm", "scaled_q_abs",
           "x_columns"]


class Projections(NamedTuple):
    q_abs: jax.Array  # [..., Hl, C] f32: absorbed query a_h = U_k[h]^T q_h
    kv_raw: jax.Array  # [..., C] f32: W_kva x (the latent write applies its RMSNorm)
    qi: jax.Array | None  # [..., Hi, Di] f32: indexer queries (None on a shared layer)
    k_raw: jax.Array | None  # [..., Di] f32: W_k x (the indexer write applies k_norm)
    g: jax.Array | None  # [..., Di] f32: gate W_gate x
    w: jax.Array | None  # [..., Hi] f32: head weights, scales folded
    xw: jax.Array | None = None  # [..., Nx] f32: the x projection's output, which the cache
    # writes read in place at `x_columns(cfg)` (kv_raw, k_raw and g are slices of it)
    q_scaled: tuple[jax.Array, jax.Array] | None = None  # a prompt's rows where the attend
    # reads it (`sparse_attend.takes_scaled_q`; else None): `scaled_q_abs` (`attend`)
    q_resid: jax.Array | None = None  # [..., R_q]: the q GEMMs' normalized operand, where
    # `project(defer_q=True)` left q_abs (None) to the caller (`absorb_q`)


def x_columns(cfg: DsaConfig) -> dict[str, tuple[int, int]]:
    """`(start, width)` of each projection in the x projection's output columns
    (`DsaWeights.x_proj`'s rows): q_a, kv_a, then on a layer with an indexer k, gate, w."""
    R, C, Hi, Di = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    return {"q_a": (0, R), "kv": (R, C), "k": (R + C, Di), "g": (R + C + Di, Di),
            "w": (R + C + 2 * Di, Hi)}


def _cols(xw: jax.Array, where: tuple[int, int]) -> jax.Array:
    return xw[..., where[0]:where[0] + where[1]]


def per_sequence(cfg: DsaConfig | None, gemm, v: jax.Array, lead: int, *args, **kwargs
                 ) -> jax.Array:
    """`gemm(v, *args, **kwargs)` for rows `v [B, ..., K]` (`lead` trailing axes per row: 1
    for `matmul`, 2 for `per_head`), one sequence `v[b]` at a time (`lax.map`) under
    `cfg.batch_invariant`: XLA's GEMM then has one shape, a sequence's rows, whatever the
    batch (XLA picks a GEMM's blocking, and with it a row's rounding, from the whole row
    count). Otherwise, or for a single row, the one GEMM over every row."""
    if cfg is None or not cfg.batch_invariant or v.ndim <= lead:
        return gemm(v, *args, **kwargs)
    return lax.map(lambda vb: gemm(vb, *args, **kwargs), v)


def matmul(v: jax.Array, w: jax.Array, cfg: DsaConfig | None = None, out_dtype=jnp.float32
           ) -> jax.Array:
    """`v [..., in] @ w.T` for an `[out, in]` weight -> `[..., out]` (f32 unless out_dtype):
    operands in the weight dtype, fp32 accumulation (HIGHEST: fp32 weights mean fp32
    arithmetic, not a GPU's tf32). Every GEMM of the block is this one op (public so that a
    benchmark can time other arrangements of the same GEMMs). cfg: the row-invariant kernel
    where `kernel_rows` says so; XLA's dot without it. w: an array or a `LayerOf`. out_dtype:
    XLA's result dtype (a prompt's q in bf16: `project`); the row-invariant kernel's rows are
    f32 only."""
    if cfg is not None and kernel_rows(cfg, v.shape[:-1]):
        if jnp.dtype(out_dtype) != jnp.float32:
            raise ValueError(f"matmul: out_dtype={jnp.dtype(out_dtype).name} for a decode's "
                             f"or verify's rows; the row-invariant kernel writes float32")
        if isinstance(w, LayerOf):
            return matmul_op(cfg, v, w.stack, w.index)
        return matmul_op(cfg, v, w)
    return per_sequence(cfg, matmul_xla, v, 1, w.layer if isinstance(w, LayerOf) else w,
                        out_dtype=out_dtype)


def per_head(v: jax.Array, w: jax.Array, w_contract: int, cfg: DsaConfig | None = None
             ) -> jax.Array:
    """`v [..., H, K]` times each head's `w [H, ., .]` (contracting `w`'s axis `w_contract`)
    -> `[..., H, N]`, fp32 accumulation: the per-head products with `U_k` and `U_v`. cfg: as
    `matmul`'s.

    XLA's is a dot_general with the head axis as its batch axis: XLA:CPU has no bf16 dot for
    the operand order that `einsum` lowers this to.
    """
    if cfg is not None and kernel_rows(cfg, v.shape[:-2]):
        if isinstance(w, LayerOf):
            return per_head_op(cfg, v, w.stack, w_contract, w.index)
        return per_head_op(cfg, v, w, w_contract)
    return per_sequence(cfg, per_head_xla, v, 2, w.layer if isinstance(w, LayerOf) else w,
                        w_contract)


def norm(cfg: DsaConfig, v: jax.Array, w, eps: float, **kwargs) -> jax.Array:
    """`rms_norm_op` with `w` an array or a `LayerOf` (the kernel reads its stack in place;
    the "xla" implementation the scan's slice, as before). kwargs: `rms_norm_xla`'s."""
    w, at = operand(cfg, w)
    return rms_norm_op(cfg, v, w, eps, layer=at, **kwargs)


def q_abs_bound(q: jax.Array, u_k) -> jax.Array:
    """`q [..., Hl, Dn]` f32 (the U_k GEMM's input) -> `[..., Hl]` f32, at least every |a_h|
    that `per_head(q, u_k, 1)` computes (Cauchy-Schwarz at the GEMM's operands, with a margin
    for the f32 roundings: `implementation.q_abs_bound`). Known before the GEMM runs
    (`scaled_q_abs`), where an amax of q_abs would read q_abs back. u_k: an array or a
    `LayerOf`."""
    return kernel_q_abs_bound(q, dense(u_k.layer if isinstance(u_k, LayerOf) else u_k))


def scaled_q_abs(q: jax.Array, u_k, cfg: DsaConfig | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """`q [..., Hl, Dn]` f32 or bf16 (a prompt's q_b GEMM writes bf16 with bf16 weights) ->
    (q_abs * 2^k as f16 `[..., Hl, C]`, 2^-k `[..., Hl]` f32), k
    per (row, head) bringing `q_abs_bound` into [2^13, 2^14) (no |q_abs| 2^k reaches 2^14):
    the attend's input for a prompt's rows (`MgpuTuning.bound_scales`). With cfg, the kernel
    `cfg.implementation` names (`pallas/scaled_q_abs.py`: q read once, only the f16 result
    and the scale written); without, the definition. u_k: an array or a `LayerOf`."""
    if cfg is None:
        return scaled_q_abs_op.reference(q, dense(u_k.layer if isinstance(u_k, LayerOf)
                                                  else u_k))
    return scaled_q_abs_op(cfg, q, *prompt_operand(cfg, u_k))


def prompt_operand(cfg: DsaConfig, w) -> tuple[jax.Array, jax.Array | None]:
    """`operand(cfg, w)` for a per-head kernel over a prompt's rows: an fp8 weight (this
    layer's only, of a `LayerOf`) dequantized to bf16 once, before the kernel. The kernel
    would dequantize each weight tile once per tile of rows, a prompt's thousands of rows
    over and over; the bf16 tiles give the same bits (the kernel's dequantization is this
    one)."""
    one = w.layer if isinstance(w, LayerOf) else w
    return (dense(one), None) if is_fp8(one) else operand(cfg, w)


def prompt_rows(cfg: DsaConfig, lead: tuple[int, ...]) -> bool:
    """Rows `lead` (`[B, R]`) of a prompt: more per sequence than a verify's max_verify. Only
    these carry `Projections.q_scaled`: a decode's and a verify's rows keep one arithmetic
    (decode_k == serial), whatever their GEMMs."""
    return len(lead) >= 1 and lead[-1] > cfg.max_verify


def kernel_rows(cfg: DsaConfig, lead: tuple[int, ...]) -> bool:
    """Rows `lead` (`[B, R]`) of a decode or verify (R <= max_verify) under `row_gemms`: the
    GEMMs whose rows a decode must reproduce bit for bit. A prompt's rows keep XLA's GEMMs."""
    return row_gemms(cfg) and len(lead) >= 1 and lead[-1] <= cfg.max_verify


def absorb_q(cfg: DsaConfig, weights: DsaWeights, q: jax.Array) -> jax.Array:
    """The q_b GEMM's result `q [..., Hl*Dn]` f32 -> the absorbed query `[..., Hl, C]`."""
    q = q.reshape(*q.shape[:-1], cfg.local_heads, cfg.qk_nope_head_dim)  # [..., Hl, Dn]
    return per_head(q, weights.u_k, 1, cfg)


def q_resid_dtype(weights: DsaWeights):
    """The q GEMMs' normalized operand's dtype: their weights' where the two agree (the
    rounding they would apply), else fp32."""
    dt = {w.dtype for w in (weights.q_proj, weights.qi_proj) if w is not None}
    return dt.pop() if len(dt) == 1 else jnp.float32


def project(cfg: DsaConfig, weights: DsaWeights, x: jax.Array, *, defer_q: bool = False,
            xw: jax.Array | None = None) -> Projections:
    """`x [..., D]` -> every per-token quantity the block needs. defer_q: leave the q_b GEMM
    and the absorption to the caller (q_abs None; `q_resid` their operand, `absorb_q` the
    rest), who runs the GEMM in a launch of its own choice (`layer.step`: beside the
    top-k). Not for a prompt's rows, whose q takes another path (`scaled_q_abs`). xw: the x
    projection's GEMM `matmul(x, weights.x_proj, cfg)` `[..., Nx]`, computed by the caller
    (`layer.step`: in the row metadata's launch); None: computed here."""
    Hl, Dn, Hi, Di = cfg.local_heads, cfg.qk_nope_head_dim, cfg.index_n_heads, cfg.index_head_dim
    at = x_columns(cfg)
    if xw is None:
        xw = matmul(x, weights.x_proj, cfg)  # [..., Nx]
    elif xw.shape != (*x.shape[:-1], weights.x_proj.shape[-2]):
        raise ValueError(f"project: xw has shape {xw.shape}; x {x.shape} needs "
                         f"{(*x.shape[:-1], weights.x_proj.shape[-2])}")
    # The norm reads its columns of xw in place and writes the q GEMMs' operand dtype (the
    # rounding they would apply): no slice, no conversion pass. fp32 where the two differ.
    q_resid = norm(cfg, xw, weights.q_a_norm, cfg.rms_norm_eps, cols=at["q_a"],
                   dtype=q_resid_dtype(weights))  # [..., R_q]
    kv_raw = _cols(xw, at["kv"])  # [..., C]
    impl = resolve(cfg.implementation)
    scaled = (prompt_rows(cfg, xw.shape[:-1]) and impl != "xla"
              and takes_scaled_q(jnp.dtype(cfg.cache_dtype), Hl, cfg.kv_lora_rank,
                                 impl != "pallas"))
    # With bf16 q_b and U_k weights q is only ever read rounded to bf16 (both U_k GEMMs round
    # it): a prompt's q_b GEMM (XLA's) then writes bf16 itself, half the bytes written and
    # read back, the same values (its fp32 sums rounded once, as the f32 result rounded).
    q_bf16 = scaled and weights.q_proj.dtype == weights.u_k.dtype == jnp.bfloat16
    if defer_q:
        if scaled:
            raise ValueError("project: defer_q for a prompt's rows (their q is scaled here)")
        q_abs, scaled = None, None
    else:
        q = matmul(q_resid, weights.q_proj, cfg,
                   out_dtype=jnp.bfloat16 if q_bf16 else jnp.float32)
        q = q.reshape(*xw.shape[:-1], Hl, Dn)  # [..., Hl, Dn]
        q_abs = per_head(q, weights.u_k, 1, cfg)  # [..., Hl, C]
        scaled = scaled_q_abs(q, weights.u_k, cfg) if scaled else None
    kept = q_resid if defer_q else None
    if not weights.has_indexer:
        return Projections(q_abs, kv_raw, None, None, None, None, xw, scaled, kept)
    # The indexer's query: its own GEMM, of one shape at every TP degree (weights.py). The
    # barrier gives it an operand of its own: XLA:GPU's dot merger would otherwise merge it
    # with the q_b GEMM above (shared operand, a small weight) into one GEMM of a
    # degree-dependent shape over a concatenation of the two weights copied every call.
    qi = matmul(lax.optimization_barrier(q_resid), weights.qi_proj, cfg)  # [..., Hi*Di]
    qi = qi.reshape(*xw.shape[:-1], Hi, Di)
    return Projections(q_abs, kv_raw, qi, _cols(xw, at["k"]), _cols(xw, at["g"]),
                       _cols(xw, at["w"]), xw, scaled, kept)


def project_kv(cfg: DsaConfig, weights: DsaWeights, x: jax.Array) -> Projections:
    """Only what a context row stores: the raw latent and the indexer's raw k and gate."""
    R, C, Di = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_head_dim
    rows = C + (2 * Di if weights.has_indexer else 0)
    w = weights.x_proj.layer if isinstance(weights.x_proj, LayerOf) else weights.x_proj
    xw = per_sequence(cfg, matmul_xla, x, 1, dense(w)[R:R + rows])  # [..., C (+ 2 Di)]
    if not weights.has_indexer:
        return Projections(None, xw[..., :C], None, None, None, None)
    return Projections(None, xw[..., :C], None, xw[..., C:C + Di], xw[..., C + Di:C + 2 * Di],
                       None)


def prompt_u_v_kernel(cfg: DsaConfig, lead: tuple[int, ...], u_v, o_proj) -> bool:
    """Whether a prompt's U_v product (rows `lead`) runs the per-head Pallas kernel writing
    bf16 (`output_projection`): prompt rows, the kernels on (`cfg.implementation`), `cfg.gemm`
    not "xla", and bf16 U_v and o_proj weights (o_proj rounds its operand to bf16 anyway, so
    the kernel's rounding is that one), faster than XLA's GEMM there on the H200. A decode's
    and a verify's rows keep `per_head`."""
    return (prompt_rows(cfg, lead) and resolve(cfg.implementation) != "xla"
            and cfg.gemm != "xla" and u_v.dtype == o_proj.dtype == jnp.bfloat16)


def output_projection(weights: DsaWeights, o_latent: jax.Array, cfg: DsaConfig | None = None
                      ) -> jax.Array:
    """Attended latents `[..., Hl, C]` -> `y [..., D]` (this rank's partial sum under TP).
    cfg: as `matmul`'s (the step passes it)."""
    lead = o_latent.shape[:-2]
    if cfg is not None and prompt_u_v_kernel(cfg, lead, weights.u_v, weights.o_proj):
        w, at = prompt_operand(cfg, weights.u_v)
        o = per_head_op(cfg, o_latent, w, 2, at, out_dtype=jnp.bfloat16)  # [..., Hl, Dv]
    else:
        o = per_head(o_latent, weights.u_v, 2, cfg)  # [..., Hl, Dv]
    return matmul(o.reshape(*o.shape[:-2], -1), weights.o_proj, cfg)
