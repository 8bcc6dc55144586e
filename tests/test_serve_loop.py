"""The on-device serving loop (`dsa_jax.serve`): the device loop equals the per-step Python
loop, speculative tokens equal plain tokens (n-gram, draft-model and scripted drafters, greedy
and sampled, with stop tokens), bit for bit; one compile across contexts; sampling and
drafting on their own; bad input. The same checks compiled on the GPU at GLM-5.3-Flash
shapes: tests/test_gpu_serving.py."""

import jax
import jax.numpy as jnp
import loop_checks
import numpy as np
import pytest

from dsa_jax import model as M
from dsa_jax import serve
from dsa_jax.drafting import ModelDrafter, ngram_propose
from dsa_jax.engine import ngram_draft
from dsa_jax.sampling import Sampling, SamplingError, check_stop_tokens, sample_tokens
from dsa_jax.shapes import ODD
from dsa_jax.state import ring_guard, ring_rows

MCFG = M.ModelConfig(ODD.replace(indexer_types=("full", "shared"), cache_dtype="float8_e4m3fn",
                                 index_cache_dtype="bfloat16"), vocab_size=37)
SAMPLED = Sampling("sample", temperature=0.5, top_p=0.9)
LIMITS = [23, 9, 30]


def _prompts():
    rng = np.random.default_rng(3)
    motif = rng.integers(0, 37, (3, 5))  # repeats: the n-gram drafter finds matches
    return [np.resize(m, n).tolist() for m, n in zip(motif, (13, 21, 6), strict=True)]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def stacked():
    return M.stack_weights(MCFG, M.init_model(MCFG, jax.random.key(0)))


@pytest.fixture(scope="module")
def plain(stacked):
    """Plain tokens, from the device loop, greedy and sampled."""
    return {name: serve.generate(serve.Program(MCFG, s), stacked, None, PROMPTS, LIMITS,
                                 tokens_per_dispatch=8)
            for name, s in (("greedy", Sampling()), ("sampled", SAMPLED))}


def test_device_loop_equals_python_loop(stacked, plain):
    prog = serve.Program(MCFG, SAMPLED)
    sv, first = serve.start(prog, stacked, None, PROMPTS, LIMITS)
    sv, outs, steps = serve.run_python(prog, stacked, None, sv, 100)
    python = [[int(f)] + t for f, t in zip(np.asarray(first), serve.emitted_tokens(outs),
                                          strict=True)]
    assert python == plain["sampled"]
    assert [len(t) for t in python] == LIMITS and steps == max(LIMITS) - 1
    assert plain["sampled"] != plain["greedy"]


def test_speculative_sampled_tokens_equal_plain(stacked, plain):
    prog = serve.Program(MCFG, SAMPLED, speculate=3)
    sv, first = serve.start(prog, stacked, None, PROMPTS, LIMITS)
    sv, outs, _ = serve.run(prog, stacked, None, sv, 64)
    got = [[int(f)] + t for f, t in zip(np.asarray(first), serve.emitted_tokens(outs),
                                       strict=True)]
    assert got == plain["sampled"]
    assert (np.asarray(outs.count) > 1).any()  # some drafts were kept


def test_stop_token_ends_a_sequence_the_same_with_speculation(stacked, plain):
    stop = plain["greedy"][0][6]  # a token sequence 0 produces mid-way
    want = [seq[:seq.index(stop) + 1] if stop in seq else seq for seq in plain["greedy"]]
    assert len(want[0]) < LIMITS[0]
    got = serve.generate(serve.Program(MCFG, Sampling(), (stop,), speculate=3), stacked, None,
                         PROMPTS, LIMITS, tokens_per_dispatch=8)
    assert got == want


