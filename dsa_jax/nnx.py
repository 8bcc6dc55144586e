"""`DsaAttention`: the DSA block as a Flax NNX module, for people who build models in NNX.

A thin stateful wrapper over the pure functions of `dsa_jax.layer`: the folded weights
(`DsaWeights` fields) are `nnx.Param`s, the per-layer state (`DsaState` fields: paged latent
cache, per-tensor scale, block tables, indexer cache, pool keys, lengths) lives in `DsaCache`
variables, and `prefill` / `decode` / `decode_k` / `rewind` / `reset` update those variables in
place. The numbers are those of the functional API, bit for bit: each step runs the same core
(`layer.step`) on the same row layout as `dsa_jax.decode` (`layer.decode_rows`: a decode
padded to `cfg.max_verify` rows, or its one row under row-invariant GEMMs).

    model = DsaAttention(cfg, rngs=nnx.Rngs(0), num_seqs=2)
    y, sel = model.prefill(x)            # x [2, S, D]
    step = nnx.jit(lambda m, x: m.decode(x))
    y_t, sel_t = step(model, x_t)        # x_t [2, D]; the caches advance in place

Called eagerly, every step first runs the host-side checks of `dsa_jax.prefill`/`decode`
(capacity, block-table coverage, ...) and raises `dsa_jax.StepError` before anything changes.
Under `nnx.jit` the cache is traced and those checks cannot run (out-of-range writes are still
dropped, as in the functional API). Steps never donate: arrays read from the module earlier
(e.g. a snapshot `nnx.state(model, DsaCache)`) stay valid; to update the cache buffers in
place, wrap the step in `nnx.jit(..., donate_argnums=0)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsa_jax import fp8, layer
from dsa_jax.bitwise import bitwise_jit
from dsa_jax.config import DsaConfig
from dsa_jax.state import DsaState, init_state
from dsa_jax.weights import DsaWeights, init_random_weights


class DsaCache(nnx.Cache):
    """One field of the block's `DsaState` (caches, block tables, lengths).

    A subclass of `nnx.Cache`, so `nnx.state(model, nnx.Cache)` selects it along with other
    modules' caches, and `nnx.state(model, DsaCache)` selects only these.
    """


# The un-donated step: the module's variables may be read elsewhere, and under an outer
# `nnx.jit` this inlines into the caller's program. Padding runs outside it, as in
# `dsa_jax.decode`, so both run the same step program.
_step = bitwise_jit(layer.step, static_argnames=("cfg",))
_pad = jax.jit(lambda layout, x, sel: layout.pad(x, sel), static_argnums=0)
_unpad = jax.jit(lambda layout, y, sel: layout.unpad(y, sel), static_argnums=0)


class DsaAttention(nnx.Module):
    """One DSA block with its own state for `num_seqs` sequence slots.

    `DsaAttention(cfg, rngs=..., num_seqs=...)` draws random weights from `rngs.params()`
    (`init_random_weights`); `DsaAttention.from_weights(cfg, weights, num_seqs)` takes folded
    weights (e.g. `load_hf_layer` or `checkpoint.restore_weights`). `has_indexer=False` makes a
    "shared" layer: it runs no indexer and its steps take `shared_sel`, the selection of an
    earlier full layer. `num_blocks`, `kv_scale`, `block_tables` go to `init_state`.
    """

    def __init__(self, cfg: DsaConfig, *, rngs: nnx.Rngs | None = None, num_seqs: int,
                 has_indexer: bool = True, weights: DsaWeights | None = None,
                 num_blocks: int | None = None, kv_scale: float = 1.0,
                 block_tables=None):
        if weights is None:
            if rngs is None:
                raise TypeError("DsaAttention needs rngs (random weights) or weights "
                                 "(use DsaAttention.from_weights)")
            weights = init_random_weights(cfg, rngs.params(), has_indexer)
        elif not isinstance(weights, DsaWeights):
            raise TypeError(f"weights must be DsaWeights, got {type(weights).__name__}")
        self.cfg = cfg
        for name in DsaWeights._fields:
            value = getattr(weights, name)
            if value is not None and not fp8.is_fp8(value):  # fp8 blocks: kept as they are
                value = jnp.asarray(value)
            setattr(self, name, None if value is None else nnx.Param(value))
        state = init_state(cfg, num_seqs, num_blocks=num_blocks, kv_scale=kv_scale,
                           block_tables=block_tables, has_indexer=weights.has_indexer)
        for name in DsaState._fields:
            setattr(self, name, DsaCache(getattr(state, name)))

    @classmethod
    def from_weights(cls, cfg: DsaConfig, weights: DsaWeights, num_seqs: int, *,
                     num_blocks: int | None = None, kv_scale: float = 1.0,
                     block_tables=None) -> DsaAttention:
        """A module holding `weights` (folded, one layer) and an empty state."""
        return cls(cfg, num_seqs=num_seqs, weights=weights, num_blocks=num_blocks,
                   kv_scale=kv_scale, block_tables=block_tables)

    # ------------------------------------------------------------------ views

    @property
    def has_indexer(self) -> bool:
        return self.k_norm_w is not None

    @property
    def num_seqs(self) -> int:
        return self.block_tables.get_value().shape[0]

    @property
    def weights(self) -> DsaWeights:
        """The parameters as the functional API's `DsaWeights`."""
        return DsaWeights(**{name: None if getattr(self, name) is None
                             else getattr(self, name).get_value()
                             for name in DsaWeights._fields})

    @property
    def state(self) -> DsaState:
        """The cache as the functional API's `DsaState` (e.g. for `checkpoint.save_state`)."""
        return DsaState(**{name: getattr(self, name).get_value() for name in DsaState._fields})

    def set_state(self, state: DsaState) -> None:
        """Replace the cache (e.g. with one from `checkpoint.restore_state`)."""
        if not isinstance(state, DsaState):
            raise TypeError(f"state must be a DsaState, got {type(state).__name__}")
        if (state.index_k.shape[1] > 0) != self.has_indexer:
            raise ValueError(f"this module {'has' if self.has_indexer else 'has no'} indexer, "
                             f"but the state {'has' if state.index_k.shape[1] else 'has no'} "
                             f"indexer cache")
        for name in DsaState._fields:
            getattr(self, name).set_value(getattr(state, name))

    # ------------------------------------------------------------------ steps

    def _step(self, x: jax.Array, kind: str, counts, shared_sel: jax.Array | None
              ) -> tuple[jax.Array, jax.Array]:
        layout, n_new = layer.prepare_step(self.cfg, self.weights, self.state, x, kind=kind,
                                           counts=counts, shared_sel=shared_sel)
        x_rows, sel_rows = _pad(layout, x, shared_sel)
        y, state, sel = _step(self.cfg, self.weights, self.state, x_rows, jnp.asarray(n_new),
                              sel_rows)
        self.set_state(state)
        return _unpad(layout, y, sel)

    def prefill(self, x: jax.Array, *, num_tokens=None, shared_sel: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
        """Append up to `S` tokens to every sequence (`dsa_jax.prefill`).

        x: [B, S, D]; num_tokens: [B] real rows per sequence (default S); shared_sel:
        [B, S, W] for a shared layer. Returns `y [B, S, D]` f32 and `sel [B, S, W]` int32.
        """
        return self._step(x, "prefill", num_tokens, shared_sel)

    def decode_k(self, x: jax.Array, *, active=None, shared_sel: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """K consecutive tokens of every sequence, a speculative verify (`dsa_jax.decode_k`).

        x: [B, K, D], `K <= cfg.max_verify`; active: [B] bool; shared_sel: [B, K, W].
        Returns `y [B, K, D]`, `sel [B, K, W]`; bit-identical to K `decode` calls.
        """
        return self._step(x, "verify", active, shared_sel)

    def decode(self, x: jax.Array, *, active=None, shared_sel: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
        """One token for every sequence (`dsa_jax.decode`).

        x: [B, D]; active: [B] bool (default all); shared_sel: [B, W]. Returns `y [B, D]` f32
        and `sel [B, W]` int32.
        """
        return self._step(x, "decode", active, shared_sel)

    def rewind(self, lengths) -> None:
        """Drop every token at or past `lengths [B]` (a rejected speculation; `dsa_jax.rewind`)."""
        self.set_state(layer.rewind(self.cfg, self.state, lengths))

    def reset(self) -> None:
        """Empty every sequence (lengths to 0). The cache's old contents become unreachable;
        the block tables and `kv_scale` are kept."""
        zeros = jnp.zeros_like(self.lengths.get_value())
        self.lengths.set_value(zeros)
        self.index_lengths.set_value(zeros)


__all__ = ["DsaAttention", "DsaCache"]
