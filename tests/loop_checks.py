"""The serving loop's bitwise checks, shared by the GPU tests (`pytest -m gpu`: the kernels
compiled at GLM-5.3-Flash shapes) and their CPU twins (the tiny config): scanned == unrolled,
device loop == Python loop, speculative == plain (n-gram, draft-model and scripted drafters),
and where a forward writes its new latent rows in a large stacked pool. Each check returns
`{name: bool}` (or a bool), so a failing test names what differed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import bitwise_jit, serve
from dsa_jax.drafting import ModelDrafter, ScriptedDrafter
from dsa_jax.model import (
    ModelConfig,
    forward,
    forward_unrolled,
    init_model,
    init_model_state,
    stack_weights,
    unfold_state,
)
from dsa_jax.sampling import Sampling
from dsa_jax.testing import copy_tree

# The scanned and the unrolled model, jitted once, with the library programs' compile options
# and with those of a `Program(weights_in_place=True)` (the default Program's).
FORWARD_JITS = (bitwise_jit(forward, static_argnums=0, donate_argnums=2),
                bitwise_jit(forward_unrolled, static_argnums=0, donate_argnums=2))
FORWARD_JITS_IN_PLACE = tuple(
    bitwise_jit(f, static_argnums=0, donate_argnums=2, compiler_options=serve.IN_PLACE_WEIGHTS)
    for f in (forward, forward_unrolled))
SAMPLED = Sampling("sample", 0.8, 0.9)  # top-p sampling


def bits_equal(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            return False
    return True


def model(cfg, vocab: int, seed: int = 0):
    """(ModelConfig, per-layer weights, stacked weights) with random weights."""
    mcfg = ModelConfig(cfg, vocab_size=vocab)
    weights = init_model(mcfg, jax.random.key(seed))
    return mcfg, weights, stack_weights(mcfg, weights)


@jax.jit
def _random_caches(ms, k):
    def normal(key, a, scale=1.0):
        return (scale * jax.random.normal(key, a.shape, jnp.bfloat16)).astype(a.dtype)

    return ms._replace(latent=normal(k[0], ms.latent), index_k=normal(k[1], ms.index_k),
                       index_g=normal(k[2], ms.index_g),
                       pool_keys=normal(k[3], ms.pool_keys, 0.1))


def random_serving(prog: serve.Program, b: int, length: int, key) -> serve.Serving:
    """`b` live sequences whose caches hold `length` random tokens (latents, indexer rows and
    pool keys random, never zeros); no token limit."""
    mcfg = prog.mcfg
    mb = mcfg.dsa.blocks_per_seq
    ms = init_model_state(mcfg, b, b * mb, np.arange(b * mb, dtype=np.int32).reshape(b, mb))
    k = jax.random.split(key, 5)
    ms = _random_caches(ms, k)._replace(lengths=jnp.full((b,), length, jnp.int32))
    slots = serve.init_slots(mcfg, b)._replace(
        last=jax.random.randint(k[4], (b,), 0, mcfg.vocab_size),
        limit=jnp.full((b,), 10 ** 6, jnp.int32), done=jnp.zeros((b,), bool))
    draft = prog.drafter.init_state(b, b * mb) if prog.speculate else None
    return serve.Serving(ms, slots, draft)


def scan_equals_unrolled(cfg, vocab: int, b: int = 2, in_place: bool = True) -> bool:
    """A prompt chunk, verify-shaped rows (ragged, one sequence idle) and 1-row steps through
    the scanned model and the unrolled stack: logits, selections and every cache `==`."""
    mcfg, weights, stacked = model(cfg, vocab, 1)
    nb = b * cfg.blocks_per_seq
    rng = np.random.default_rng(0)
    # One shuffled pool split between the sequences: no physical block mapped twice.
    tables = rng.permutation(nb)[:b * cfg.blocks_per_seq].reshape(b, cfg.blocks_per_seq)
    ms = init_model_state(mcfg, b, nb, tables.astype(np.int32))
    states = tuple(unfold_state(mcfg, ms))
    scanned, unrolled = FORWARD_JITS_IN_PLACE if in_place else FORWARD_JITS
    ok = True
    r = cfg.max_verify
    for rows, n_new in ((2 * r, [2 * r, r + 1]), (r, [1, r]), (r, [r - 1, 0]), (r, [1, 1]),
                        (1, [1, 1])):
        tokens = jnp.asarray(rng.integers(0, vocab, (b, rows)), jnp.int32)
        n = jnp.asarray(n_new[:b] + [1] * (b - len(n_new)), jnp.int32)
        a = scanned(mcfg, stacked, ms, tokens, n)
        u = unrolled(mcfg, weights, states, tokens, n)
        ms, states = a[1], u[1]
        ok &= bits_equal((a[0], a[2]), (u[0], u[2]))
        ok &= bits_equal(unfold_state(mcfg, ms), list(states))
    return bool(ok)


def prompts(cfg, b: int, vocab: int, seed: int) -> list[list[int]]:
    """`b` prompts past the selection's width (so the top-k picks among the pools), each a
    repeated motif (the n-gram drafter finds matches)."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, vocab, (b, 5))
    return [np.resize(m, cfg.sel_width + int(rng.integers(9, 40))).tolist() for m in motif]


