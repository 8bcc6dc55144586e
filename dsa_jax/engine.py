"""A serving loop over a small causal model built of DSA blocks (`dsa_jax.model`).

The engine keeps up to `max_seqs` sequences at once in fixed slots, hands out physical
latent blocks from a free list, admits a request when a slot and its blocks are free, and
runs the device loop of `dsa_jax.serve`: each `step` prefills the newly admitted prompts (one
dispatch per chunk of `prefill_chunk` rows, every new sequence at once), then runs up to
`tokens_per_dispatch` decode steps (or speculative rounds) of every live sequence in one
dispatch, and reads their tokens back once. Sampling (greedy, or temperature/top-p with a
key per request), stop tokens, length limits, the drafter's proposals, the verify and the
rewind of rejected drafts all happen on the device.

Each row's logits are bit-identical whether it is a plain decode or a verify row (each forward
runs the rows it fills under the row-invariant GEMMs, `max_verify` padded rows with XLA's:
`serve.loop_rows`), so speculation never changes the tokens; a sampled token depends only on
its logits, its request's key and its position.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import serve
from dsa_jax.drafting import ModelDrafter, NgramDrafter
from dsa_jax.errors import EngineError, OutOfBlocks
from dsa_jax.model import (
    ModelConfig,
    ModelWeights,
    StackedWeights,
    fold_states,
    init_model,
    init_model_state,
    stack_weights,
    unfold_state,
)
from dsa_jax.prompt_chunk import largest_chunk
from dsa_jax.sampling import Sampling, SamplingError, check_stop_tokens

__all__ = ["BlockAllocator", "Engine", "EngineError", "EngineStats", "ModelConfig",
           "ModelWeights", "OutOfBlocks", "Request", "init_model", "ngram_draft"]


class BlockAllocator:
    """A free list of physical latent blocks. A block belongs to at most one sequence."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._owner: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, owner: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks wanted, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for blk in blocks:
            if blk in self._owner:  # a broken free list: never hand one block out twice
                raise EngineError(f"block {blk} handed out twice (owned by sequence "
                                  f"{self._owner[blk]}, asked for by {owner})")
            self._owner[blk] = owner
        return blocks

    def release(self, blocks: list[int]) -> None:
        for blk in blocks:
            if self._owner.pop(blk, None) is None:
                raise EngineError(f"block {blk} released but not allocated")
            self._free.append(blk)

    def owners(self) -> dict[int, int]:
        return dict(self._owner)

    def check_invariants(self) -> None:
        """EngineError unless every block is either free (once) or owned (once), never both."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise EngineError("the free list holds a block twice")
        both = set(free) & set(self._owner)
        if both:
            raise EngineError(f"blocks {sorted(both)[:5]} are free and owned at once")
        if set(free) | set(self._owner) != set(range(self.num_blocks)):
            lost = set(range(self.num_blocks)) - set(free) - set(self._owner)
            raise EngineError(f"blocks {sorted(lost)[:5]} are neither free nor owned (lost)")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_prompt(prompt, vocab_size: int) -> list[int]:
    """`prompt` as a list of Python ints, or EngineError naming the first bad entry: a list,
    tuple or 1-D integer array of ids in `[0, vocab_size)`, at least one."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise EngineError(f"prompt must be 1-D token ids, got an array of shape "
                              f"{prompt.shape}")
        prompt = prompt.tolist() if np.issubdtype(prompt.dtype, np.integer) else list(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise EngineError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise EngineError("a prompt needs at least one token")
    for i, t in enumerate(prompt):
        if not _is_int(t):
            raise EngineError(f"prompt[{i}] is {t!r}, not an integer token id")
        if not 0 <= t < vocab_size:
            raise EngineError(f"prompt[{i}] is {t}, outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in prompt]


def ngram_draft(history: list[int], max_draft: int, n: int = 2) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the last `n` (then 1) tokens.
    The host twin of `dsa_jax.drafting.ngram_propose` (which the engine runs)."""
    for size in range(min(n, len(history) - 1), 0, -1):
        tail = history[-size:]
        for start in range(len(history) - size - 1, -1, -1):
            if history[start:start + size] == tail:
                follow = history[start + size:start + size + max_draft]
                if follow:
                    return follow
    return []


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    blocks: list[int] = dataclasses.field(default_factory=list)
    selections: list[np.ndarray] = dataclasses.field(default_factory=list)  # layer-0 sel rows
    id: int = -1  # admission order (= submission order); its sampling key derives from it


@dataclasses.dataclass
class EngineStats:
    steps: int = 0  # model forwards of the decode loop (each: every live sequence)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    dispatches: int = 0  # decode-loop dispatches (each up to tokens_per_dispatch steps)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Engine:
    """Generation for many sequences; `speculate` drafts up to max_verify - 1 tokens a round.

    weights: `ModelWeights` (stacked here) or `StackedWeights`. sampling: `Sampling()`
    (greedy) by default; sampled tokens use `fold_in(key(seed), request id)` per request.
    stop_tokens: ids that end a sequence (emitted, then the sequence stops). drafter: the
    n-gram drafter by default, or `ModelDrafter(draft_mcfg)` with `draft_weights`.
    weights_in_place: `serve.Program.weights_in_place` (default True: faster on a GPU).
    batch_invariant: `serve.Program.batch_invariant` (default True: a request's tokens are the
    same whatever other requests share its steps).
    """

    def __init__(self, mcfg: ModelConfig, weights: ModelWeights | StackedWeights, *,
                 max_seqs: int, num_blocks: int, speculate: int = 0, prefill_chunk: int = 32,
                 record_selections: bool = False, tokens_per_dispatch: int = 8,
                 sampling: Sampling | None = None, stop_tokens=(), seed: int = 0,
                 drafter=None, draft_weights: ModelWeights | StackedWeights | None = None,
                 weights_in_place: bool = True, batch_invariant: bool = True):
        if not isinstance(batch_invariant, bool):
            raise EngineError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        mcfg = serve.with_batch_invariance(mcfg, batch_invariant)
        cfg = mcfg.dsa
        for name, value in (("max_seqs", max_seqs), ("num_blocks", num_blocks),
                            ("prefill_chunk", prefill_chunk),
                            ("tokens_per_dispatch", tokens_per_dispatch)):
            if not _is_int(value) or value < 1:
                raise EngineError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(weights_in_place, bool):
            raise EngineError(f"weights_in_place must be a bool, got {weights_in_place!r}")
        if not _is_int(speculate):
            raise EngineError(f"speculate must be an integer, got {speculate!r}")
        if not 0 <= speculate <= cfg.max_verify - 1:
            raise EngineError(f"speculate={speculate} drafts need {speculate + 1} verify rows; "
                              f"max_verify is {cfg.max_verify}, so at most "
                              f"{cfg.max_verify - 1} drafts")
        sampling = Sampling() if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise EngineError(f"sampling must be a dsa_jax.sampling.Sampling, got "
                              f"{type(sampling).__name__}")
        try:
            stop_tokens = check_stop_tokens(stop_tokens, mcfg.vocab_size)
        except SamplingError as err:
            raise EngineError(str(err)) from None
        drafter = NgramDrafter() if drafter is None else drafter
        if isinstance(drafter, ModelDrafter):
            _check_draft_model(mcfg, drafter.mcfg, draft_weights)
            if isinstance(draft_weights, ModelWeights):
                draft_weights = stack_weights(drafter.mcfg, draft_weights)
        if isinstance(weights, ModelWeights):
            weights = stack_weights(mcfg, weights)
        self.mcfg, self.weights, self.speculate = mcfg, weights, speculate
        self.draft_weights = draft_weights
        # Prompt rows per prefill dispatch: the asked chunk, cut where the max_seqs x chunk
        # rows would pass the kernels' 32-bit addressing (`dsa_jax.prompt_chunk`).
        self.prefill_chunk = largest_chunk(cfg, max_seqs, num_blocks, prefill_chunk)
        self.tokens_per_dispatch = tokens_per_dispatch
        self.seed = seed
        self.program = serve.Program(mcfg, sampling, stop_tokens, speculate, drafter,
                                     record_selections, weights_in_place, batch_invariant)
        self.allocator = BlockAllocator(num_blocks)
        self.serving = serve.Serving(init_model_state(mcfg, max_seqs, num_blocks),
                                     serve.init_slots(mcfg, max_seqs),
                                     drafter.init_state(max_seqs, num_blocks))
        self.lengths = np.zeros(max_seqs, np.int32)  # host copy of the cached lengths
        self.slots: list[Request | None] = [None] * max_seqs
        self.queue: deque[Request] = deque()
        self.finished: list[Request] = []
        self.stats = EngineStats()
        self.record_selections = record_selections
        self._next_id = 0

    @property
    def sampling(self) -> Sampling:
        return self.program.sampling

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        return self.program.stop_tokens

    # Admission and release -------------------------------------------------------------
    def submit(self, prompt: list[int], max_new_tokens: int) -> Request:
        """Queue a request: `prompt` token ids (a list, tuple or 1-D integer array) and how many
        tokens to generate (>= 1). Everything is checked here, before it is queued."""
        cfg = self.mcfg.dsa
        prompt = check_prompt(prompt, self.mcfg.vocab_size)
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be a positive integer, got "
                              f"{max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        need = len(prompt) + max_new_tokens + self.speculate
        if need > cfg.max_context:
            raise EngineError(f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens "
                              f"(+ {self.speculate} draft rows) = {need} exceeds max_context "
                              f"{cfg.max_context}")
        if self._blocks_for(need) > self.allocator.num_blocks:
            raise EngineError(f"a request of {need} tokens needs {self._blocks_for(need)} "
                              f"blocks; the pool has {self.allocator.num_blocks}")
        req = Request(prompt, max_new_tokens)
        self.queue.append(req)
        return req

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.mcfg.dsa.block_size)

    def _admit(self) -> list[Request]:
        """Move queued requests into free slots while their blocks are free (FIFO), and reset
        those slots on the device (one dispatch)."""
        admitted = []
        while self.queue and None in self.slots:
            req = self.queue[0]
            need = self._blocks_for(len(req.prompt) + req.max_new_tokens + self.speculate)
            if need > self.allocator.num_free:
                break  # back-pressure: wait for a sequence to finish
            self.queue.popleft()
            req.slot = self.slots.index(None)
            req.blocks = self.allocator.allocate(need, owner=req.slot)
            req.id, self._next_id = self._next_id, self._next_id + 1
            self.slots[req.slot] = req
            admitted.append(req)
        if admitted:
            b = len(self.slots)
            mask = np.zeros(b, bool)
            tables = np.full((b, self.mcfg.dsa.blocks_per_seq), -1, np.int32)
            limit, ids = np.zeros(b, np.int32), np.zeros(b, np.int32)
            for req in admitted:
                mask[req.slot] = True
                tables[req.slot, :len(req.blocks)] = req.blocks
                limit[req.slot], ids[req.slot] = req.max_new_tokens, req.id
                self.lengths[req.slot] = 0
            self.serving = serve.admit(self.program, self.serving, jnp.asarray(mask),
                                       jnp.asarray(tables), jnp.asarray(limit),
                                       self._keys(ids))
        return admitted

    def _keys(self, ids: np.ndarray) -> jax.Array:
        return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(self.seed),
                                                       jnp.asarray(ids, jnp.int32))

    def _release(self, req: Request) -> None:
        self.allocator.release(req.blocks)
        self.slots[req.slot] = None
        self.lengths[req.slot] = 0
        self.finished.append(req)

    # Steps -----------------------------------------------------------------------------
    def _prefill(self, admitted: list[Request]) -> list[tuple[jax.Array, np.ndarray]]:
        """Prompts of the newly admitted, in chunks of `prefill_chunk` rows (one compiled
        shape, one dispatch per chunk). Returns each chunk's first tokens (on the device)
        and which slots they belong to."""
        width, b = self.prefill_chunk, len(self.slots)
        firsts = []
        for lo in range(0, max(len(r.prompt) for r in admitted), width):
            tokens = np.zeros((b, width), np.int32)
            n_new, finishing = np.zeros(b, np.int32), np.zeros(b, bool)
            for req in admitted:
                chunk = req.prompt[lo:lo + width]
                tokens[req.slot, :len(chunk)] = chunk
                n_new[req.slot] = len(chunk)
                finishing[req.slot] = lo < len(req.prompt) <= lo + width
            self.serving, first = serve.prefill_jit(
                self.program, self.weights, self.draft_weights, self.serving,
                jnp.asarray(tokens), jnp.asarray(n_new), jnp.asarray(finishing))
            self.lengths += n_new
            firsts.append((first, finishing))
        return firsts

    def step(self) -> None:
        """Admit and prefill, then up to `tokens_per_dispatch` decode steps (or speculative
        rounds) of every live sequence in one dispatch; one read of the results."""
        admitted = self._admit()
        firsts = self._prefill(admitted) if admitted else []
        run = None
        if any(r is not None for r in self.slots):
            self.serving, outs, iters = serve.run(self.program, self.weights,
                                                  self.draft_weights, self.serving,
                                                  self.tokens_per_dispatch)
            run = (outs, iters)
            self.stats.dispatches += 1
        firsts, run, lengths, done = jax.device_get(
            (firsts, run, self.serving.model.lengths, self.serving.slots.done))
        for first, finishing in firsts:
            for s in np.flatnonzero(finishing):
                self.slots[s].output.append(int(first[s]))
                self.stats.tokens += 1
        if run is not None:
            self._take(*run)
        self.lengths = np.array(lengths, np.int32)
        for req in list(self.slots):
            if req is not None and done[req.slot]:
                self._release(req)

    def _take(self, outs: serve.Emitted, iters) -> None:
        """Append the dispatch's tokens (and selections) to their requests; statistics."""
        self.stats.steps += int(iters)
        counts = outs.count  # [N, B]
        self.stats.tokens += int(counts.sum())
        self.stats.drafted += int(outs.drafted.sum())
        self.stats.accepted += int((np.maximum(counts - 1, 0) * (outs.drafted > 0)).sum())
        emitted = np.arange(outs.tokens.shape[-1]) < counts[..., None]  # [N, B, R]
        for req in self.slots:
            if req is None:
                continue
            mask = emitted[:, req.slot]  # [N, R]
            req.output.extend(outs.tokens[:, req.slot][mask].tolist())
            if outs.sel is not None:
                req.selections.extend(outs.sel[:, req.slot][mask])

    def run_until_done(self, progress=None) -> list[Request]:
        while self.queue or any(r is not None for r in self.slots):
            before = self.stats.tokens
            self.step()
            if progress is not None:
                progress.update(self.stats.tokens - before)
        return self.finished

    # Snapshots ---------------------------------------------------------------------------
    def save(self, path, *, overwrite: bool = False) -> None:
        """Write caches, block tables, lengths, the allocator and the live requests (orbax),
        so a long prefix can be reused: `Engine.restore` continues exactly from here."""
        from dsa_jax.checkpoint import save_state

        if not isinstance(self.program.drafter, NgramDrafter):
            raise EngineError("save: an engine with a draft model cannot be snapshotted "
                              "(the draft model's cache is not saved)")

        def req_json(r: Request | None):
            return None if r is None else {"prompt": [int(t) for t in r.prompt],
                                           "output": [int(t) for t in r.output],
                                           "max_new_tokens": r.max_new_tokens,
                                           "slot": r.slot, "blocks": r.blocks, "id": r.id}

        extra = {"lengths": self.lengths.copy(), "speculate": self.speculate,
                 "weights_in_place": self.program.weights_in_place,
                 "prefill_chunk": self.prefill_chunk,
                 "tokens_per_dispatch": self.tokens_per_dispatch,
                 "sampling": dataclasses.asdict(self.sampling),
                 "stop_tokens": list(self.stop_tokens), "seed": self.seed,
                 "next_id": self._next_id,
                 "free": list(self.allocator._free),
                 "slots": [req_json(r) for r in self.slots],
                 "queue": [req_json(r) for r in self.queue],
                 "stats": dataclasses.asdict(self.stats)}
        save_state(path, self.mcfg.dsa, unfold_state(self.mcfg, self.serving.model), extra,
                   overwrite=overwrite)

    @classmethod
    def restore(cls, path, mcfg: ModelConfig, weights: ModelWeights | StackedWeights, *,
                record_selections: bool = False) -> Engine:
        """An engine continuing from `save`'s snapshot (same model config and weights)."""
        from dsa_jax.checkpoint import restore_state

        states, extra = restore_state(path, mcfg.dsa)
        if len(states) != mcfg.num_layers:
            raise EngineError(f"snapshot has {len(states)} layers, the model {mcfg.num_layers}")
        eng = cls(mcfg, weights, max_seqs=len(extra["slots"]),
                  num_blocks=int(states[0].latent.shape[0]), speculate=extra["speculate"],
                  prefill_chunk=extra["prefill_chunk"], record_selections=record_selections,
                  tokens_per_dispatch=extra.get("tokens_per_dispatch", 8),
                  sampling=Sampling(**extra.get("sampling", {})),
                  stop_tokens=extra.get("stop_tokens", ()), seed=extra.get("seed", 0),
                  weights_in_place=bool(extra.get("weights_in_place", False)))
        eng.lengths = np.asarray(extra["lengths"], np.int32).copy()
        eng.allocator._free = deque(extra["free"])

        def req_of(d):
            return Request(d["prompt"], d["max_new_tokens"], list(d["output"]), d["slot"],
                           list(d["blocks"]), id=d.get("id", -1))

        eng.slots = [None if d is None else req_of(d) for d in extra["slots"]]
        eng.queue = deque(req_of(d) for d in extra["queue"])
        live = [r for r in eng.slots if r is not None]
        eng._next_id = extra.get("next_id", 0)
        for r in live:
            eng.allocator._owner.update({b: r.slot for b in r.blocks})
            if r.id < 0:  # a snapshot from before request ids
                r.id, eng._next_id = eng._next_id, eng._next_id + 1
        eng.stats = EngineStats(**extra["stats"])
        eng.allocator.check_invariants()  # a snapshot whose blocks overlap is refused
        model = fold_states(mcfg, states)._replace(lengths=jnp.asarray(eng.lengths))
        eng.serving = serve.Serving(model, eng._slots_of(live), None)
        return eng

    def _slots_of(self, live: list[Request]) -> serve.Slots:
        """Device slots rebuilt from the requests (a restore)."""
        b, t = len(self.slots), self.mcfg.dsa.max_context
        history = np.zeros((b, t), np.int32)
        last, count, limit = (np.zeros(b, np.int32) for _ in range(3))
        done, ids = np.ones(b, bool), np.zeros(b, np.int32)
        for r in live:
            seq = r.prompt + r.output
            history[r.slot, :len(seq)] = seq
            last[r.slot], count[r.slot] = r.output[-1], len(r.output)
            limit[r.slot], ids[r.slot] = r.max_new_tokens, r.id
            done[r.slot] = (len(r.output) >= r.max_new_tokens
                            or r.output[-1] in self.stop_tokens)
        return serve.Slots(*(jnp.asarray(a) for a in (last, history, count, limit, done)),
                           keys=self._keys(ids))


def _check_draft_model(mcfg: ModelConfig, dcfg: ModelConfig, draft_weights) -> None:
    """A draft model shares the target's vocabulary, block geometry and verify width."""
    if draft_weights is None:
        raise EngineError("a ModelDrafter needs draft_weights (its model's weights)")
    a, b = mcfg.dsa, dcfg.dsa
    for name, mine, theirs in (("vocab_size", mcfg.vocab_size, dcfg.vocab_size),
                               ("max_context", a.max_context, b.max_context),
                               ("block_size", a.block_size, b.block_size),
                               ("max_verify", a.max_verify, b.max_verify)):
        if mine != theirs:
            raise EngineError(f"draft model {name} is {theirs}, the target's {mine}: they "
                              f"must be equal")
