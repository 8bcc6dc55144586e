"""What the benchmarks run on: random weights, states whose caches are filled to a context
directly (random fp8 latents, random indexer k / gate, random pool keys, lengths = context)
rather than by a prefill, random input rows, and the timed step.

The timed step is `dsa_jax.bitwise_jit` of the public `dsa_jax.layer.step`, with the
state donated, as a serving loop would jit it; rows are padded to `cfg.max_verify` as
`dsa_jax.decode` / `decode_k` pad them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import bitwise_jit, layer
from dsa_jax.state import DsaState, quantize_latent, ring_rows
from dsa_jax.weights import fold_weights, hf_shapes, random_hf_value

# The PRNG of the random states and caches: XLA's RngBitGenerator compiles ~4x faster than
# threefry on a CPU (the values never matter to the timing).
RNG = "rbg"
STEP = bitwise_jit(layer.step, static_argnames=("cfg", "attend_rows"), donate_argnames=("state",))
STEP_WHAT = ("dsa_jax.bitwise_jit(dsa_jax.layer.step, state donated), rows padded to "
             "cfg.max_verify, the gather-attend on the call's k rows (attend_rows=k, as "
             "decode/decode_k run it)")


def random_hf_tensors(cfg, seed: int, has_indexer: bool = True) -> dict:
    """Random fp32 HF tensors of one layer: the library's recipe
    (`dsa_jax.weights.random_hf_value`) on numpy's normal draws (no compile per shape)."""
    rng = np.random.default_rng(seed)
    return {name: np.asarray(random_hf_value(name, rng.standard_normal(shape, np.float32)),
                             np.float32)
            for name, shape in hf_shapes(cfg, has_indexer).items()}


def random_weights(cfg, hf: dict, tp: int):
    """Rank 0's folded weights at TP degree `tp`, on the device."""
    return jax.block_until_ready(fold_weights(cfg.replace(tp_degree=tp), hf, tp_rank=0))


def random_state(cfg, num_seqs: int, length: int, seed: int, kv_scale: float = 1 / 64,
                 indexer: bool = True) -> DsaState:
    """A state whose caches hold `length` random tokens per sequence (permuted block tables);
    `indexer=False`: no indexer cache (0 rows), for the gather-attend alone. One jitted
    program per shape."""
    # Only the shapes matter: one compile per shape, whatever the implementation or TP (the
    # indexer ring's rows depend on max_verify: taken before it is set aside).
    rows = ring_rows(cfg) if indexer else 0
    cfg = cfg.replace(implementation="xla", tp_degree=1, max_verify=1)
    return _random_state_jit(cfg, num_seqs, np.int32(length), np.uint32(seed), kv_scale,
                             indexer, rows)


@functools.partial(jax.jit, static_argnums=(0, 1, 4, 5, 6))
def _random_state_jit(cfg, num_seqs, length, seed, kv_scale, indexer, rows) -> DsaState:
    nb = num_seqs * cfg.blocks_per_seq
    ks = jax.random.split(jax.random.key(seed, impl=RNG), 6)
    c = jax.random.normal(ks[0], (nb, cfg.block_size, cfg.kv_lora_rank), jnp.bfloat16)
    scale = jnp.asarray(kv_scale, jnp.float32)
    latent = quantize_latent(cfg, c.astype(jnp.float32) if cfg.cache_dtype == "float32"
                             else c, scale)  # [NB, bs, C]
    tables = jax.random.permutation(ks[1], nb).reshape(num_seqs, -1).astype(jnp.int32)
    idt = jnp.dtype(cfg.index_cache_dtype)
    shape = (num_seqs, rows, cfg.index_head_dim)  # [B, Rr, Di]: the indexer ring
    index_k = jax.random.normal(ks[2], shape, idt)
    index_g = (0.5 * jax.random.normal(ks[3], shape, jnp.float32)).astype(idt)
    pool_keys = 0.3 * jax.random.normal(  # [B, P, Di]
        ks[4], (num_seqs, cfg.num_pools if indexer else 0, cfg.index_head_dim), jnp.float32
    ).astype(idt)
    lengths = jnp.full((num_seqs,), length, jnp.int32)  # [B]
    return DsaState(latent=latent, kv_scale=scale, block_tables=tables, index_k=index_k,
                    index_g=index_g, pool_keys=pool_keys, lengths=lengths,
                    index_lengths=lengths + 0)


@functools.partial(jax.jit, donate_argnums=0)
def random_caches(st, keys):
    """`st` (a `DsaState` or a model state, donated) with its latent cache, indexer ring and
    pool keys random (never zeros), drawn from `keys[0..3]`; lengths as they were. One
    compiled program per state shape."""
    return st._replace(
        latent=jax.random.normal(keys[0], st.latent.shape, jnp.bfloat16).astype(st.latent.dtype),
        index_k=jax.random.normal(keys[1], st.index_k.shape, jnp.bfloat16).astype(
            st.index_k.dtype),
        index_g=jax.random.normal(keys[2], st.index_g.shape, jnp.bfloat16).astype(
            st.index_g.dtype),
        pool_keys=(0.1 * jax.random.normal(keys[3], st.pool_keys.shape)).astype(
            st.pool_keys.dtype))