def loop_checks(cfg, vocab: int, modes=("greedy", "sample"), in_place: bool = True) -> dict:
    """Per sampling mode (greedy, top-p): the device loop == the per-step Python loop, and
    speculative tokens (3 drafts: the n-gram drafter, and the target as its own draft model)
    == plain tokens. in_place: every Program's `weights_in_place` (True: the default)."""
    mcfg, _, stacked = model(cfg, vocab, 2)
    batch = prompts(cfg, 3, vocab, 3)
    limits = [23, 9, 30]
    out = {}
    for name in modes:
        sampling = Sampling() if name == "greedy" else SAMPLED
        plain = serve.Program(mcfg, sampling, weights_in_place=in_place)
        want = serve.generate(plain, stacked, None, batch, limits, tokens_per_dispatch=8)
        sv, first = serve.start(plain, stacked, None, batch, limits)
        sv, outs, _ = serve.run_python(plain, stacked, None, sv, 64)
        py = [[int(f)] + t for f, t in zip(np.asarray(first), serve.emitted_tokens(outs),
                                          strict=True)]
        out[f"device_loop_equals_python_loop[{name}]"] = want == py
        out[f"tokens_are_the_limits[{name}]"] = [len(t) for t in want] == limits
        spec = serve.Program(mcfg, sampling, speculate=3, weights_in_place=in_place)
        got = serve.generate(spec, stacked, None, batch, limits, tokens_per_dispatch=8)
        out[f"speculative_equals_plain[ngram,{name}]"] = got == want
        drafted = serve.Program(mcfg, sampling, speculate=3, drafter=ModelDrafter(mcfg),
                                weights_in_place=in_place)
        got = serve.generate(drafted, stacked, stacked, batch, limits, tokens_per_dispatch=8)
        out[f"speculative_equals_plain[draft_model,{name}]"] = got == want
    return out


def scripted_speculation(cfg, vocab: int, n: int, acceptance: float = 0.7, k: int = 3,
                         stacked=None) -> dict:
    """One sequence on random caches filled almost to max_context: `n` tokens plain, then
    speculating with 3 drafts a round from a drafter that knows the plain tokens and proposes
    the right one with probability `acceptance`, from the same state. The tokens (and how many
    drafts were kept: some, not all). stacked: the model's weights (default: random ones)."""
    mcfg = ModelConfig(cfg, vocab_size=vocab)
    stacked = model(cfg, vocab)[2] if stacked is None else stacked
    plain = serve.Program(mcfg)
    base = random_serving(plain, 1, cfg.max_context - 2 - 2 * n - k, jax.random.key(7))
    base = base._replace(slots=base.slots._replace(limit=jnp.full((1,), n, jnp.int32)))
    _, outs, _ = serve.run(plain, stacked, None, copy_tree(base), n)
    want = serve.emitted_tokens(jax.device_get(outs))[0]
    right = np.zeros((1, cfg.max_context), np.int32)
    first = int(base.model.lengths[0]) + 1
    right[0, first:first + len(want)] = want
    spec = serve.Program(mcfg, speculate=k, drafter=ScriptedDrafter(vocab, acceptance))
    _, outs, _ = serve.run(spec, stacked, None, base._replace(draft=jnp.asarray(right)), n)
    outs = jax.device_get(outs)
    kept = int((np.maximum(outs.count - 1, 0) * (outs.drafted > 0)).sum())
    return {"plain": want, "speculative": serve.emitted_tokens(outs)[0], "kept": kept,
            "drafted": int(outs.drafted.sum())}


def written_rows(cfg, vocab: int, b: int, seed: int = 21) -> dict:
    """One decode-shaped forward of the scanned model and of the unrolled stack on the same
    random caches, every sequence near the end of its context: per layer, how many of the `b`
    new tokens' latent rows the two wrote differently in more than half their columns (a few
    bits apart never reach half a row; a row written to the wrong place, e.g. an address past
    2**31 bytes of the stacked pool computed in 32 bits, does), and the stacked pool's bytes."""
    mcfg, weights, stacked = model(cfg, vocab, seed)
    ms = random_serving(serve.Program(mcfg), b, cfg.max_context - 8, jax.random.key(seed)).model
    states = tuple(unfold_state(mcfg, ms))
    pos = np.asarray(ms.lengths)  # [B] where the new token goes
    tables = np.asarray(ms.block_tables)
    slots = tables[np.arange(b), pos // cfg.block_size], pos % cfg.block_size  # [B] each
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, cfg.max_verify)),
                         jnp.int32)
    one = jnp.ones((b,), jnp.int32)
    scanned, unrolled = FORWARD_JITS
    pool_bytes = int(ms.latent.size * ms.latent.dtype.itemsize)
    _, ms2, _ = scanned(mcfg, stacked, ms, tokens, one)
    _, st2, _ = unrolled(mcfg, weights, states, tokens, one)
    far = []
    for layer in range(len(cfg.indexer_types)):
        a = np.asarray(ms2.latent[layer][slots]).astype(np.float32)  # [B, C]
        u = np.asarray(st2[layer].latent[slots]).astype(np.float32)
        far.append(int(((a != u).mean(axis=1) > 0.5).sum()))
    return {"pool_bytes": pool_bytes, "rows_far_apart_per_layer": far}
