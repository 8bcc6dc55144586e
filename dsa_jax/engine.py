"""A serving loop over a small causal model built of DSA blocks.

The model: token embedding, then per layer `h = h + DSA(rms(h))`, a final RMSNorm and an LM
head. Layers whose `indexer_types` entry is "shared" reuse the previous full layer's
selection. The engine keeps up to `max_seqs` sequences at once in fixed slots, hands out
physical latent blocks from a free list, admits a request when a slot and its blocks are free,
and runs one jitted step (all layers, donated state) for every live sequence. Greedy
speculative decoding: an n-gram drafter proposes tokens from the sequence's own history, one
`max_verify`-row step verifies them, the longest agreeing prefix is kept and the rest rewound.
Every step, speculative or not, runs rows padded to `cfg.max_verify`, so each row's logits are
bit-identical either way and speculation never changes the tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.config import DsaConfig
from dsa_jax.layer import step
from dsa_jax.projection import rms_norm
from dsa_jax.state import DsaState, init_state
from dsa_jax.weights import DsaWeights, init_random_weights


class EngineError(ValueError):
    """A request the engine cannot serve (too long, bad speculation width, ...)."""


class OutOfBlocks(RuntimeError):
    """The block pool cannot cover a request right now."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    dsa: DsaConfig  # the block; len(dsa.indexer_types) is the number of layers
    vocab_size: int = 256

    @property
    def num_layers(self) -> int:
        return len(self.dsa.indexer_types)


class ModelWeights(NamedTuple):
    embed: jax.Array  # [V, D] f32
    norms: jax.Array  # [L, D] f32: pre-block RMSNorm weights
    layers: tuple[DsaWeights, ...]  # L blocks; "shared" ones have no indexer
    final_norm: jax.Array  # [D] f32
    lm_head: jax.Array  # [V, D] param dtype


def init_model(mcfg: ModelConfig, key: jax.Array,
               layers: tuple[DsaWeights, ...] | None = None) -> ModelWeights:
    """Random model weights from `key`; `layers` replaces the random DSA blocks if given."""
    cfg = mcfg.dsa
    d, v = cfg.hidden_size, mcfg.vocab_size
    k_emb, k_norm, k_fin, k_head, k_layers = jax.random.split(key, 5)
    if layers is None:
        layers = tuple(
            init_random_weights(cfg, k, has_indexer=kind == "full")
            for k, kind in zip(jax.random.split(k_layers, mcfg.num_layers), cfg.indexer_types,
                               strict=True))
    if len(layers) != mcfg.num_layers:
        raise EngineError(f"{len(layers)} layer weights for a {mcfg.num_layers}-layer model")
    return ModelWeights(
        embed=jax.random.normal(k_emb, (v, d)),
        norms=1.0 + 0.1 * jax.random.normal(k_norm, (mcfg.num_layers, d)),
        layers=tuple(layers),
        final_norm=1.0 + 0.1 * jax.random.normal(k_fin, (d,)),
        lm_head=(jax.random.normal(k_head, (v, d)) * d ** -0.5).astype(cfg.param_dtype),
    )


def init_model_state(mcfg: ModelConfig, num_seqs: int, num_blocks: int) -> tuple[DsaState, ...]:
    """Per-layer states; block tables start unassigned (-1) until the allocator fills them."""
    cfg = mcfg.dsa
    tables = np.full((num_seqs, cfg.blocks_per_seq), -1, np.int32)
    return tuple(init_state(cfg, num_seqs, num_blocks=num_blocks, block_tables=tables,
                            has_indexer=kind == "full") for kind in cfg.indexer_types)


def forward_rows(mcfg: ModelConfig, weights: ModelWeights, states: tuple[DsaState, ...],
                 tokens: jax.Array, n_new: jax.Array):
    """tokens [B, R] (first n_new [B] real) -> (greedy next tokens [B, R], states, sel0 [B,R,W])."""
    cfg = mcfg.dsa
    h = weights.embed[tokens]  # [B, R, D]
    new_states, sel, sel0 = [], None, None
    for i, (lw, st) in enumerate(zip(weights.layers, states, strict=True)):
        shared = None if lw.has_indexer else sel
        y, st, sel = step(cfg, lw, st, rms_norm(h, weights.norms[i], cfg.rms_norm_eps),
                          n_new, shared)
        sel0 = sel if sel0 is None else sel0
        h = h + y
        new_states.append(st)
    h = rms_norm(h, weights.final_norm, cfg.rms_norm_eps)
    logits = jnp.einsum("brd,vd->brv", h.astype(weights.lm_head.dtype), weights.lm_head,
                        preferred_element_type=jnp.float32)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), tuple(new_states), sel0


@functools.partial(jax.jit, static_argnames=("mcfg",), donate_argnames=("states",))
def model_step(mcfg, weights, states, tokens, n_new):
    return forward_rows(mcfg, weights, states, tokens, n_new)


