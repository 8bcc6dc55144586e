"""`serving_step`: the block's step as a pure function for your own `jax.jit` or `lax.scan`,
bit-identical to `dsa_jax.decode`, `decode_k` and `prefill`.

`decode` and friends are host-side calls: they check the state's values on the host, then
dispatch a program of their own. Inside a trace the values are unknown, so a traced step
cannot check them on the host. `serving_step(cfg, kind, rows=...)` is the traceable form:

    step = dsa_jax.serving_step(cfg, "decode")
    loop = step.jit(lambda w, s, x: step(w, s, x))  # or inside your own lax.scan

- **The same bits** as the eager call, whatever jit wraps it: the rows are padded and cut as
  the eager call pads them (`layer.decode_rows`), and the step sits between optimization
  barriers, the weights too. Closed-over weights become XLA constants, which XLA may fold into
  the GEMMs (other bits); the barrier makes them operands like arguments are.
- **Compile options**: on a GPU, XLA picks each GEMM's split-K per program unless told not to
  (`dsa_jax.bitwise`). The function carries them: `step.compiler_options`, and `step.jit(fn)`
  jits `fn` with them. A program compiled without them still runs, and the row-invariant
  Pallas GEMMs keep their bits; XLA's GEMMs may round differently.
- **What is checked where**: shapes, dtypes and the pytrees' types at trace time (`StepError`,
  `TypeError`). The values (lengths, block tables) on the device: a sequence whose rows would
  pass `max_context`, reach an unmapped block table entry, or whose indexer is behind, takes
  no rows: nothing is written, its length stays, its `y` rows are NaN and its `sel` rows -1
  (a poisoned, documented result, never a silent value). What the device does not check
  (blocks mapped twice, the indexer ring's reach after a rewind, `shared_sel` ids) is a
  precondition: `dsa_jax.check_step(cfg, weights, state, x, kind=...)` checks everything on the
  host, as the eager calls do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dsa_jax.bitwise import BITWISE_OPTIONS, bitwise_jit
from dsa_jax.config import DsaConfig
from dsa_jax.layer import RowLayout, decode_rows, padded_step, prepare_step
from dsa_jax.state import DsaState
from dsa_jax.step_checks import StepError, check_layer, check_types, check_x, rows_per_seq
from dsa_jax.weights import DsaWeights

__all__ = ["ServingStep", "check_step", "serving_step"]

KINDS = ("decode", "verify", "prefill")


def room(cfg: DsaConfig, state: DsaState, n_new: jax.Array, has_indexer: bool) -> jax.Array:
    """`[B]` bool: the sequence can take its `n_new [B]` rows: within `max_context`, every
    block below its new end mapped to a physical block, its indexer not behind."""
    ends = state.lengths + n_new  # [B]
    nb = state.latent.shape[0]
    cols = jnp.arange(state.block_tables.shape[1])[None, :]  # [1, MB]
    read = cols < ((ends + cfg.block_size - 1) // cfg.block_size)[:, None]  # [B, MB]
    unmapped = read & ((state.block_tables < 0) | (state.block_tables >= nb))  # [B, MB]
    ok = (ends <= cfg.max_context) & ~unmapped.any(axis=1)  # [B]
    if has_indexer:
        ok &= state.index_lengths >= state.lengths
    return ok


@dataclasses.dataclass(frozen=True)
class ServingStep:
    """`(weights, state, x, *, active=None, num_tokens=None, shared_sel=None) -> (y, state,
    sel)`: one `kind` step of `rows` rows per sequence, pure and traceable. See the module
    docstring. Shapes: decode `x [B, D]` -> `y [B, D]`, `sel [B, W]`; verify and prefill
    `x [B, rows, D]` -> `y [B, rows, D]`, `sel [B, rows, W]`."""
    cfg: DsaConfig
    kind: str
    rows: int
    layout: RowLayout

    @property
    def compiler_options(self) -> dict[str, Any]:
        """The compile options the bit-identity needs (`dsa_jax.BITWISE_OPTIONS`)."""
        return dict(BITWISE_OPTIONS)

    def jit(self, fn=None, **jit_kwargs):
        """`jax.jit(fn or self, **jit_kwargs)` with `compiler_options`."""
        return bitwise_jit(self if fn is None else fn, **jit_kwargs)

    def __call__(self, weights: DsaWeights, state: DsaState, x: jax.Array, *, active=None,
                 num_tokens=None, shared_sel: jax.Array | None = None
                 ) -> tuple[jax.Array, DsaState, jax.Array]:
        cfg, layout = self.cfg, self.layout
        check_types(cfg, weights, state)
        x = jnp.asarray(x)
        want = (state.num_seqs, cfg.hidden_size) if layout.squeeze else (
            state.num_seqs, self.rows, cfg.hidden_size)
        if tuple(x.shape) != want:
            raise StepError(f"this {self.kind} step takes x of shape {want}, got "
                            f"{tuple(x.shape)}")
        check_x(cfg, state, x)
        check_layer(cfg, weights, state)
        if weights.has_indexer != (shared_sel is None):
            raise StepError("a layer without an indexer takes shared_sel, one with an indexer "
                            "does not" + (" (shared_sel was given)" if shared_sel is not None
                                          else " (pass shared_sel)"))
        b = state.num_seqs
        if self.kind == "prefill":
            if active is not None:
                raise StepError("prefill takes num_tokens, not active")
            n_new = jnp.asarray(rows_per_seq(b, self.rows, num_tokens, "num_tokens"))
        else:
            if num_tokens is not None:
                raise StepError(f"{self.kind} takes active, not num_tokens")
            n_new = jnp.full((b,), layout.k, jnp.int32)  # [B]
            if active is not None:
                n_new = n_new * jnp.asarray(rows_per_seq(b, 1, active, "active"))
        n_new = n_new.astype(jnp.int32)  # [B]
        ok = room(cfg, state, n_new, weights.has_indexer)  # [B]
        n_new = jnp.where(ok, n_new, 0)  # [B]
        weights = lax.optimization_barrier(weights)  # closed-over weights stay operands
        y, state, sel = padded_step(cfg, layout, weights, state, x, n_new, shared_sel)
        keep = ok.reshape((b,) + (1,) * (y.ndim - 1))
        y = jnp.where(keep, y, jnp.nan)
        sel = jnp.where(ok.reshape((b,) + (1,) * (sel.ndim - 1)), sel, -1)
        return y, state, sel


def serving_step(cfg: DsaConfig, kind: str = "decode", *, rows: int = 1) -> ServingStep:
    """The block's step for your own jit: `kind` "decode" (one row per sequence), "verify"
    (`rows` consecutive tokens, `rows <= cfg.max_verify`: `decode_k`) or "prefill" (`rows`
    rows, fewer per sequence with `num_tokens`). Bit-identical to the eager call of that kind
    on the same inputs."""
    if not isinstance(cfg, DsaConfig):
        raise TypeError(f"cfg must be a DsaConfig, got {type(cfg).__name__}")
    if kind not in KINDS:
        raise StepError(f"serving_step kind {kind!r} is not one of {KINDS}")
    if not isinstance(rows, int) or rows < 1:
        raise StepError(f"rows must be a positive int, got {rows!r}")
    if kind == "decode" and rows != 1:
        raise StepError(f"a decode takes one row per sequence, got rows={rows}; use "
                        f"kind='verify' for {rows} rows")
    if kind == "verify" and rows > cfg.max_verify:
        raise StepError(f"a {rows}-row verify does not fit max_verify {cfg.max_verify}")
    if kind == "prefill":
        layout = RowLayout(rows, rows, False)
    else:
        layout = RowLayout(decode_rows(cfg, kind), rows, kind == "decode")
    return ServingStep(cfg, kind, rows, layout)


def check_step(cfg: DsaConfig, weights: DsaWeights, state: DsaState, x: jax.Array, *,
               kind: str = "decode", active=None, num_tokens=None,
               shared_sel: jax.Array | None = None) -> None:
    """Every host-side check of the eager call of `kind` on concrete inputs (what the traced
    step cannot check: blocks mapped twice, the indexer ring's reach, `shared_sel` ids, as
    well as what it checks on the device); raises `StepError` with the value and the limit,
    returns None when the step fits. Reads the state's lengths and tables (one device read
    unless the host already holds them)."""
    check_types(cfg, weights, state)
    if kind not in KINDS:
        raise StepError(f"check_step kind {kind!r} is not one of {KINDS}")
    counts = num_tokens if kind == "prefill" else active
    prepare_step(cfg, weights, state, jnp.asarray(x), kind=kind, counts=counts,
                 shared_sel=shared_sel, check=True)