def test_draft_model_speculation_equals_plain(stacked, plain):
    # The target as its own draft model drafts exactly what it will decode: every draft kept.
    prog = serve.Program(MCFG, speculate=3, drafter=ModelDrafter(MCFG))
    sv, first = serve.start(prog, stacked, stacked, PROMPTS, LIMITS)
    sv, outs, _ = serve.run(prog, stacked, stacked, sv, 64)
    got = [[int(f)] + t for f, t in zip(np.asarray(first), serve.emitted_tokens(outs),
                                       strict=True)]
    assert got == plain["greedy"]
    drafted, count = np.asarray(outs.drafted), np.asarray(outs.count)
    assert drafted.sum() > 0 and (count[drafted > 0] == drafted[drafted > 0] + 1).all()
    # Another (one-layer, random) draft model: its drafts are mostly wrong, the tokens not.
    small = M.ModelConfig(MCFG.dsa.replace(indexer_types=("full",)), vocab_size=37)
    dweights = M.stack_weights(small, M.init_model(small, jax.random.key(9)))
    got = serve.generate(serve.Program(MCFG, speculate=2, drafter=ModelDrafter(small)),
                         stacked, dweights, PROMPTS, LIMITS, tokens_per_dispatch=8)
    assert got == plain["greedy"]


def test_draft_model_cache_follows_the_sequence_through_rejections(stacked, plain):
    # Sampled tokens often differ from the draft model's greedy drafts: rounds end early and
    # its cache must be rewound. Drafting with the target's own weights, every cached row
    # of the draft model then equals the target's row at the same position, bit for bit.
    prog = serve.Program(MCFG, SAMPLED, speculate=3, drafter=ModelDrafter(MCFG))
    sv, first = serve.start(prog, stacked, stacked, PROMPTS, LIMITS)
    sv, outs, _ = serve.run(prog, stacked, stacked, sv, 64)
    got = [[int(f)] + t for f, t in zip(np.asarray(first), serve.emitted_tokens(outs),
                                       strict=True)]
    assert got == plain["sampled"]
    drafted, count = np.asarray(outs.drafted), np.asarray(outs.count)
    assert (count[drafted > 0] < drafted[drafted > 0] + 1).any()  # rejections happened
    target, draft = sv.model, sv.draft
    bs = MCFG.dsa.block_size
    tables = np.asarray(target.block_tables)
    nl, nb, _, c = target.latent.shape
    rows_t = np.asarray(target.latent).reshape(nl, nb * bs, c)  # [L, NB*bs, C]
    rows_d = np.asarray(draft.latent).reshape(nl, nb * bs, c)
    for b, n in enumerate(np.minimum(np.asarray(target.lengths), np.asarray(draft.lengths))):
        pos = np.arange(n)
        slots = tables[b, pos // bs] * bs + pos % bs
        assert rows_t[:, slots].tobytes() == rows_d[:, slots].tobytes()
        # The indexer ring (dsa_jax.state): the last positions both rings hold, at their
        # slots (a rejected row up to max_verify - 1 past either length, which may differ by
        # 2, may sit in a slot of either).
        rows = ring_rows(MCFG.dsa)
        held = np.arange(max(n - (rows - 2 * ring_guard(MCFG.dsa) - 2), 0), n)
        assert len(held) == min(n, 8)
        slots_i = held % rows
        for name in ("index_k", "index_g"):
            assert (np.asarray(getattr(target, name))[b, :, slots_i].tobytes()
                    == np.asarray(getattr(draft, name))[b, :, slots_i].tobytes())


def test_ngram_propose_equals_the_host_drafter():
    rng = np.random.default_rng(4)
    t, k = 40, 3
    histories = [rng.integers(0, 4, n).tolist() for n in (1, 2, 3, 5, 9, 17, 31, 40)]
    hist = np.zeros((len(histories), t), np.int32)
    for i, h in enumerate(histories):
        hist[i, :len(h)] = h
    lengths = jnp.asarray([len(h) - 1 for h in histories], jnp.int32)
    max_draft = jnp.asarray([3, 3, 3, 3, 2, 3, 1, 0], jnp.int32)
    drafts, count = jax.jit(ngram_propose, static_argnums=2)(jnp.asarray(hist), lengths, k,
                                                            max_draft)
    for i, h in enumerate(histories):
        want = ngram_draft(h, int(max_draft[i]))
        assert np.asarray(drafts[i, :int(count[i])]).tolist() == want, (i, h)
        assert (np.asarray(drafts[i, int(count[i]):]) == 0).all()
    assert int(count.sum()) > 0


def test_sampling_is_a_function_of_logits_key_and_position():
    logits = jax.random.normal(jax.random.key(1), (4, 3, 37))
    logits = logits.at[0, 0, 5].set(9.0).at[0, 0, 7].set(9.0)  # a tie: the lower id wins
    keys = jax.random.split(jax.random.key(2), 4)
    pos = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)
    greedy = sample_tokens(Sampling(), logits, keys, pos)
    assert int(greedy[0, 0]) == 5
    narrow = sample_tokens(Sampling("sample", 1.0, 1e-6), logits, keys, pos)
    assert (narrow == greedy).all()  # top_p -> 0 keeps only the most likely token
    a = sample_tokens(SAMPLED, logits, keys, pos)
    assert (a == sample_tokens(SAMPLED, logits, keys, pos)).all()
    flat = jnp.zeros((1, 64, 37))  # uniform: the draws follow the positions
    draws = sample_tokens(SAMPLED, flat, keys[:1], jnp.arange(64, dtype=jnp.int32)[None])
    assert len(set(np.asarray(draws).ravel().tolist())) > 10


