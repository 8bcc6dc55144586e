"""Token choice on the device: greedy, or temperature / top-p sampling with explicit keys.

A sampled token is a function of the logits, the sequence's key and the token's position
only: `categorical(fold_in(key, position), ...)`. So a token comes out the same whether it
is drawn in a Python loop, in an on-device loop, or as one row of a speculative verify.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.errors import SamplingError

SAMPLING_MODES = ("greedy", "sample")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """mode "greedy" (argmax; lowest id on ties) or "sample" (softmax(logits / temperature)
    restricted to the smallest set of most likely tokens whose probability reaches top_p)."""
    mode: str = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.mode not in SAMPLING_MODES:
            raise SamplingError(f"sampling mode {self.mode!r} is not one of {SAMPLING_MODES}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float,
                                                                            np.floating,
                                                                            np.integer)):
                raise SamplingError(f"{name} must be a real number, got {value!r}")
        if not self.temperature > 0:
            raise SamplingError(f"temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")


def check_stop_tokens(stop_tokens, vocab_size: int) -> tuple[int, ...]:
    """Stop token ids as a tuple, each checked against the vocabulary."""
    out = tuple(int(t) for t in stop_tokens)
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise SamplingError(f"stop token(s) {bad} outside the vocabulary [0, {vocab_size})")
    return out


def _sample_row(sampling: Sampling, logits: jax.Array, key: jax.Array, position: jax.Array
                ) -> jax.Array:
    """One row: logits [V] f32, a key, the token's position [] -> token id []."""
    z = logits / sampling.temperature  # [V]
    order = None
    if sampling.top_p < 1:
        order = jnp.argsort(-z, stable=True)  # most likely first; ties: lower id first
        z = z[order]
        p = jax.nn.softmax(z)
        # Keep a token while the mass before it is below top_p (the first is always kept).
        z = jnp.where(jnp.cumsum(p) - p < sampling.top_p, z, -jnp.inf)
    i = jax.random.categorical(jax.random.fold_in(key, position), z)
    return (i if order is None else order[i]).astype(jnp.int32)


def sample_tokens(sampling: Sampling, logits: jax.Array, keys: jax.Array,
                  positions: jax.Array) -> jax.Array:
    """logits [B, R, V] f32, keys [B] (PRNG keys, one per sequence), positions [B, R] int32
    (where each chosen token will sit in its sequence) -> tokens [B, R] int32."""
    if sampling.mode == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    row = jax.vmap(lambda lg, k, p: _sample_row(sampling, lg, k, p), in_axes=(0, None, 0))
    return jax.vmap(row)(logits, keys, positions)
