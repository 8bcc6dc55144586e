"""Top-k pools under the total order, and their expansion with the visible tail.

Total order: score descending, then pool index ascending. `lax.top_k` documents that equal
values keep the lower index first, and pool scores carry no -0.0 (pool_scores.py), so its
order is exactly that one; the Pallas top-k (pallas/pool_topk.py) and the raw Triton one
(pallas/pool_topk_triton.py; by default for a compiled prompt's rows) return the same indices.
"""

from __future__ import annotations

import jax

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import Expansion, expand_xla, pool_topk_op
from dsa_jax.implementation import select_slots as select_slots_op


def top_pools(cfg: DsaConfig, scores: jax.Array, tuning=None) -> jax.Array:
    """`scores [..., P]` -> the best `min(select_k, P)` pool indices `[..., k]`, best first.
    Every implementation returns the same indices (the kernels are tested with `==`); the
    pallas path runs a kernel for rows of at most `implementation.KERNEL_MAX_P` pools,
    lax.top_k beyond. tuning: the top-k kernel's (None: its defaults)."""
    options = None if tuning is None else dict(tuning=tuning)
    return pool_topk_op(cfg, scores, min(cfg.select_k, scores.shape[-1]),
                        kernel_options=options)


def expand_selection(cfg: DsaConfig, pools: jax.Array, pos: jax.Array, valid: jax.Array
                     ) -> jax.Array:
    """Selected pools -> token slots `[..., W]`.

    pools: [..., k] best first; pos: [...] the row's position t; valid: [...] rows to fill.
    Slots `[0, n_sel*KP)` hold the pools' tokens in selection order, `n_sel = min(select_k,
    (t+1)//KP)`; the tail's `(t+1) % KP` tokens follow at `n_sel*KP` (per row); the rest -1.
    (`implementation.expand_xla`, the top-k kernel's own definition of its slots.)
    """
    k = min(cfg.select_k, pools.shape[-1])
    return expand_xla(pools[..., :k], pos, valid, expansion(cfg))


def expansion(cfg: DsaConfig) -> Expansion:
    """The block's token slots as the top-k kernel writes them."""
    return Expansion(cfg.index_kpool, cfg.sel_width, cfg.always_select_tail)


def select_slots(cfg: DsaConfig, scores: jax.Array, pos: jax.Array, valid: jax.Array, *,
                 tuning=None) -> jax.Array:
    """`expand_selection(cfg, top_pools(cfg, scores), pos, valid)`, the same slots bit for bit:
    scores [..., P], pos and valid [...] -> [..., W]. Where the top-k kernel runs it writes
    the slots itself (no separate expansion pass); `tuning`: the kernel's (None: its
    defaults)."""
    return select_slots_op(cfg, scores, min(cfg.select_k, scores.shape[-1]), pos, valid,
                           expansion(cfg), tuning)
