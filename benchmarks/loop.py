"""The serving-loop points (group `loop`): the model's device loop, speculative decoding and
the engine, timed as a server runs them.

The model: `plan.loop_layers` DSA blocks of the config's shapes (full and shared in turn),
vocabulary `VOCAB`, random weights; its caches filled with random values up to the point's
context (the timing depends on lengths, not on values). Per implementation:

- loop-bB-lL: `dsa_jax.serve.run` (the default `Program`: weights read in place), `plan.
  loop_tokens` tokens per dispatch and one host read of the tokens each, every dispatch
  continuing the sequences; `median_us` is the wall time per token per layer, beside the
  layers' kernel time per token per layer from a profiler trace;
- spec-b1-lL-k3: the same model speculating (3 drafts a round) with a scripted drafter that
  proposes the right token with probability `stated_acceptance`, against plain decoding of
  the same tokens from the same state: tokens/s of both (`median_us`: time per token) and
  whether the tokens are the same (tests/test_gpu_serving.py asserts that on the GPU);
- engine-bB-lL: `Engine.step` as a user drives it, B sequences of `plan.engine_prompt`-token
  prompts admitted and prefilled first; `median_us` is the wall time per decode step per
  layer, beside its kernel time.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import serve
from dsa_jax.drafting import ScriptedDrafter
from dsa_jax.engine import Engine
from dsa_jax.model import ModelConfig, init_model, init_model_state, stack_weights
from dsa_jax.weights import fold_weights

from .harness import kernel_us, measure
from .measures import per_impl
from .workloads import RNG, random_caches, random_hf_tensors

VOCAB = 256
# The loop points' own fields, copied to the point from its main implementation's timing.
LIFTED = ("us_per_token_per_layer", "kernel_us_per_token_per_layer", "wall_over_kernel",
          "dispatch_us", "tokens_per_s", "plain_tokens_per_s", "speedup",
          "measured_acceptance", "tokens_equal_plain", "per_step_per_layer_us",
          "kernel_per_step_per_layer_us", "compile_s")


def loop_model(suite, impl: str):
    """(ModelConfig, StackedWeights) of the loop points at `impl`. The weights (numpy draws,
    the per-layer blocks folded from random HF tensors) are made once per run."""
    p = suite.plan
    cfg = suite.cfg.replace(implementation=impl, tp_degree=1,
                            indexer_types=("full", "shared") * (p.loop_layers // 2)
                            + ("full",) * (p.loop_layers % 2))
    mcfg = ModelConfig(cfg, vocab_size=VOCAB)
    if suite.loop_weights is None:
        layers = tuple(fold_weights(cfg, random_hf_tensors(cfg, suite.args.seed + 10 + i,
                                                           kind == "full"))
                       for i, kind in enumerate(cfg.indexer_types))
        weights = init_model(mcfg, jax.random.key(suite.args.seed, impl=RNG), layers=layers)
        suite.loop_weights = jax.block_until_ready(stack_weights(mcfg, weights))
    return mcfg, suite.loop_weights


def random_serving(prog: serve.Program, b: int, length: int, seed: int) -> serve.Serving:
    """A serving state of `b` live sequences whose caches hold `length` random tokens (the
    newest token is the input of the next step); no token limit."""
    mcfg = prog.mcfg
    mb = mcfg.dsa.blocks_per_seq
    ms = init_model_state(mcfg, b, b * mb, np.arange(b * mb, dtype=np.int32).reshape(b, mb))
    k = jax.random.split(jax.random.key(seed, impl=RNG), 5)
    ms = random_caches(ms, k)._replace(lengths=jnp.full((b,), length, jnp.int32))
    slots = serve.init_slots(mcfg, b)._replace(
        last=jax.random.randint(k[4], (b,), 0, mcfg.vocab_size),
        limit=jnp.full((b,), 10 ** 6, jnp.int32), done=jnp.zeros((b,), bool))
    draft = prog.drafter.init_state(b, b * mb) if prog.speculate else None
    return serve.Serving(ms, slots, draft)


def per_token_per_layer(t: dict, per: int) -> dict:
    """`measure`'s times of a dispatch (or an engine step) divided by its decode steps times
    the layers."""
    return {k: v / per if k.endswith("_us") else v for k, v in t.items()}


def copy_tree(tree):
    return jax.tree.map(lambda a: a if a is None else jnp.copy(a), tree)


def loop(suite, point) -> dict:
    """`serve.run` at the point's batch, `tokens_per_dispatch` tokens a dispatch."""
    q, reps = point.params, suite.plan.long_groups
    n, nl = q["tokens_per_dispatch"], q["layers"]

    def one(impl):
        mcfg, stacked = loop_model(suite, impl)
        prog = serve.Program(mcfg)
        dispatches = reps + 6  # first, warm-up, timed, traced (2 + 1): every one continues
        box = {"sv": random_serving(prog, q["batch"], q["ctx"] - 1 - dispatches * n,
                                    3 + q["batch"])}
        t0 = time.perf_counter()
        box["sv"], outs, _ = serve.run(prog, stacked, None, box["sv"], n)
        jax.block_until_ready(outs)
        compile_s = time.perf_counter() - t0

        def call():
            box["sv"], outs, _ = serve.run(prog, stacked, None, box["sv"], n)
            return jax.device_get(outs.tokens)  # the serving loop's one host read

        t = per_token_per_layer(measure(call, warmup=1, groups=reps, inner=1), n * nl)
        kern = kernel_us(call, 1)  # one traced dispatch (after two untraced ones)
        dispatch = t["median_us"] * n * nl
        t.update(dispatch_us=dispatch, compile_s=compile_s,
                 us_per_token_per_layer=t["median_us"],
                 kernel_us_per_token_per_layer=None if kern is None else kern / n / nl,
                 wall_over_kernel=None if kern is None else dispatch / kern,
                 timed=f"serve.run(Program(mcfg), ..., n={n}) and a device_get of the tokens")
        return t

    return {"timings": per_impl(suite, point, one), "cost": None}


