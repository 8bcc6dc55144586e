"""Drafters for speculative decoding, traced into the serving loop's program.

A drafter is a frozen (hashable, static) object with these pure methods; its per-sequence
state `ds` travels in the loop's carry, its weights (if any) as a separate argument:
- `init_state(num_seqs, num_blocks)` -> ds (host side)
- `admit(ds, mask [B] bool, block_tables [B, MB])` -> ds: reset the masked slots
- `prefill(dweights, ds, tokens [B, S], n_new [B])` -> ds: the prompt rows, as the target's
- `propose(dweights, ds, history [B, T], lengths [B], k, max_draft [B])` -> (drafts [B, k],
  n_draft [B] <= max_draft, ds): up to k tokens to follow the sequence, whose `lengths + 1`
  known tokens are `history[:, :lengths + 1]` (the last one not yet in the target's cache)
- `commit(ds, lengths [B], accepted [B], new_lengths [B])` -> ds: after the verify, which
  kept `accepted` drafts and moved the target's lengths from `lengths` to `new_lengths`.

Which drafts are proposed never changes the tokens (the verify keeps only what the target
model would have produced itself); it changes how many rounds they take.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from dsa_jax.model import (
    ModelConfig,
    ModelState,
    StackedWeights,
    forward,
    init_model_state,
    step_rows,
)


def ngram_propose(history: jax.Array, lengths: jax.Array, k: int, max_draft: jax.Array,
                  n: int = 2) -> tuple[jax.Array, jax.Array]:
    """The tokens that followed the latest earlier occurrence of the last `n` (then fewer)
    known tokens. history [B, T] int32, lengths [B] (known tokens: `lengths + 1`) ->
    (drafts [B, k] int32, 0 past the count; counts [B] <= max_draft)."""
    b, t = history.shape
    known = lengths + 1  # [B]
    start = jnp.arange(t)  # [T] candidate match starts
    drafts = jnp.zeros((b, k), jnp.int32)
    count = jnp.zeros((b,), jnp.int32)
    found = jnp.zeros((b,), bool)
    for size in range(n, 0, -1):
        tail_at = jnp.clip(known[:, None] - size + jnp.arange(size), 0, t - 1)  # [B, size]
        tail = jnp.take_along_axis(history, tail_at, axis=1)  # [B, size]
        match = (start[None, :] <= known[:, None] - size - 1) & (known[:, None] > size)
        for i in range(size):
            shifted = jnp.pad(history[:, i:], ((0, 0), (0, i)), constant_values=-1)  # [B, T]
            match &= shifted == tail[:, i:i + 1]
        hit = match.any(axis=1) & ~found  # [B]
        latest = t - 1 - jnp.argmax(match[:, ::-1], axis=1)  # [B]
        follow = latest + size  # [B] first following position
        at = jnp.clip(follow[:, None] + jnp.arange(k), 0, t - 1)  # [B, k]
        drafts = jnp.where(hit[:, None], jnp.take_along_axis(history, at, axis=1), drafts)
        count = jnp.where(hit, jnp.clip(known - follow, 0, k), count)
        found |= hit
    count = jnp.minimum(count, max_draft).astype(jnp.int32)
    return jnp.where(jnp.arange(k) < count[:, None], drafts, 0), count


class _NoContext:
    """The drafter hooks of a drafter that keeps no per-sequence context of its own: its state
    is whatever the caller gave (or None), unchanged by admission, prefill and commit."""

    def init_state(self, num_seqs: int, num_blocks: int):
        return None

    def admit(self, ds, mask, block_tables):
        return ds

    def prefill(self, dweights, ds, tokens, n_new):
        return ds

    def commit(self, ds, lengths, accepted, new_lengths):
        return ds


@dataclasses.dataclass(frozen=True)
class NgramDrafter(_NoContext):
    """Drafts from the sequence's own history (prompt lookup): no model, no state."""
    n: int = 2

    def propose(self, dweights, ds, history, lengths, k, max_draft):
        drafts, count = ngram_propose(history, lengths, k, max_draft, self.n)
        return drafts, count, ds


