"""Byte and FLOP counts of the timed work: the roofline floor of every point is the larger of
its fewest bytes over the measured copy bandwidth and its FLOPs over the measured bf16 matmul
rate (`benchmarks.harness.Ceilings.floor`). Pure functions of the config and the shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLASHMLA_TFLOPS = 410.0  # FlashMLA, fp8 sparse decode, H800 (published)


def itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def param_bytes(weights) -> int:
    """Bytes of every weight array (one rank's)."""
    return int(sum(a.nbytes for a in jax.tree_util.tree_leaves(weights)))


def row_flops(cfg, ctx: int) -> dict:
    """FLOPs of one new row at position ~ctx (multiply-add = 2), by stage."""
    D, R, C = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Hl, Dn, Dv = cfg.local_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    nx = R + C + 2 * Di + Hi
    nq = Hl * Dn + Hi * Di
    proj = 2 * (D * nx + R * nq + Hl * Dn * C + Hl * Dv * C + Hl * Dv * D)
    pools = ctx // cfg.index_kpool
    index = 2 * Hi * Di * pools + 2 * Hi * pools
    width = min(cfg.sel_width, ctx)
    attend = 4 * Hl * width * C
    return {"proj": proj, "index": index, "attend": attend}


def step_cost(cfg, param_bytes: int, num_seqs: int, k: int, ctx: int, x_itemsize: int = 2
              ) -> tuple[int, int]:
    """(bytes, flops) of a decode / verify step: `k` rows for each of `num_seqs` sequences at
    context `ctx`. Bytes: weights once; per sequence the live pool keys and one selection's
    latents (the rows of one sequence may share them); per row the cache writes (latent, index
    k and gate, the pool key on completion with its members re-read), x in, y (f32) and the
    selection (int32) out."""
    C, Di, KP, W = cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_kpool, cfg.sel_width
    lat = itemsize(cfg.cache_dtype)
    idx = itemsize(cfg.index_cache_dtype)
    per_seq = (ctx // KP) * Di * idx + min(W, ctx) * C * lat  # pool keys: the index dtype
    per_row = (C * lat + 2 * Di * idx + 2 * Di * idx + Di * idx / KP
               + cfg.hidden_size * (x_itemsize + 4) + W * 4)
    nbytes = param_bytes + num_seqs * per_seq + num_seqs * k * per_row
    flops = num_seqs * k * sum(row_flops(cfg, ctx).values())
    return int(nbytes), int(flops)


def prefill_cost(cfg, param_bytes: int, s: int, x_itemsize: int = 2) -> tuple[int, int]:
    """(bytes, flops) of a one-sequence prefill of `s` tokens from empty, causal: row t scores
    the (t+1)//KP pools complete at t and attends min(W, t+1) tokens."""
    C, Di, KP, W = cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_kpool, cfg.sel_width
    Hl, Hi = cfg.local_heads, cfg.index_n_heads
    lat = itemsize(cfg.cache_dtype)
    idx = itemsize(cfg.index_cache_dtype)
    nbytes = (param_bytes + s * (C * lat + 2 * Di * idx + cfg.hidden_size * (x_itemsize + 4)
                                 + W * 4)
              + (s // KP) * Di * idx  # pool keys written
              + s * C * lat)  # every latent read once
    proj = row_flops(cfg, 0)["proj"] * s
    t = np.arange(s, dtype=np.int64)
    index = int((2 * Hi * Di + 2 * Hi) * ((t + 1) // KP).sum())
    attend = int(4 * Hl * C * np.minimum(W, t + 1).sum())
    return int(nbytes), int(proj + index + attend)


def attend_cost(b: int, r: int, h: int, w: int, c: int, lat_item: int = 1) -> tuple[int, int]:
    """Gather-attend alone: each row's selected latents once, q in and out (f32), the slots."""
    n = b * r
    nbytes = n * w * c * lat_item + 2 * n * h * c * 4 + n * w * 4
    return int(nbytes), int(4 * n * h * w * c)


def selection_cost(cfg, b: int, r: int, ctx: int) -> tuple[int, int]:
    """Pool scores over the live keys, top-k and expansion: keys read once per sequence, the
    queries and head weights per row, the selection written. Pool keys are stored in the index
    cache's dtype."""
    p = ctx // cfg.index_kpool
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    keys = b * p * Di * itemsize(cfg.index_cache_dtype)
    nbytes = keys + b * r * (Hi * Di * 4 + Hi * 4) + b * r * cfg.sel_width * 4
    return int(nbytes), int(b * r * (2 * Hi * Di * p + 2 * Hi * p))


def absorbed_vs_runtime(cfg) -> dict:
    """Weight bytes and per-row FLOPs of the kv_b forms for one rank (the lever)."""
    D, R, C = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Hl, Dn, Dv = cfg.local_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    pb = itemsize(cfg.param_dtype)
    runtime = {"q_b": Hl * Dn * R, "u_k": Hl * Dn * C, "u_v": Hl * Dv * C, "o_proj": D * Hl * Dv}
    absorbed = {"q_b_absorbed": Hl * C * R, "o_absorbed": D * Hl * C}
    rb = sum(runtime.values()) * pb
    ab = sum(absorbed.values()) * pb
    return {
        "tp_degree": cfg.tp_degree,
        "runtime_params": runtime, "absorbed_params": absorbed,
        "runtime_bytes": rb, "absorbed_bytes": ab,
        "runtime_fewer_bytes_frac": 1 - rb / ab,
        "runtime_flops_per_row": 2 * sum(runtime.values()),
        "absorbed_flops_per_row": 2 * sum(absorbed.values()),
        "note": "q path: q_b [Hl*Dn, R] then U_k [Hl, Dn, C] (run time) vs W_qb absorbed "
                "[Hl*C, R]; out path: U_v [Hl, Dv, C] then o_proj [D, Hl*Dv] vs o absorbed "
                "[D, Hl*C]. The other weights (x_proj, indexer wq_b) are the same in both.",
    }
