"""The definition: a dense fp32 jnp rendering of SPEC.md over one whole sequence.

Every row `t` of `x [S, D]` is the token at position `t` (causal over the rows before it).
Weights are the unfolded HF tensors (see `weights.py`), so nothing here depends on our folds,
our state layout or our kernels. Dense on purpose: attention goes through an `[S, S]` mask
built from the selected sets, as Hugging Face does, never through a gather. Imports config
only (and chex, for the input contract).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax import lax

from dsa_jax.config import DsaConfig
from dsa_jax.state import DsaState, index_storage, latent_storage
from dsa_jax.weights import dequantize_fp8

HIGHEST = lax.Precision.HIGHEST
Roundtrip = Callable[[jax.Array], jax.Array]


class ReferenceOutput(NamedTuple):
    y: jax.Array  # [S, D] f32: block output
    sel: jax.Array  # [S, W] int32: selected token indices in our slot layout, -1 padded
    pool_scores: jax.Array | None  # [S, P] f32: index scores, -inf for non-candidates


def rms_norm(v: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Plain RMSNorm, `w * v / sqrt(mean(v^2) + eps)`; never `(1 + w)`."""
    return w * v * lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)


def layer_norm(v: jax.Array, g: jax.Array, b: jax.Array, eps: float = 1e-6) -> jax.Array:
    mean = jnp.mean(v, axis=-1, keepdims=True)
    var = jnp.mean((v - mean) ** 2, axis=-1, keepdims=True)
    return (v - mean) * lax.rsqrt(var + eps) * g + b


def _linear(v: jax.Array, w: jax.Array) -> jax.Array:
    """`v @ w.T` for an HF `[out, in]` weight, in full fp32."""
    return jnp.einsum("...i,oi->...o", v, w, precision=HIGHEST)


def pool_keys(cfg: DsaConfig, k: jax.Array, gate: jax.Array, ape: jax.Array) -> jax.Array:
    """Complete pools of `k, gate [S, Di]` -> `K [S // KP, Di]` (member softmax per channel)."""
    kp = cfg.index_kpool
    n = k.shape[0] // kp
    logits = gate[: n * kp].reshape(n, kp, -1) + ape[None]
    return jnp.sum(jax.nn.softmax(logits, axis=1) * k[: n * kp].reshape(n, kp, -1), axis=1)