def test_bad_input_is_refused_before_anything_runs():
    with pytest.raises(SamplingError, match=r"sampling mode 'beam' is not one of"):
        Sampling("beam")
    with pytest.raises(SamplingError, match="temperature must be positive, got 0"):
        Sampling("sample", temperature=0)
    with pytest.raises(SamplingError, match=r"top_p must be in \(0, 1\], got 1.5"):
        Sampling("sample", top_p=1.5)
    with pytest.raises(SamplingError, match=r"stop token\(s\) \[37\] outside the vocabulary "
                                            r"\[0, 37\)"):
        check_stop_tokens([3, 37], 37)
    prog = serve.Program(MCFG, speculate=3)
    with pytest.raises(serve.ServeError, match=r"prompt 1: 90 tokens \+ 4 new tokens \(\+ 3 "
                                               r"draft rows\) = 97 exceeds max_context 96"):
        serve.check_batch(prog, [[1], [1] * 90], [4, 4])
    with pytest.raises(serve.ServeError, match=r"prompt 0: token ids \[40\] outside"):
        serve.check_batch(prog, [[1, 40]], [4])
    with pytest.raises(serve.ServeError, match="prompt 0 is empty"):
        serve.check_batch(prog, [[]], [4])


def test_weights_in_place_programs(stacked, plain):
    """`Program(weights_in_place=False)`: its own compiled programs (without
    `IN_PLACE_WEIGHTS`, the default's options), the same loop; on the CPU the GPU options change
    nothing, so the same tokens, and its device loop equals its Python loop and its
    speculation its plain decoding."""
    assert serve.Program(MCFG).weights_in_place is True  # the default
    prog = serve.Program(MCFG, SAMPLED, weights_in_place=False)
    assert serve.run_jit(prog) is not serve.run_jit(serve.Program(MCFG, SAMPLED))
    assert serve.IN_PLACE_WEIGHTS["xla_gpu_enable_dynamic_slice_fusion"] is True
    got = serve.generate(prog, stacked, None, PROMPTS, LIMITS, tokens_per_dispatch=8)
    assert got == plain["sampled"]
    sv, first = serve.start(prog, stacked, None, PROMPTS, LIMITS)
    sv, outs, _ = serve.run_python(prog, stacked, None, sv, 100)
    assert [[int(f)] + t for f, t in zip(np.asarray(first), serve.emitted_tokens(outs),
                                         strict=True)] == got
    spec = serve.Program(MCFG, SAMPLED, speculate=3, weights_in_place=False)
    assert serve.generate(spec, stacked, None, PROMPTS, LIMITS, tokens_per_dispatch=8) == got


@pytest.mark.long
def test_speculation_equals_plain_under_the_kernels_with_the_row_cut():
    """Under the kernels the loop selects and attends only the rows a step can fill (a plain
    step 1, a speculative round 1 + k: `forward(..., attend_rows=)`); the drafts' rows must
    still be selected and attended, so speculative tokens equal plain ones. Prompts past
    4 * index_topk tokens, where the selection bites. (On the CPU "xla" never cuts, so the
    tests above cannot see the cut.)"""
    mcfg = M.ModelConfig(MCFG.dsa.replace(implementation="pallas-interpret"), vocab_size=37)
    stacked = M.stack_weights(mcfg, M.init_model(mcfg, jax.random.key(0)))
    motif = np.random.default_rng(3).integers(0, 37, (2, 5))
    prompts = [np.resize(m, n).tolist() for m, n in zip(motif, (53, 58), strict=True)]
    plain = serve.generate(serve.Program(mcfg), stacked, None, prompts, [6, 5],
                           tokens_per_dispatch=8)
    spec = serve.generate(serve.Program(mcfg, speculate=3), stacked, None, prompts, [6, 5],
                          tokens_per_dispatch=8)
    assert spec == plain and [len(t) for t in plain] == [6, 5]


