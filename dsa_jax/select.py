"""Top-k pools under the total order, and their expansion with the visible tail.

Total order: score descending, then pool index ascending. `lax.top_k` documents that equal
values keep the lower index first, and pool scores carry no -0.0 (pool_scores.py), so its
order is exactly that one; the Pallas top-k (pallas/pool_topk.py) and the raw Triton one
(pallas/pool_topk_triton.py; by default for a compiled prompt's rows) return the same indices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import pool_topk_op, resolve
from dsa_jax.pallas import pool_topk


def top_pools(cfg: DsaConfig, scores: jax.Array,
              tuning: pool_topk.PoolTopkTuning | None = None) -> jax.Array:
    """`scores [..., P]` -> the best `min(select_k, P)` pool indices `[..., k]`, best first.
    Every implementation returns the same indices (the kernels are tested with `==`); the
    pallas path runs a kernel for rows of at most `pallas.pool_topk.KERNEL_MAX_P` pools,
    lax.top_k beyond (measured faster there). tuning: the kernel's (None: its defaults, the
    raw Triton kernel for a compiled prompt's rows; `pool_topk.runs_triton` says which one runs)."""
    options = None if tuning is None else dict(tuning=tuning)
    return pool_topk_op(cfg, scores, min(cfg.select_k, scores.shape[-1]),
                        kernel_options=options)


def expand_selection(cfg: DsaConfig, pools: jax.Array, pos: jax.Array, valid: jax.Array
                     ) -> jax.Array:
    """Selected pools -> token slots `[..., W]`.

    pools: [..., k] best first; pos: [...] the row's position t; valid: [...] rows to fill.
    Slots `[0, n_sel*KP)` hold the pools' tokens in selection order, `n_sel = min(select_k,
    (t+1)//KP)`; the tail's `(t+1) % KP` tokens follow at `n_sel*KP` (per row); the rest -1.
    """
    kp, width = cfg.index_kpool, cfg.sel_width
    *lead, k = pools.shape
    slot = jnp.arange(width)  # [W]
    n_sel = jnp.minimum(min(cfg.select_k, k), (pos + 1) // kp)[..., None]
    # The pools' tokens as a broadcast (slot s < k*KP holds pool s // KP's token s % KP), not
    # a gather by rank: XLA writes the broadcast at the copy rate. Slots past k*KP are never
    # below n_sel*KP.
    tokens = (pools[..., :, None] * kp + jnp.arange(kp)).reshape(*lead, k * kp)  # [..., k*KP]
    from_pool = (tokens[..., :width] if k * kp >= width else
                 jnp.pad(tokens, [(0, 0)] * len(lead) + [(0, width - k * kp)]))  # [..., W]
    tail_j = slot - n_sel * kp
    tail_count = ((pos + 1) % kp)[..., None] if cfg.always_select_tail else 0
    from_tail = ((pos + 1) // kp * kp)[..., None] + tail_j
    sel = jnp.where(slot < n_sel * kp, from_pool,
                    jnp.where((tail_j >= 0) & (tail_j < tail_count), from_tail, -1))
    return jnp.where(valid[..., None], sel, -1).astype(jnp.int32)


def select_slots(cfg: DsaConfig, scores: jax.Array, pos: jax.Array, valid: jax.Array, *,
                 tuning: pool_topk.PoolTopkTuning | None = None) -> jax.Array:
    """`expand_selection(cfg, top_pools(cfg, scores), pos, valid)`, the same slots bit for bit:
    scores [..., P], pos and valid [...] -> [..., W]. Where the pallas path runs the top-k
    kernel (rows of at most `pool_topk.KERNEL_MAX_P` pools) the kernel writes the slots
    itself (`pool_topk.pool_topk_expand_pallas`: no separate expansion pass) unless the raw
    Triton kernel runs (`pool_topk.runs_triton`, by default for a compiled prompt's rows: it returns
    the pools, the expansion runs apart); `tuning`: the kernel's (None: its defaults)."""
    impl = resolve(cfg.implementation)
    k = min(cfg.select_k, scores.shape[-1])
    tuning = tuning or pool_topk.PoolTopkTuning()
    if impl == "xla" or scores.shape[-1] > pool_topk.KERNEL_MAX_P:
        return expand_selection(cfg, top_pools(cfg, scores), pos, valid)
    interpret = impl == "pallas-interpret"
    if pool_topk.runs_triton(tuning, math.prod(scores.shape[:-1]), interpret):
        # a kernel that writes no slots: the expansion apart
        pools = pool_topk.pool_topk_pallas(scores, k, interpret=interpret, tuning=tuning)
        return expand_selection(cfg, pools, pos, valid)
    expand = pool_topk.Expansion(cfg.index_kpool, cfg.sel_width, cfg.always_select_tail)
    return pool_topk.pool_topk_expand_pallas(scores, k, pos, valid, expand,
                                             interpret=interpret, tuning=tuning)