@dataclasses.dataclass(frozen=True)
class ScriptedDrafter(_NoContext):
    """Proposes the known right token with probability `acceptance` (a fixed pseudo-random
    pattern over positions), a wrong one otherwise: speculation at a stated acceptance rate,
    to measure it or to test it with any model. Its state is the right tokens `[B, T]` (the
    plain decode's, from a run before), given as the drafter state."""
    vocab: int
    acceptance: float

    def propose(self, dweights, ds, history, lengths, k, max_draft):
        at = jnp.clip(lengths[:, None] + 1 + jnp.arange(k), 0, ds.shape[1] - 1)  # [B, k]
        right = jnp.take_along_axis(ds, at, axis=1)  # [B, k]
        lucky = (at * 40503 % 65536).astype(jnp.float32) / 65536 < self.acceptance  # [B, k]
        drafts = jnp.where(lucky, right, (right + 1) % self.vocab)  # [B, k]
        count = jnp.minimum(max_draft, k).astype(jnp.int32)  # [B]
        return jnp.where(jnp.arange(k) < count[:, None], drafts, 0), count, ds


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A small model of the same vocabulary drafts greedily, its K autoregressive steps one
    `lax.scan`. Its cache mirrors the target's sequences (same block tables, its own pool);
    `dweights` are its `StackedWeights`."""
    mcfg: ModelConfig

    def init_state(self, num_seqs: int, num_blocks: int) -> ModelState:
        return init_model_state(self.mcfg, num_seqs, num_blocks)

    def admit(self, ds: ModelState, mask, block_tables) -> ModelState:
        return ds._replace(block_tables=jnp.where(mask[:, None], block_tables, ds.block_tables),
                           lengths=jnp.where(mask, 0, ds.lengths))

    def prefill(self, dweights: StackedWeights, ds: ModelState, tokens, n_new) -> ModelState:
        return forward(self.mcfg, dweights, ds, tokens, n_new)[1]

    def propose(self, dweights: StackedWeights, ds: ModelState, history, lengths, k,
                max_draft):
        b, t = history.shape
        r = step_rows(self.mcfg.dsa, 2)  # a step feeds at most 2 rows
        drafting = max_draft > 0  # [B]
        # The first step also feeds the known tokens the draft cache lacks (at most one more
        # than the newest: the last draft of a round whose every draft was kept).
        catch_up = jnp.where(drafting, lengths + 1 - ds.lengths, 0)  # [B] in {0, 1, 2}
        first = jnp.take_along_axis(
            history, jnp.clip(ds.lengths[:, None] + jnp.arange(r), 0, t - 1), axis=1)

        def one(carry, j):
            ds, prev = carry
            rows = jnp.where(j == 0, first,
                             jnp.zeros((b, r), jnp.int32).at[:, 0].set(prev))  # [B, R]
            fed = jnp.where(j == 0, catch_up, drafting.astype(jnp.int32))  # [B]
            logits, ds, _ = forward(self.mcfg, dweights, ds, rows, fed,
                                    attend_rows=2)  # fed <= 2
            last_row = jnp.maximum(fed - 1, 0)[:, None, None]
            tok = jnp.argmax(jnp.take_along_axis(logits, last_row, axis=1)[:, 0], axis=-1)
            return (ds, tok.astype(jnp.int32)), tok.astype(jnp.int32)

        (ds, _), toks = lax.scan(one, (ds, jnp.zeros((b,), jnp.int32)), jnp.arange(k))
        count = jnp.minimum(max_draft, k).astype(jnp.int32)
        drafts = jnp.where(jnp.arange(k) < count[:, None], toks.T, 0)  # [B, k]
        return drafts, count, ds

    def commit(self, ds: ModelState, lengths, accepted, new_lengths) -> ModelState:
        # Its rows from `lengths` on hold (newest, d1, d2, ...); the target emitted at most
        # accepted + 1 tokens, so its new length ends within the right drafts: rewind to it.
        return ds._replace(lengths=jnp.minimum(ds.lengths, new_lengths))
