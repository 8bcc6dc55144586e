"""The error catalogue's cases (tests/reliability_catalogue.py), continued: the engine, the
model, sampling and the fixed-batch loop. Same form: (id, when, type,
message regex, call(c))."""

from __future__ import annotations

import jax

from dsa_jax import serve
from dsa_jax.drafting import ModelDrafter
from dsa_jax.engine import BlockAllocator, Engine, EngineError, ModelConfig, OutOfBlocks, init_model
from dsa_jax.model import ModelError, fold_states
from dsa_jax.sampling import Sampling, SamplingError
from dsa_jax.serve import ServeError
from dsa_jax.shapes import ODD

MCFG = ModelConfig(ODD.replace(indexer_types=("full", "shared")), vocab_size=37)


def engine(c, **kw):
    return Engine(MCFG, c.model, **{"max_seqs": 2, "num_blocks": 24, **kw})


SERVING_CASES = [
    # ---- engine
    ("engine.sizes", "max_seqs / num_blocks / prefill_chunk not positive integers",
     EngineError, r"prefill_chunk must be a positive integer, got 0",
     lambda c: engine(c, prefill_chunk=0)),
    ("engine.batch-invariant", "batch_invariant not a bool", EngineError,
     r"batch_invariant must be a bool, got 'yes'", lambda c: engine(c, batch_invariant="yes")),
    ("engine.speculate", "more drafts than max_verify - 1", EngineError,
     r"speculate=4 drafts need 5 verify rows; max_verify is 4", lambda c: engine(c, speculate=4)),
    ("engine.prompt-type", "a prompt that is not a list of ids", EngineError,
     r"prompt must be a list of token ids, got str", lambda c: engine(c).submit("ab", 3)),
    ("engine.prompt-empty", "an empty prompt", EngineError,
     r"a prompt needs at least one token", lambda c: engine(c).submit([], 3)),
    ("engine.prompt-int", "a token id that is not an integer", EngineError,
     r"prompt\[1\] is 2.5, not an integer token id", lambda c: engine(c).submit([1, 2.5], 3)),
    ("engine.prompt-vocab", "a token id outside the vocabulary", EngineError,
     r"prompt\[1\] is 99, outside the vocabulary \[0, 37\)",
     lambda c: engine(c).submit([1, 99], 3)),
    ("engine.max-new", "max_new_tokens not a positive integer", EngineError,
     r"max_new_tokens must be a positive integer, got -30",
     lambda c: engine(c).submit([1, 2], -30)),
    ("engine.max-context", "a request longer than max_context", EngineError,
     r"prompt of 90 tokens \+ 10 new tokens \(\+ 0 draft rows\) = 100 exceeds max_context 96",
     lambda c: engine(c).submit([1] * 90, 10)),
    ("engine.pool", "a request needing more blocks than the pool has", EngineError,
     r"a request of 30 tokens needs 4 blocks; the pool has 3",
     lambda c: engine(c, num_blocks=3).submit([1] * 20, 10)),
    ("engine.sampling", "sampling that is not a Sampling", EngineError,
     r"sampling must be a dsa_jax.sampling.Sampling, got str",
     lambda c: engine(c, sampling="greedy")),
    ("engine.stop-tokens", "a stop token outside the vocabulary", EngineError,
     r"stop token\(s\) \[99\] outside the vocabulary \[0, 37\)",
     lambda c: engine(c, stop_tokens=[99])),
    ("engine.draft-weights", "a draft model without its weights", EngineError,
     r"a ModelDrafter needs draft_weights", lambda c: engine(c, speculate=1,
                                                              drafter=ModelDrafter(MCFG))),
    ("engine.out-of-blocks", "allocating more blocks than are free", OutOfBlocks,
     r"5 blocks wanted, 4 of 4 free", lambda c: BlockAllocator(4).allocate(5, owner=0)),
    ("engine.release", "releasing a block that is not allocated", EngineError,
     r"block 2 released but not allocated", lambda c: BlockAllocator(4).release([2])),
    # ---- the model, sampling and the fixed-batch loop
    ("model.layers", "layer weights not one per model layer", ModelError,
     r"1 layer weights for a 2-layer model",
     lambda c: init_model(MCFG, jax.random.key(0), layers=(c.w,))),
    ("model.layer-kind", "a layer's weights of the other kind (full / shared)", ModelError,
     r"layer 0 is 'full' but its weights have no indexer",
     lambda c: init_model(MCFG, jax.random.key(0), layers=(c.ws, c.w))),
    ("model.states", "layer states not one per model layer", ModelError,
     r"1 layer states for a 2-layer model", lambda c: fold_states(MCFG, [c.state])),
    ("sampling.mode", "an unknown sampling mode", SamplingError,
     r"sampling mode 'beam' is not one of", lambda c: Sampling(mode="beam")),
    ("sampling.temperature", "a temperature not > 0", SamplingError,
     r"temperature must be positive, got 0.0", lambda c: Sampling(temperature=0.0)),
    ("sampling.top-p", "top_p outside (0, 1]", SamplingError,
     r"top_p must be in \(0, 1\], got 1.5", lambda c: Sampling(top_p=1.5)),
    ("sampling.number", "a temperature or top_p that is not a real number", SamplingError,
     r"temperature must be a real number, got '1'", lambda c: Sampling(temperature="1")),
    ("serve.token-type", "a prompt token id that is not an integer", ServeError,
     r"prompt 0: token ids must be integers, got \[1.5\]",
     lambda c: serve.check_batch(serve.Program(MCFG), [[1, 1.5]], [3])),
    ("serve.count", "prompts and token limits of different lengths", ServeError,
     r"2 prompts but 1 token limits",
     lambda c: serve.check_batch(serve.Program(MCFG), [[1], [2]], [3])),
    ("serve.empty", "an empty prompt in the batch", ServeError,
     r"prompt 1 is empty", lambda c: serve.check_batch(serve.Program(MCFG), [[1], []], [3, 3])),
    ("serve.max-new", "a token limit below 1", ServeError,
     r"max_new_tokens\[0\] is 0; it must be at least 1",
     lambda c: serve.check_batch(serve.Program(MCFG), [[1]], [0])),
    ("serve.too-long", "prompt + new tokens past max_context", ServeError,
     r"prompt 0: 90 tokens \+ 10 new tokens \(\+ 0 draft rows\) = 100 exceeds max_context 96",
     lambda c: serve.check_batch(serve.Program(MCFG), [[1] * 90], [10])),
    ("serve.vocab", "a token id outside the vocabulary", ServeError,
     r"prompt 0: token ids \[40\] outside the vocabulary \[0, 37\)",
     lambda c: serve.check_batch(serve.Program(MCFG), [[1, 40]], [3])),
]
