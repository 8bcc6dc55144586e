"""The serving loop on the device: N tokens (or N speculative rounds) per dispatch.

`Serving` is the whole loop state, one pytree: the model's caches, per-sequence slots (the
newest token, the token history, counts, limits, done flags, PRNG keys) and the drafter's
state. `iteration` advances every live sequence by one decode step or one speculative round:
drafter proposals, the verify, sampling, acceptance, the rewind of the rejected rows, stop on
an end token or a length. `run` repeats it up to `n` times in one
`lax.while_loop` (it stops early once every sequence is done), so the host is touched once
per `n` iterations; `run_python` is the same iteration dispatched once per step, the
reference the device loop equals bit for bit.

A row's logits never depend on how many rows its forward runs: under the row-invariant GEMMs
(`implementation.row_gemms`) each forward runs only the rows it can fill (`loop_rows`: a plain
step 1 per sequence, a speculative round 1 + k), whose kernels give a row the same bits at any
row count; with XLA's GEMMs every forward runs `max_verify` rows (a decode's one real row
padded). Either way a plain decode, a verify row and the same row of the Python loop are
bit-identical, and speculation never changes the tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_jax.bitwise import bitwise_jit
from dsa_jax.drafting import NgramDrafter
from dsa_jax.errors import ServeError
from dsa_jax.model import (
    ModelConfig,
    ModelState,
    StackedWeights,
    forward,
    init_model_state,
    step_rows,
)
from dsa_jax.sampling import Sampling, sample_tokens


class Slots(NamedTuple):
    """Per-sequence loop state (B slots)."""
    last: jax.Array  # [B] int32: the newest token (input of the next step, not yet cached)
    history: jax.Array  # [B, T] int32: every known token, prompt first (drafters read it)
    count: jax.Array  # [B] int32: tokens generated so far
    limit: jax.Array  # [B] int32: tokens to generate
    done: jax.Array  # [B] bool: finished, or an idle slot
    keys: jax.Array  # [B] PRNG keys: token at position p is drawn with fold_in(key, p)


class Serving(NamedTuple):
    model: ModelState
    slots: Slots
    draft: Any  # the drafter's state (None for the n-gram drafter)


class Emitted(NamedTuple):
    """One iteration's output per sequence."""
    tokens: jax.Array  # [B, R] int32: the first `count` are new tokens
    count: jax.Array  # [B] int32: tokens emitted (0 for a done sequence)
    drafted: jax.Array  # [B] int32: drafts proposed
    sel: jax.Array | None  # [B, R, W] int32: first layer's selection of each row (if recorded)


# XLA options of the programs of a `Program(weights_in_place=True)`: each scanned layer's GEMMs
# read that layer's slice of the stacked weights in place (dynamic-slice fusion, which serves
# cuBLAS GEMMs, so XLA's Triton GEMMs are off) instead of a copy of it per layer and token.
# Autotuning off: each GEMM takes cuBLAS's heuristic algorithm for its shape, the same in every
# program and every compile (timed autotuning picks by measured speed, so two programs, or two
# compiles of one, may sum in other orders).
IN_PLACE_WEIGHTS = {"xla_gpu_enable_dynamic_slice_fusion": True,
                    "xla_gpu_enable_triton_gemm": False,
                    "xla_gpu_autotune_level": 0}


@dataclasses.dataclass(frozen=True)
class Program:
    """What one iteration does (static: part of the compiled program).

    weights_in_place: compile every program of this `Program` (the loop, the per-step
    reference, prefill) with `IN_PLACE_WEIGHTS` (the default): on the H200 1.7x faster per
    token at one sequence, 1.2x at 64, with every guarantee between this Program's own programs
    checked there (scanned == unrolled at GLM-5.3 shapes, device loop == Python loop,
    speculative == plain). False: XLA's own GEMM choice, the stacked weights copied per layer;
    other bits (docs/serving.md).

    batch_invariant: the model's blocks run with `DsaConfig.batch_invariant` (default True,
    whatever `mcfg.dsa` says): a sequence's tokens do not depend on the other sequences of
    its batch. False: each step's attend planned for its own row count (docs/decisions.md)."""
    mcfg: ModelConfig
    sampling: Sampling = Sampling()
    stop_tokens: tuple[int, ...] = ()
    speculate: int = 0  # drafts per round; 0: plain decode
    drafter: Any = NgramDrafter()
    record: bool = False  # return the first layer's selections
    weights_in_place: bool = True
    batch_invariant: bool = True

    def __post_init__(self):
        object.__setattr__(self, "mcfg", with_batch_invariance(self.mcfg,
                                                               self.batch_invariant))


