"""A decode loop of your own: one DSA layer inside `lax.scan`, sampling every token.

`dsa_jax.serving_step` is the block's step as a pure function: jit it, scan it, shard it. Its
results are bit-identical to the eager `dsa_jax.decode` calls, which this script checks: it
runs the same loop both ways and compares every output with `==`.

    python examples/serving_loop.py [--seqs 2] [--prompt 24] [--steps 12] [--config tiny]

The toy around the block: a token embedding `E [V, D]` feeds the layer, and the logits are
`y @ E.T`; each sequence samples from `softmax(logits / temperature)` with its own key.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dsa_jax
from dsa_jax.shapes import load_config

VOCAB, TEMPERATURE = 64, 0.8


def sample(logits: jax.Array, keys: jax.Array, t) -> jax.Array:
    """One token per sequence: `logits [B, V]`, `keys [B]` -> `[B]` int32."""
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(keys)  # [B]
    return jax.vmap(jax.random.categorical)(step_keys, logits / TEMPERATURE).astype(jnp.int32)


def scanned_loop(step, steps: int):
    """The user's loop: `steps` decodes of every sequence in one `lax.scan`, one program."""
    def run(weights, embed, state, first, keys):
        def body(carry, t):
            state, tok = carry  # tok [B]
            y, state, sel = step(weights, state, embed[tok])  # y [B, D], sel [B, W]
            nxt = sample(y @ embed.T, keys, t)  # [B]
            return (state, nxt), (y, sel, nxt)
        (state, _), (ys, sels, toks) = lax.scan(body, (state, first), jnp.arange(steps))
        return state, ys, sels, toks  # ys [T, B, D], sels [T, B, W], toks [T, B]
    return step.jit(run, donate_argnames=("state",))


def eager_loop(cfg, weights, embed, state, first, keys, steps: int):
    """The same loop, one eager `dsa_jax.decode` call per token (host-side checks included)."""
    head = jax.jit(lambda y, e, k, t: sample(y @ e.T, k, t))
    ys, sels, toks, tok = [], [], [], first
    for t in range(steps):
        y, state, sel = dsa_jax.decode(cfg, weights, state, embed[tok])
        tok = head(y, embed, keys, jnp.int32(t))
        ys.append(y), sels.append(sel), toks.append(tok)
    return state, jnp.stack(ys), jnp.stack(sels), jnp.stack(toks)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", help="a shipped config name or a JSON path")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=12, help="tokens decoded per sequence")
    args = ap.parse_args(argv)

    cfg = load_config(args.config)
    k_w, k_e, k_p, k_s = jax.random.split(jax.random.key(0), 4)
    weights = dsa_jax.init_random_weights(cfg, k_w)
    embed = jax.random.normal(k_e, (VOCAB, cfg.hidden_size), jnp.float32)  # [V, D]
    prompt = jax.random.randint(k_p, (args.seqs, args.prompt), 0, VOCAB)  # [B, P]
    keys = jax.random.split(k_s, args.seqs)  # [B]

    state = dsa_jax.init_state(cfg, args.seqs)
    y, state, _ = dsa_jax.prefill(cfg, weights, state, embed[prompt])  # y [B, P, D]
    first = sample(y[:, -1] @ embed.T, keys, 2**20)  # [B]
    dsa_jax.check_step(cfg, weights, state, embed[first], kind="decode")  # room, tables, ...

    step = dsa_jax.serving_step(cfg, "decode")
    loop = scanned_loop(step, args.steps)
    start = time.perf_counter()
    copy = jax.tree_util.tree_map(jnp.copy, state)  # the loop donates its state
    s_scan, ys, sels, toks = jax.block_until_ready(loop(weights, embed, copy, first, keys))
    print(f"scanned loop: {args.steps} tokens x {args.seqs} sequences in one program "
          f"({time.perf_counter() - start:.1f} s with its compile)")
    s_eager, ys_e, sels_e, toks_e = eager_loop(cfg, weights, embed, state, first, keys,
                                               args.steps)
    same = {name: bool(np.array_equal(np.asarray(a), np.asarray(b)))
            for name, a, b in (("y", ys, ys_e), ("sel", sels, sels_e), ("tokens", toks, toks_e),
                               ("lengths", s_scan.lengths, s_eager.lengths),
                               ("latent", s_scan.latent, s_eager.latent))}
    print("scanned == eager decode calls, bit for bit: "
          + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    print("tokens:", np.asarray(toks).T.tolist())
    return {"same": same, "tokens": np.asarray(toks), "eager_tokens": np.asarray(toks_e)}


if __name__ == "__main__":
    result = main()
    raise SystemExit(0 if all(result["same"].values()) else 1)