def index_scores(cfg: DsaConfig, qi: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
    """`score[t, p] = sum_h w[t, h] * relu((qi[t, h] . K_p) * Di^-0.5)`; -inf unless candidate."""
    s = qi.shape[0]
    dots = jnp.einsum("thd,pd->thp", qi, keys, precision=HIGHEST) * cfg.index_head_dim ** -0.5
    scores = jnp.einsum("th,thp->tp", w, jax.nn.relu(dots), precision=HIGHEST)
    scores = jnp.where(scores == 0, 0.0, scores)  # -0.0 and 0.0 are one score
    last_token = (jnp.arange(keys.shape[0]) + 1) * cfg.index_kpool - 1
    candidate = last_token[None, :] <= jnp.arange(s)[:, None]
    return jnp.where(candidate, scores, -jnp.inf)


def select_tokens(cfg: DsaConfig, scores: jax.Array) -> jax.Array:
    """Scores `[S, P]` -> selected tokens `[S, W]` in our slot layout (SPEC.md, indexer path)."""
    s, num_pools = scores.shape
    kp, width = cfg.index_kpool, cfg.sel_width
    t = jnp.arange(s)
    # Total order: score descending, then pool index ascending (a stable sort of -score).
    order = jnp.argsort(-scores, axis=-1, stable=True).astype(jnp.int32)
    n_sel = jnp.minimum(cfg.select_k, (t + 1) // kp)
    slot = jnp.arange(width)
    rank = jnp.minimum(slot // kp, max(num_pools - 1, 0))
    if num_pools:
        from_pool = jnp.take_along_axis(order, jnp.broadcast_to(rank, (s, width)), axis=1) * kp \
            + slot % kp
    else:
        from_pool = jnp.full((s, width), -1, jnp.int32)
    tail_j = slot[None, :] - n_sel[:, None] * kp
    tail_count = (t + 1) % kp if cfg.always_select_tail else jnp.zeros_like(t)
    from_tail = ((t + 1) // kp * kp)[:, None] + tail_j
    sel = jnp.where(slot[None, :] < n_sel[:, None] * kp, from_pool,
                    jnp.where((tail_j >= 0) & (tail_j < tail_count[:, None]), from_tail, -1))
    return sel.astype(jnp.int32)


def selection_mask(sel: jax.Array, s: int) -> jax.Array:
    """`[S, W]` indices -> `[S, S]` boolean membership (the dense form HF uses)."""
    hits = (sel[:, :, None] == jnp.arange(s)[None, None, :]) & (sel[:, :, None] >= 0)
    return jnp.any(hits, axis=1)


def forward(cfg: DsaConfig, hf: Mapping[str, jax.Array], x: jax.Array, *,
            shared_sel: jax.Array | None = None,
            latent_roundtrip: Roundtrip | None = None,
            index_roundtrip: Roundtrip | None = None,
            as_stored: DsaState | float | jax.Array | None = None) -> ReferenceOutput:
    """The DSA block over one sequence `x [S, D]`, all heads, in fp32.

    `as_stored`: a `DsaState` of `cfg` (or its `kv_scale`): the reference then computes from
    the values such a state stores (the latent in `cfg.cache_dtype` with that scale, the
    indexer's k, gate and pool keys in `cfg.index_cache_dtype`), as the paged paths do; they
    agree with it to fp32 rounding (~1e-6 relative). Without it the reference is the
    unrounded block, and a paged path's difference from it is the cache's storage error
    (with an fp8 latent, a few percent; more where a rounded score flips a selection).

    `shared_sel [S, W]` stands in for the indexer of a "shared" layer. `latent_roundtrip` and
    `index_roundtrip` model a cache's storage (e.g. fp8 quantize-dequantize of the latents, bf16
    of the indexer's k, gate and pool keys: `state.index_storage(cfg)`), so a paged path can be
    compared on the same stored values. Under jit write a bf16 round trip with
    `lax.reduce_precision` (as `index_storage` does): XLA may drop a cast pair.
    """
    if as_stored is not None:
        if latent_roundtrip is not None or index_roundtrip is not None:
            raise ValueError("as_stored sets both round trips: pass it alone, or "
                             "latent_roundtrip/index_roundtrip without it")
        scale = as_stored.kv_scale if isinstance(as_stored, DsaState) else as_stored
        latent_roundtrip, index_roundtrip = latent_storage(cfg, scale), index_storage(cfg)
    chex.assert_shape(x, (None, cfg.hidden_size))
    if shared_sel is not None:
        chex.assert_shape(shared_sel, (x.shape[0], cfg.sel_width))
    # fp8 tensors (a fine-grained fp8 checkpoint) count at their values: times their scales
    w = {name: jnp.asarray(v, jnp.float32)
         for name, v in dequantize_fp8(hf, block=cfg.weight_block).items()}
    x = jnp.asarray(x, jnp.float32)
    s = x.shape[0]
    H, C, Dn, Dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    eps = cfg.rms_norm_eps

    q_resid = rms_norm(_linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], eps)
    q = _linear(q_resid, w["q_b_proj.weight"]).reshape(s, H, Dn)
    c = rms_norm(_linear(x, w["kv_a_proj_with_mqa.weight"])[:, :C], w["kv_a_layernorm.weight"],
                 eps)
    if latent_roundtrip is not None:
        c = latent_roundtrip(c)

    scores = None
    if shared_sel is None:
        qi = _linear(q_resid, w["indexer.wq_b.weight"]).reshape(s, cfg.index_n_heads, -1)
        k = layer_norm(_linear(x, w["indexer.wk.weight"]), w["indexer.k_norm.weight"],
                       w["indexer.k_norm.bias"])
        gate = _linear(x, w["indexer.index_kpool_compress_gate"])
        head_w = _linear(x, w["indexer.weights_proj.weight"]) * cfg.index_n_heads ** -0.5
        if index_roundtrip is not None:
            k, gate = index_roundtrip(k), index_roundtrip(gate)
        keys = pool_keys(cfg, k, gate, w["indexer.index_kpool_compress_ape"])
        if index_roundtrip is not None:  # the pool keys are stored in the index dtype too
            keys = index_roundtrip(keys)
        scores = index_scores(cfg, qi, head_w, keys)
        sel = select_tokens(cfg, scores)
    else:
        sel = jnp.asarray(shared_sel, jnp.int32)

    # Expanded (HF) form: keys U_k c_j, values U_v c_j, masked to the selected set.
    kv_b = w["kv_b_proj.weight"].reshape(H, Dn + Dv, C)
    keys_h = jnp.einsum("hdc,jc->hjd", kv_b[:, :Dn], c, precision=HIGHEST)
    values_h = jnp.einsum("hdc,jc->hjd", kv_b[:, Dn:], c, precision=HIGHEST)
    logits = jnp.einsum("thd,hjd->htj", q, keys_h, precision=HIGHEST) * Dn ** -0.5
    mask = selection_mask(sel, s)[None]
    logits = jnp.where(mask, logits, -jnp.inf)
    # A row with nothing selected attends to nothing: its output is 0.
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("htj,hjd->thd", p, values_h, precision=HIGHEST).reshape(s, H * Dv)
    y = _linear(o, w["o_proj.weight"])
    return ReferenceOutput(y=y, sel=sel, pool_scores=scores)