@functools.partial(jax.jit, donate_argnames=("states",))
def set_lengths(states, lengths):
    """Every layer's lengths -> `lengths [B]` (rewind after a rejected draft, or release)."""
    return tuple(st._replace(lengths=lengths, index_lengths=jnp.minimum(st.index_lengths, lengths))
                 for st in states)


@functools.partial(jax.jit, donate_argnames=("states",))
def set_block_row(states, slot, row):
    """Install block-table row `row [MB]` for sequence `slot` in every layer."""
    return tuple(st._replace(block_tables=st.block_tables.at[slot].set(row)) for st in states)


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
            assert blk not in self._owner, f"block {blk} handed out twice"
            self._owner[blk] = owner
        return blocks

    def release(self, blocks: list[int]) -> None:
        for blk in blocks:
            if self._owner.pop(blk, None) is None:
                raise ValueError(f"block {blk} released but not allocated")
            self._free.append(blk)

    def owners(self) -> dict[int, int]:
        return dict(self._owner)


def ngram_draft(history: list[int], max_draft: int, n: int = 2) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the last `n` (then 1) tokens."""
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


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Engine:
    """Greedy generation for many sequences; `speculate` drafts up to max_verify - 1 tokens."""

    def __init__(self, mcfg: ModelConfig, weights: ModelWeights, *, max_seqs: int,
                 num_blocks: int, speculate: int = 0, prefill_chunk: int = 32,
                 record_selections: bool = False):
        cfg = mcfg.dsa
        if not 0 <= speculate <= cfg.max_verify - 1:
            raise EngineError(f"speculate={speculate} drafts need {speculate + 1} verify rows; "
                              f"max_verify is {cfg.max_verify}, so at most "
                              f"{cfg.max_verify - 1} drafts")
        if prefill_chunk < 1:
            raise EngineError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.mcfg, self.weights, self.speculate = mcfg, weights, speculate
        self.prefill_chunk = prefill_chunk
        self.allocator = BlockAllocator(num_blocks)
        self.states = init_model_state(mcfg, max_seqs, num_blocks)
        self.lengths = np.zeros(max_seqs, np.int32)  # host mirror of the cached lengths
        self.slots: list[Request | None] = [None] * max_seqs
        self.queue: deque[Request] = deque()
        self.finished: list[Request] = []
        self.stats = EngineStats()
        self.record_selections = record_selections

    # Admission and release -------------------------------------------------------------
    def submit(self, prompt: list[int], max_new_tokens: int) -> Request:
        cfg = self.mcfg.dsa
        need = len(prompt) + max_new_tokens + self.speculate
        if not prompt:
            raise EngineError("a prompt needs at least one token")
        if need > cfg.max_context:
            raise EngineError(f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens "
                              f"(+ {self.speculate} draft rows) = {need} exceeds max_context "
                              f"{cfg.max_context}")
        if self._blocks_for(need) > self.allocator.num_blocks:
            raise EngineError(f"a request of {need} tokens needs {self._blocks_for(need)} "
                              f"blocks; the pool has {self.allocator.num_blocks}")
        bad = [t for t in prompt if not 0 <= t < self.mcfg.vocab_size]
        if bad:
            raise EngineError(f"token ids {bad[:5]} outside the vocabulary [0, "
                              f"{self.mcfg.vocab_size})")
        req = Request(list(prompt), max_new_tokens)
        self.queue.append(req)
        return req

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.mcfg.dsa.block_size)

    def _admit(self) -> list[Request]:
        """Move queued requests into free slots while their blocks are free (FIFO)."""
        admitted = []
        while self.queue and None in self.slots:
            req = self.queue[0]
            need = self._blocks_for(len(req.prompt) + req.max_new_tokens + self.speculate)
            if need > self.allocator.num_free:
                break  # back-pressure: wait for a sequence to finish
            self.queue.popleft()
            req.slot = self.slots.index(None)
            req.blocks = self.allocator.allocate(need, owner=req.slot)
            row = np.full(self.mcfg.dsa.blocks_per_seq, -1, np.int32)
            row[:need] = req.blocks
            self.states = set_block_row(self.states, req.slot, jnp.asarray(row))
            self.slots[req.slot] = req
            admitted.append(req)
        return admitted

    def _release(self, req: Request) -> None:
        self.allocator.release(req.blocks)
        self.slots[req.slot] = None
        self.lengths[req.slot] = 0
        self.states = set_lengths(self.states, jnp.asarray(self.lengths))
        self.finished.append(req)

    # Steps -----------------------------------------------------------------------------
    def _run(self, rows: list[list[int]], width: int):
        """One jitted step over every slot: `rows[s]` are slot s's new tokens (maybe none)."""
        tokens = np.zeros((len(self.slots), width), np.int32)
        n_new = np.zeros(len(self.slots), np.int32)
        for s, r in enumerate(rows):
            tokens[s, :len(r)] = r
            n_new[s] = len(r)
        nxt, self.states, sel0 = model_step(self.mcfg, self.weights, self.states,
                                            jnp.asarray(tokens), jnp.asarray(n_new))
        self.lengths += n_new
        return np.asarray(nxt), (np.asarray(sel0) if self.record_selections else None)

    def _prefill(self, admitted: list[Request]) -> None:
        """Prompts of the newly admitted, in chunks of `prefill_chunk` rows (one compiled shape)."""
        width = self.prefill_chunk
        longest = max(len(r.prompt) for r in admitted)
        for lo in range(0, longest, width):
            rows = [[] for _ in self.slots]
            for req in admitted:
                rows[req.slot] = req.prompt[lo:lo + width]
            nxt, _ = self._run(rows, width)
            for req in admitted:
                if lo < len(req.prompt) <= lo + width:  # last chunk: first generated token
                    req.output.append(int(nxt[req.slot, len(req.prompt) - lo - 1]))
                    self.stats.tokens += 1

    def _verify_rows(self, req: Request) -> list[int]:
        history = req.prompt + req.output
        room = req.max_new_tokens - len(req.output)
        drafts = ngram_draft(history, min(self.speculate, room - 1)) if room > 1 else []
        return [req.output[-1]] + drafts

    def step(self) -> None:
        """Admit, then one decode/verify step for every live sequence."""
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        live = [r for r in self.slots if r is not None and len(r.output) < r.max_new_tokens]
        rows = [[] for _ in self.slots]
        for req in live:
            rows[req.slot] = self._verify_rows(req)
        if live:
            nxt, sel0 = self._run(rows, self.mcfg.dsa.max_verify)
            self.stats.steps += 1
            for req in live:
                self._accept(req, rows[req.slot], nxt[req.slot],
                             None if sel0 is None else sel0[req.slot])
            self.states = set_lengths(self.states, jnp.asarray(self.lengths))
        for req in list(self.slots):
            if req is not None and len(req.output) >= req.max_new_tokens:
                self._release(req)

    def _accept(self, req: Request, row: list[int], greedy: np.ndarray, sel) -> None:
        """Keep the longest prefix of drafts that greedy decoding agrees with."""
        drafts = row[1:]
        kept = 0
        while kept < len(drafts) and drafts[kept] == greedy[kept]:
            kept += 1
        new = drafts[:kept] + [int(greedy[kept])]
        req.output.extend(new)
        if sel is not None:
            req.selections.extend(sel[:kept + 1])
        self.stats.drafted += len(drafts)
        self.stats.accepted += kept
        self.stats.tokens += len(new)
        self.lengths[req.slot] -= len(row) - (kept + 1)  # rewind the rejected rows

    # Snapshots ---------------------------------------------------------------------------
    def save(self, path, *, overwrite: bool = False) -> None:
        """Write caches, block tables, lengths, the allocator and the live requests (orbax),
        so a long prefix can be reused: `Engine.restore` continues exactly from here."""
        from dsa_jax.checkpoint import save_state

        def req_json(r: Request | None):
            return None if r is None else {"prompt": [int(t) for t in r.prompt],
                                           "output": [int(t) for t in r.output],
                                           "max_new_tokens": r.max_new_tokens,
                                           "slot": r.slot, "blocks": r.blocks}

        extra = {"lengths": self.lengths.copy(), "speculate": self.speculate,
                 "prefill_chunk": self.prefill_chunk,
                 "free": list(self.allocator._free),
                 "slots": [req_json(r) for r in self.slots],
                 "queue": [req_json(r) for r in self.queue],
                 "stats": dataclasses.asdict(self.stats)}
        save_state(path, self.mcfg.dsa, list(self.states), extra, overwrite=overwrite)

    @classmethod
    def restore(cls, path, mcfg: ModelConfig, weights: ModelWeights, *,
                record_selections: bool = False) -> Engine:
        """An engine continuing from `save`'s snapshot (same model config and weights)."""
        from dsa_jax.checkpoint import restore_state

        states, extra = restore_state(path, mcfg.dsa)
        if len(states) != mcfg.num_layers:
            raise EngineError(f"snapshot has {len(states)} layers, the model {mcfg.num_layers}")
        eng = cls(mcfg, weights, max_seqs=len(extra["slots"]),
                  num_blocks=int(states[0].latent.shape[0]), speculate=extra["speculate"],
                  prefill_chunk=extra["prefill_chunk"], record_selections=record_selections)
        eng.states = tuple(states)
        eng.lengths = np.asarray(extra["lengths"], np.int32).copy()
        eng.allocator._free = deque(extra["free"])

        def req_of(d):
            return Request(d["prompt"], d["max_new_tokens"], list(d["output"]), d["slot"],
                           list(d["blocks"]))

        eng.slots = [None if d is None else req_of(d) for d in extra["slots"]]
        eng.queue = deque(req_of(d) for d in extra["queue"])
        for r in eng.slots:
            if r is not None:
                eng.allocator._owner.update({b: r.slot for b in r.blocks})
        eng.stats = EngineStats(**extra["stats"])
        return eng

    def run_until_done(self, progress=None) -> list[Request]:
        while self.queue or any(r is not None for r in self.slots):
            before = self.stats.tokens
            self.step()
            if progress is not None:
                progress.update(self.stats.tokens - before)
        return self.finished