def step_rows(cfg, num_seqs: int, k: int, rows: int, seed: int, n_inputs: int = 3) -> list:
    """`n_inputs` random input blocks `x [B, rows, D]` bf16, the first `k` rows
    of each sequence random and the rest zero (padding, as decode / decode_k pad them)."""
    rng = np.random.default_rng(seed)
    xs = []
    for _ in range(n_inputs):
        x = np.zeros((num_seqs, rows, cfg.hidden_size), np.float32)
        x[:, :k] = rng.standard_normal((num_seqs, k, cfg.hidden_size), np.float32)
        xs.append(jax.device_put(x.astype(jnp.bfloat16)))
    return xs


class StepRunner:
    """Calls a jitted step (default `STEP`) on a donated state, `k` new rows per sequence per
    call; `reset` sets every sequence back to `start` tokens (a rewind)."""

    def __init__(self, cfg, weights, num_seqs: int, k: int, rows: int, start: int, seed: int,
                 n_inputs: int = 3, step=STEP):
        self.cfg, self.weights, self.k, self.start, self.num_seqs = cfg, weights, k, start, num_seqs
        self.step = step
        self.state = random_state(cfg, num_seqs, start, seed)
        self.xs = step_rows(cfg, num_seqs, k, rows, seed, n_inputs)
        self.n_new = jax.device_put(np.full((num_seqs,), k, np.int32))  # [B]
        self.i = 0
        self.last = None
        # as decode / decode_k run the step: the gather-attend on the call's k rows only
        self.kwargs = dict(attend_rows=k) if step is STEP else {}

    def __call__(self):
        x = self.xs[self.i % len(self.xs)]
        self.i += 1
        y, self.state, sel = self.step(self.cfg, self.weights, self.state, x, self.n_new, None,
                                       **self.kwargs)
        self.last = (y, sel)
        return y, self.state

    def reset(self):
        self.state = rewound(self.state, self.start)
        return self.state


def rewound(state: DsaState, length: int) -> DsaState:
    """`state` with every sequence set back to `length` tokens (the timed calls then all run at
    the same context). Two distinct buffers (both are donated); host arrays put on the device,
    so no compile."""
    b = state.lengths.shape[0]
    return state._replace(lengths=jax.device_put(np.full((b,), length, np.int32)),
                          index_lengths=jax.device_put(np.full((b,), length, np.int32)))


def attend_inputs(cfg, b: int, r: int, h: int, w: int, ctx: int, seed: int, n_sets: int = 3):
    """A random latent cache (b sequences of ctx tokens) and n_sets of (q [b, r, h, C],
    selections [b, r, w]): distinct random pools of KP tokens per row, then the newest tokens
    as the tail."""
    st = random_state(cfg.replace(max_context=ctx), b, ctx, seed, indexer=False)
    kp = cfg.index_kpool
    npool = min(w // kp, ctx // kp)
    tail = w - npool * kp
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        q = rng.standard_normal((b, r, h, cfg.kv_lora_rank), np.float32)
        u = rng.random((b * r, ctx // kp), np.float32)
        pools = np.argpartition(u, npool - 1, axis=1)[:, :npool]  # distinct random pools
        rng.permuted(pools, axis=1, out=pools)
        toks = (pools[..., None] * kp + np.arange(kp)).reshape(b, r, npool * kp)
        if tail:
            tl = ctx - tail + np.arange(tail)  # the visible tail: the newest tokens
            toks = np.concatenate([toks, np.broadcast_to(tl, (b, r, tail))], -1)
        sets.append((jax.device_put(q), jax.device_put(toks.astype(np.int32))))
    return st, sets


def selection_inputs(cfg, b: int, r: int, ctx: int, seed: int, n_sets: int = 3):
    """Pool keys `[b, P, Di]` (in the index cache dtype, as a state stores them), positions and
    validity `[b, r]` (only each sequence's first row real, as the padded decode step runs it)
    and n_sets of indexer queries and head weights."""
    rng = np.random.default_rng(seed)
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    put = jax.device_put
    keys = put(jnp.asarray(0.3 * rng.standard_normal((b, cfg.num_pools, di), np.float32)
                           ).astype(cfg.index_cache_dtype))
    pos = put(np.broadcast_to(ctx - r + np.arange(r, dtype=np.int32), (b, r)).copy())
    valid = put(np.broadcast_to(np.arange(r) < 1, (b, r)).copy())
    sets = [(put(rng.standard_normal((b, r, hi, di), np.float32)),
             put(rng.standard_normal((b, r, hi), np.float32) * np.float32((hi * di) ** -0.5)))
            for _ in range(n_sets)]
    return keys, pos, valid, sets


class Cycle:
    """A call over input sets taken in turn: `fn(*sets[i % n])`."""

    def __init__(self, fn, sets):
        self.fn, self.sets, self.i = fn, sets, 0

    def __call__(self):
        args = self.sets[self.i % len(self.sets)]
        self.i += 1
        return self.fn(*args)