def spec(suite, point) -> dict:
    """`tokens_per_dispatch` tokens of one sequence, plain and speculating, from one state."""
    q, reps = point.params, suite.plan.long_groups
    n, k = q["tokens_per_dispatch"], q["drafts"]

    def one(impl):
        mcfg, stacked = loop_model(suite, impl)
        plain = serve.Program(mcfg)
        base = random_serving(plain, 1, q["ctx"] - 2 - 2 * n - k, 7)
        base = base._replace(slots=base.slots._replace(limit=jnp.full((1,), n, jnp.int32)))
        box = {}

        def timed(prog, start):
            def reset():
                box["sv"] = copy_tree(start)
                return box["sv"]

            def call():
                box["sv"], box["outs"], box["iters"] = serve.run(prog, stacked, None,
                                                                 box["sv"], n)
                return jax.device_get(box["outs"].tokens)

            us = measure(call, warmup=1, groups=reps, inner=1, reset=reset)["median_us"]
            return us, jax.device_get(box["outs"]), int(box["iters"])

        plain_us, outs, _ = timed(plain, base)
        want = serve.emitted_tokens(outs)[0]
        right = np.zeros((1, mcfg.dsa.max_context), np.int32)  # the drafter's right tokens
        first = int(base.model.lengths[0]) + 1
        right[0, first:first + len(want)] = want
        prog = serve.Program(mcfg, speculate=k,
                             drafter=ScriptedDrafter(VOCAB, q["stated_acceptance"]))
        spec_us, outs, rounds = timed(prog, base._replace(draft=jnp.asarray(right)))
        got = serve.emitted_tokens(outs)[0]
        drafted = int(outs.drafted.sum())
        accepted = int((np.maximum(outs.count - 1, 0) * (outs.drafted > 0)).sum())
        return {"median_us": spec_us / max(len(got), 1), "tokens": len(got), "rounds": rounds,
                "tokens_per_s": len(got) / spec_us * 1e6,
                "plain_tokens_per_s": len(want) / plain_us * 1e6,
                "speedup": plain_us / spec_us * len(got) / max(len(want), 1),
                "measured_acceptance": accepted / max(drafted, 1),
                "tokens_equal_plain": got == want, "groups": reps,
                "timed": f"serve.run of {n} tokens from a copy of one state, speculating and "
                         f"plain"}

    return {"timings": per_impl(suite, point, one), "cost": None}


def engine(suite, point) -> dict:
    """`Engine.step` at the point's batch after admission and prefill."""
    q, reps = point.params, suite.plan.long_groups
    n, nl, b = q["tokens_per_dispatch"], q["layers"], q["batch"]

    def one(impl):
        mcfg, stacked = loop_model(suite, impl)
        eng = Engine(mcfg, stacked, max_seqs=b, num_blocks=b * mcfg.dsa.blocks_per_seq,
                     prefill_chunk=min(512, q["prompt"]), tokens_per_dispatch=n)
        rng = np.random.default_rng(12)
        for _ in range(b):
            eng.submit(rng.integers(0, VOCAB, q["prompt"]).tolist(), n * (reps + 8))
        t0 = time.perf_counter()
        eng.step()  # admission, prefill, the first dispatch (compiles)
        compile_s = time.perf_counter() - t0
        before = eng.stats.tokens
        t = per_token_per_layer(measure(eng.step, warmup=1, groups=reps, inner=1), n * nl)
        tokens_per_step = (eng.stats.tokens - before) / (reps + 1)
        kern = kernel_us(eng.step, 1)
        wall = t["median_us"] * n * nl
        t.update(step_us=wall, compile_s=compile_s, per_step_per_layer_us=t["median_us"],
                 kernel_per_step_per_layer_us=None if kern is None else kern / n / nl,
                 wall_over_kernel=None if kern is None else wall / kern,
                 tokens_per_s=tokens_per_step / wall * 1e6,
                 timed=f"Engine.step() ({n} decode steps of {b} sequences, one host read)")
        return t

    return {"timings": per_impl(suite, point, one), "cost": None}


MEASURES = {"loop": loop, "spec": spec, "engine": engine}