@pytest.mark.long
def test_the_loop_on_its_real_rows_under_the_row_invariant_gemms():
    """Under the row-invariant GEMMs (bf16 weights, the kernels) each forward of the loop runs
    only the rows it fills (`serve.loop_rows`: a plain step 1 per sequence, a round of k drafts
    1 + k, the draft model 2): plain, n-gram and draft-model speculation, and the per-step
    Python loop give the same sampled tokens, bit for bit."""
    mcfg = M.ModelConfig(MCFG.dsa.replace(implementation="pallas-interpret",
                                          param_dtype="bfloat16"), vocab_size=37)
    dcfg = M.ModelConfig(mcfg.dsa.replace(indexer_types=("full",)), vocab_size=37)
    stacked = M.stack_weights(mcfg, M.init_model(mcfg, jax.random.key(0)))
    dweights = M.stack_weights(dcfg, M.init_model(dcfg, jax.random.key(5)))
    assert serve.loop_rows(serve.Program(mcfg)) == 1
    assert serve.loop_rows(serve.Program(mcfg, speculate=2)) == 3
    assert serve.loop_rows(serve.Program(MCFG, speculate=2)) == MCFG.dsa.max_verify
    motif = np.random.default_rng(3).integers(0, 37, (2, 5))
    prompts = [np.resize(m, n).tolist() for m, n in zip(motif, (53, 58), strict=True)]
    limits = [6, 5]
    plain = serve.generate(serve.Program(mcfg, SAMPLED), stacked, None, prompts, limits,
                           tokens_per_dispatch=8)
    assert [len(t) for t in plain] == limits
    spec = serve.Program(mcfg, SAMPLED, speculate=3)
    assert serve.generate(spec, stacked, None, prompts, limits, tokens_per_dispatch=8) == plain
    drafted = serve.Program(mcfg, SAMPLED, speculate=2, drafter=ModelDrafter(dcfg))
    assert serve.generate(drafted, stacked, dweights, prompts, limits,
                          tokens_per_dispatch=8) == plain
    prog = serve.Program(mcfg, SAMPLED)
    sv, first = serve.start(prog, stacked, None, prompts, limits)
    sv, outs, _ = serve.run_python(prog, stacked, None, sv, 100)
    assert outs.tokens.shape[-1] == 1
    assert [[int(f)] + t for f, t in zip(np.asarray(first), serve.emitted_tokens(outs),
                                         strict=True)] == plain


def test_scripted_speculation_equals_plain_on_random_caches(stacked):
    """The CPU twin of tests/test_gpu_serving.py's 16K check (the bench's spec point): one
    sequence on random caches filled almost to max_context, plain tokens, then speculating
    with a drafter right 7 times in 10 from the same state: the same tokens."""
    got = loop_checks.scripted_speculation(MCFG.dsa, 37, 8, stacked=stacked)
    assert got["speculative"] == got["plain"] and len(got["plain"]) == 8
    assert 0 < got["kept"] < got["drafted"]


def test_the_loop_program_compiles_once_across_contexts(stacked):
    """`serve.run` at one batch and dispatch length: one compile serves every context (the
    lengths are data), here 20 and 80 tokens into a 96-token context."""
    prog = serve.Program(MCFG)
    states = [loop_checks.random_serving(prog, 2, n, jax.random.key(n)) for n in (20, 80)]
    traces = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traces.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for sv in states:  # 5 steps a dispatch: a length no other test here compiles
            sv, outs, _ = serve.run(prog, stacked, None, sv, 5)
            jax.block_until_ready(outs)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert traces.count("_run") == 1, traces
    assert np.asarray(sv.model.lengths).tolist() == [85, 85]