def with_batch_invariance(mcfg: ModelConfig, on: bool) -> ModelConfig:
    """`mcfg` with its block's `batch_invariant` set to `on` (the same object if it is)."""
    if mcfg.dsa.batch_invariant == on:
        return mcfg
    return dataclasses.replace(mcfg, dsa=mcfg.dsa.replace(batch_invariant=on))


def _jits(fn, **kwargs) -> dict[bool, Any]:
    """`fn` jitted twice: the default programs and the `weights_in_place` ones."""
    return {False: bitwise_jit(fn, **kwargs),
            True: bitwise_jit(fn, compiler_options=IN_PLACE_WEIGHTS, **kwargs)}


def init_slots(mcfg: ModelConfig, num_seqs: int) -> Slots:
    """Every slot idle (done)."""
    return Slots(last=jnp.zeros((num_seqs,), jnp.int32),
                 history=jnp.zeros((num_seqs, mcfg.dsa.max_context), jnp.int32),
                 count=jnp.zeros((num_seqs,), jnp.int32),
                 limit=jnp.zeros((num_seqs,), jnp.int32),
                 done=jnp.ones((num_seqs,), bool),
                 keys=jax.random.split(jax.random.key(0), num_seqs))


def _is_stop(prog: Program, tokens: jax.Array) -> jax.Array:
    if not prog.stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(prog.stop_tokens, jnp.int32))


def iteration(prog: Program, weights: StackedWeights, dweights, sv: Serving
              ) -> tuple[Serving, Emitted]:
    """One decode step (or speculative round) of every live sequence; pure and traceable."""
    r, k = loop_rows(prog), prog.speculate
    ms, sl, ds = sv
    b = sl.last.shape[0]
    active = ~sl.done  # [B]
    lengths = ms.lengths  # [B] the newest token's position
    room = sl.limit - sl.count  # [B] tokens still to generate (>= 1 when active)
    rows = jnp.zeros((b, r), jnp.int32).at[:, 0].set(sl.last)  # [B, R]
    drafted = jnp.zeros((b,), jnp.int32)
    if k:
        max_draft = jnp.where(active, jnp.clip(room - 1, 0, k), 0)
        drafts, drafted, ds = prog.drafter.propose(dweights, ds, sl.history, lengths, k,
                                                   max_draft)
        rows = rows.at[:, 1:k + 1].set(drafts)
    n_new = jnp.where(active, 1 + drafted, 0)  # [B]
    # n_new <= 1 + k: the padded rows past the drafts are never attended
    logits, ms, sel = forward(prog.mcfg, weights, ms, rows, n_new,
                              attend_rows=1 + k)  # [B, R, V]
    at = lengths[:, None] + 1 + jnp.arange(r)  # [B, R] where each row's token goes
    target = sample_tokens(prog.sampling, logits, sl.keys, at)  # [B, R]
    accepted = jnp.zeros((b,), jnp.int32)
    if k:
        agree = (rows[:, 1:k + 1] == target[:, :k]) & (jnp.arange(k) < drafted[:, None])
        accepted = jnp.sum(jnp.cumprod(agree, axis=1), axis=1).astype(jnp.int32)
    # Emit target[0 .. accepted], cut after the first stop token and at the limit.
    stop = _is_stop(prog, target) & (jnp.arange(r) <= accepted[:, None])  # [B, R]
    first_stop = jnp.where(stop.any(axis=1), jnp.argmax(stop, axis=1), r)
    count = jnp.where(active, jnp.minimum(jnp.minimum(accepted + 1, first_stop + 1), room), 0)
    emit = jnp.arange(r) < count[:, None]  # [B, R]
    seq = jnp.arange(b)[:, None]
    history = sl.history.at[seq, jnp.where(emit, at, sl.history.shape[1])].set(
        target, mode="drop")
    new_lengths = lengths + count  # the rejected rows are rewound
    generated = sl.count + count
    newest = jnp.take_along_axis(target, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    done = sl.done | (active & ((first_stop < count) | (generated >= sl.limit)))
    if k:
        ds = prog.drafter.commit(ds, lengths, accepted, new_lengths)
    sl = sl._replace(last=jnp.where(count > 0, newest, sl.last), history=history,
                     count=generated, done=done)
    out = Emitted(jnp.where(emit, target, 0), count, drafted,
                  jnp.where(emit[..., None], sel, -1) if prog.record else None)
    return Serving(ms._replace(lengths=new_lengths), sl, ds), out


def loop_rows(prog: Program) -> int:
    """Rows per sequence of each iteration's forward (`model.step_rows`): 1 + speculate under
    the row-invariant GEMMs, else max_verify."""
    return step_rows(prog.mcfg.dsa, 1 + prog.speculate)


def _empty_outputs(prog: Program, b: int, n: int) -> Emitted:
    cfg, r = prog.mcfg.dsa, loop_rows(prog)
    return Emitted(jnp.zeros((n, b, r), jnp.int32), jnp.zeros((n, b), jnp.int32),
                   jnp.zeros((n, b), jnp.int32),
                   jnp.full((n, b, r, cfg.sel_width), -1, jnp.int32) if prog.record else None)


def run(prog: Program, weights: StackedWeights, dweights, sv: Serving, n: int
        ) -> tuple[Serving, Emitted, jax.Array]:
    """Up to `n` iterations in one program (fewer once every sequence is done; one dispatch,
    the state donated).

    Returns the state, the outputs stacked `[n, ...]` (iterations not run emit nothing) and
    the number of iterations run."""
    return run_jit(prog)(prog, weights, dweights, sv, n)


def run_jit(prog: Program):
    """The jitted `run` that serves `prog` (its compiler options): `.lower(prog, weights,
    dweights, sv, n)` to compile it ahead."""
    return _RUN[bool(prog.weights_in_place)]


def _run(prog: Program, weights: StackedWeights, dweights, sv: Serving, n: int):
    def cond(carry):
        i, sv, _ = carry
        return (i < n) & jnp.any(~sv.slots.done)

    def body(carry):
        i, sv, outs = carry
        sv, out = iteration(prog, weights, dweights, sv)
        outs = jax.tree.map(lambda buf, o: buf.at[i].set(o), outs, out)
        return i + 1, sv, outs

    init = (jnp.int32(0), sv, _empty_outputs(prog, sv.slots.last.shape[0], n))
    i, sv, outs = lax.while_loop(cond, body, init)
    return sv, outs, i


_RUN = _jits(_run, static_argnames=("prog", "n"), donate_argnames=("sv",))
_ITERATION = _jits(iteration, static_argnames=("prog",), donate_argnames=("sv",))


def run_python(prog: Program, weights: StackedWeights, dweights, sv: Serving, n: int
               ) -> tuple[Serving, Emitted, int]:
    """`run` with one dispatch per iteration and the stop test on the host (the reference)."""
    outs = []
    for _ in range(n):
        if bool(jnp.all(sv.slots.done)):
            break
        sv, out = _ITERATION[bool(prog.weights_in_place)](prog, weights, dweights, sv)
        outs.append(out)
    stacked = _empty_outputs(prog, sv.slots.last.shape[0], n)
    if outs:
        got = jax.tree.map(lambda *o: jnp.stack(o), *outs)
        stacked = jax.tree.map(lambda buf, g: buf.at[:len(outs)].set(g), stacked, got)
    return sv, stacked, len(outs)


def prefill(prog: Program, weights: StackedWeights, dweights, sv: Serving, tokens: jax.Array,
            n_new: jax.Array, finishing: jax.Array) -> tuple[Serving, jax.Array]:
    """A chunk of prompt rows `tokens [B, S]` (first `n_new [B]` real); for the slots whose
    prompt ends in this chunk (`finishing [B]` bool) the first token is chosen and the slot
    goes live. Returns the state and the first tokens `[B]` (meaningful where finishing)."""
    ms, sl, ds = sv
    b, s = tokens.shape
    lengths = ms.lengths
    logits, ms, _ = forward(prog.mcfg, weights, ms, tokens, n_new)  # [B, S, V]
    if prog.speculate:
        ds = prog.drafter.prefill(dweights, ds, tokens, n_new)
    seq = jnp.arange(b)[:, None]
    at = lengths[:, None] + jnp.arange(s)  # [B, S]
    real = jnp.arange(s)[None, :] < n_new[:, None]
    history = sl.history.at[seq, jnp.where(real, at, sl.history.shape[1])].set(
        tokens, mode="drop")
    last_row = jnp.maximum(n_new - 1, 0)[:, None]  # [B, 1]
    pos = lengths[:, None] + n_new[:, None]  # [B, 1] the first generated token's position
    first = sample_tokens(prog.sampling, jnp.take_along_axis(logits, last_row[..., None],
                                                             axis=1), sl.keys, pos)[:, 0]
    history = history.at[jnp.arange(b), jnp.where(finishing, pos[:, 0], history.shape[1])].set(
        first, mode="drop")
    done = jnp.where(finishing, _is_stop(prog, first) | (sl.limit <= 1), sl.done)
    sl = sl._replace(last=jnp.where(finishing, first, sl.last), history=history,
                     count=jnp.where(finishing, 1, sl.count), done=done)
    return Serving(ms, sl, ds), first


_PREFILL = _jits(prefill, static_argnames=("prog",), donate_argnames=("sv",))


def _with_drafter_state(prog: Program) -> Program:
    """The part of `prog` that admission and prefill depend on (so programs that differ only
    in draft count, recording or a stateless drafter share their compiled prefill)."""
    stateful = prog.speculate > 0 and not isinstance(prog.drafter, NgramDrafter)
    return dataclasses.replace(prog, speculate=int(stateful), record=False,
                               drafter=prog.drafter if stateful else NgramDrafter())


def prefill_jit(prog: Program, weights: StackedWeights, dweights, sv: Serving,
                tokens: jax.Array, n_new: jax.Array, finishing: jax.Array
                ) -> tuple[Serving, jax.Array]:
    """`prefill` in one dispatch (the state is donated)."""
    return _PREFILL[bool(prog.weights_in_place)](_with_drafter_state(prog), weights, dweights,
                                                 sv, tokens, n_new, finishing)


def admit(prog: Program, sv: Serving, mask: jax.Array, block_tables: jax.Array,
          limit: jax.Array, keys: jax.Array) -> Serving:
    """Reset the slots in `mask [B]` for new sequences: empty caches (lengths 0), the given
    block-table rows `[B, MB]`, token limits `[B]` and keys `[B]`; done until their prefill
    ends. One dispatch (the state is donated)."""
    key = dataclasses.replace(_with_drafter_state(prog), sampling=Sampling(), stop_tokens=(),
                              weights_in_place=False)  # no weights in it
    return _admit(key, sv, mask, block_tables, limit, keys)


@functools.partial(bitwise_jit, static_argnames=("prog",), donate_argnames=("sv",))
def _admit(prog: Program, sv: Serving, mask: jax.Array, block_tables: jax.Array,
           limit: jax.Array, keys: jax.Array) -> Serving:
    ms, sl, ds = sv
    ms = ms._replace(block_tables=jnp.where(mask[:, None], block_tables, ms.block_tables),
                     lengths=jnp.where(mask, 0, ms.lengths))
    sl = Slots(last=jnp.where(mask, 0, sl.last),
               history=jnp.where(mask[:, None], 0, sl.history),
               count=jnp.where(mask, 0, sl.count), limit=jnp.where(mask, limit, sl.limit),
               done=sl.done | mask,
               keys=jnp.where(mask, keys, sl.keys))
    if prog.speculate:
        ds = prog.drafter.admit(ds, mask, block_tables)
    return Serving(ms, sl, ds)


# ------------------------------------------------------------------------------ a fixed batch


def _is_token_id(t) -> bool:
    """An integer (Python, numpy or a 0-d integer array), never a bool or a float."""
    if isinstance(t, (bool, np.bool_)):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def check_batch(prog: Program, prompts, max_new_tokens) -> None:
    """Every prompt non-empty and in the vocabulary, and prompt + new tokens + drafts within
    `max_context`."""
    cfg, vocab = prog.mcfg.dsa, prog.mcfg.vocab_size
    if len(prompts) != len(max_new_tokens):
        raise ServeError(f"{len(prompts)} prompts but {len(max_new_tokens)} token limits")
    for i, (p, m) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        if len(p) == 0:
            raise ServeError(f"prompt {i} is empty; a prompt needs at least one token")
        if m < 1:
            raise ServeError(f"max_new_tokens[{i}] is {m}; it must be at least 1")
        need = len(p) + m + prog.speculate
        if need > cfg.max_context:
            raise ServeError(f"prompt {i}: {len(p)} tokens + {m} new tokens (+ "
                             f"{prog.speculate} draft rows) = {need} exceeds max_context "
                             f"{cfg.max_context}")
        odd = [t for t in p if not _is_token_id(t)]
        if odd:
            raise ServeError(f"prompt {i}: token ids must be integers, got {odd[:5]}")
        bad = [int(t) for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ServeError(f"prompt {i}: token ids {bad[:5]} outside the vocabulary "
                             f"[0, {vocab})")


def start(prog: Program, weights: StackedWeights, dweights, prompts, max_new_tokens, *,
          seed: int = 0, chunk: int | None = None) -> tuple[Serving, jax.Array]:
    """A serving state for a fixed batch: every prompt prefilled (chunks of `chunk` rows, by
    default the longest prompt), its first token chosen. Sequence i's sampling key is
    `fold_in(key(seed), i)`. Returns the state and the first tokens `[B]` (on the device)."""
    check_batch(prog, prompts, max_new_tokens)
    cfg = prog.mcfg.dsa
    b, mb = len(prompts), cfg.blocks_per_seq
    longest = max(len(p) for p in prompts)
    chunk = longest if chunk is None else chunk
    tables = jnp.arange(b * mb, dtype=jnp.int32).reshape(b, mb)
    sv = Serving(init_model_state(prog.mcfg, b, b * mb), init_slots(prog.mcfg, b),
                 prog.drafter.init_state(b, b * mb) if prog.speculate else None)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.arange(b))
    sv = admit(prog, sv, jnp.ones((b,), bool), tables,
               jnp.asarray(max_new_tokens, jnp.int32), keys)
    first = jnp.zeros((b,), jnp.int32)
    lens = jnp.asarray([len(p) for p in prompts])
    for lo in range(0, longest, chunk):
        rows = [list(p[lo:lo + chunk]) + [0] * (chunk - len(p[lo:lo + chunk])) for p in prompts]
        n_new = jnp.clip(lens - lo, 0, chunk).astype(jnp.int32)
        finishing = (lens > lo) & (lens <= lo + chunk)
        sv, got = prefill_jit(prog, weights, dweights, sv, jnp.asarray(rows, jnp.int32), n_new,
                              finishing)
        first = jnp.where(finishing, got, first)
    return sv, first


def emitted_tokens(outs: Emitted) -> list[list[int]]:
    """A dispatch's outputs (host arrays) -> each sequence's new tokens, in order."""
    tokens, count = np.asarray(outs.tokens), np.asarray(outs.count)  # [N, B, R], [N, B]
    mask = np.arange(tokens.shape[-1]) < count[..., None]
    return [tokens[:, b][mask[:, b]].tolist() for b in range(tokens.shape[1])]


def generate(prog: Program, weights: StackedWeights, dweights, prompts, max_new_tokens, *,
             seed: int = 0, tokens_per_dispatch: int = 32) -> list[list[int]]:
    """Each prompt's generated tokens (first token included): `start`, then `run` until every
    sequence is done, `tokens_per_dispatch` steps per dispatch, one host read each."""
    sv, first = start(prog, weights, dweights, prompts, max_new_tokens, seed=seed)
    out = [[int(t)] for t in np.asarray(first)]
    done = False
    while not done:
        sv, outs, _ = run(prog, weights, dweights, sv, tokens_per_dispatch)
        outs, done = jax.device_get((outs, jnp.all(sv.slots.done)))  # the one host read
        for seq, new in zip(out, emitted_tokens(outs), strict=True):
            seq.extend(new)
    return out
