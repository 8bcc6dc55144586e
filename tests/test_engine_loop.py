"""The engine on the device loop: sampled and speculative tokens equal plain tokens whatever
the dispatch size, stop tokens, one host read per step, snapshots of a sampled run, bad input."""

import jax
import numpy as np
import pytest

from dsa_jax.drafting import ModelDrafter
from dsa_jax.engine import Engine, EngineError, ModelConfig, init_model
from dsa_jax.sampling import Sampling
from dsa_jax.shapes import ODD

MCFG = ModelConfig(ODD.replace(indexer_types=("full", "shared"), cache_dtype="float8_e4m3fn",
                               index_cache_dtype="bfloat16"), vocab_size=37)
SAMPLED = Sampling("sample", temperature=0.5, top_p=0.9)


@pytest.fixture(scope="module")
def weights():
    return init_model(MCFG, jax.random.key(0))


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 5, size=int(rng.integers(3, 30)))) for _ in range(n)]


PROMPTS, MAX_NEW = _prompts(5), [12, 3, 20, 7, 15]


def _generate(weights, **kw):
    eng = Engine(MCFG, weights, max_seqs=3, num_blocks=36, prefill_chunk=8, **kw)
    reqs = [eng.submit(p, m) for p, m in zip(PROMPTS, MAX_NEW, strict=True)]
    eng.run_until_done()
    return [r.output for r in reqs], eng


@pytest.fixture(scope="module")
def runs(weights):
    return {"one": _generate(weights, sampling=SAMPLED, tokens_per_dispatch=1),
            "many": _generate(weights, sampling=SAMPLED, tokens_per_dispatch=8),
            "spec": _generate(weights, sampling=SAMPLED, tokens_per_dispatch=8, speculate=3),
            "greedy": _generate(weights, tokens_per_dispatch=8)}


def test_sampled_tokens_do_not_depend_on_dispatch_size_or_speculation(weights, runs):
    (one, eng1), (many, eng8), (spec, eng3) = runs["one"], runs["many"], runs["spec"]
    assert one == many == spec
    assert [len(o) for o in one] == MAX_NEW
    assert eng8.stats.dispatches < eng1.stats.dispatches
    assert eng3.stats.drafted > 0  # speculation ran (greedy acceptance: test_engine.py)
    assert runs["greedy"][0] != one


def test_draft_model_engine_equals_plain(weights, runs, tmp_path):
    got, eng = _generate(weights, tokens_per_dispatch=8, speculate=2,
                         drafter=ModelDrafter(MCFG), draft_weights=weights)
    assert got == runs["greedy"][0]
    assert eng.stats.accepted == eng.stats.drafted > 0  # the target drafting for itself
    with pytest.raises(EngineError, match="an engine with a draft model cannot be snapshot"):
        eng.save(tmp_path / "snap")
    with pytest.raises(EngineError, match="a ModelDrafter needs draft_weights"):
        Engine(MCFG, weights, max_seqs=2, num_blocks=24, speculate=2,
               drafter=ModelDrafter(MCFG))


def test_one_host_read_per_step(weights, monkeypatch):
    eng = Engine(MCFG, weights, max_seqs=3, num_blocks=36, prefill_chunk=8,
                 sampling=SAMPLED, tokens_per_dispatch=8)
    for p, m in zip(PROMPTS, MAX_NEW, strict=True):
        eng.submit(p, m)
    reads = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(1) or real(x))
    steps = 0
    while eng.queue or any(r is not None for r in eng.slots):
        before = eng.stats.steps
        eng.step()
        steps += 1
        assert eng.stats.steps - before <= 8
    assert len(reads) == steps == eng.stats.dispatches


def test_stop_tokens_end_sequences(weights):
    plain, _ = _generate(weights, sampling=SAMPLED)
    stop = plain[2][4]
    want = [o[:o.index(stop) + 1] if stop in o else o for o in plain]
    assert want != plain
    got, eng = _generate(weights, sampling=SAMPLED, speculate=2, stop_tokens=(stop,))
    assert got == want
    assert eng.allocator.num_free == 36


def test_sampled_snapshot_continues_identically(weights, runs, tmp_path):
    eng = Engine(MCFG, weights, max_seqs=3, num_blocks=36, prefill_chunk=8,
                 sampling=SAMPLED, speculate=3, tokens_per_dispatch=8)
    reqs = [eng.submit(p, m) for p, m in zip(PROMPTS, MAX_NEW, strict=True)]
    eng.step()
    eng.save(tmp_path / "snap")
    again = Engine.restore(tmp_path / "snap", MCFG, weights)
    assert again.sampling == SAMPLED and again.tokens_per_dispatch == 8
    assert any(r is not None and len(r.output) < r.max_new_tokens for r in again.slots)
    assert again.queue
    again.run_until_done()
    by_prompt = {tuple(r.prompt): r.output for r in again.finished + eng.finished}
    assert [by_prompt[tuple(r.prompt)] for r in reqs] == runs["spec"][0]


def test_bad_engine_settings_are_refused(weights):
    with pytest.raises(EngineError, match=r"stop token\(s\) \[37\] outside the vocabulary "
                                          r"\[0, 37\)"):
        Engine(MCFG, weights, max_seqs=2, num_blocks=24, stop_tokens=(36, 37))
    with pytest.raises(EngineError, match=r"speculate=4 drafts need 5 verify rows"):
        Engine(MCFG, weights, max_seqs=2, num_blocks=24, speculate=4)
    with pytest.raises(EngineError, match="tokens_per_dispatch must be a positive integer, got 0"):
        Engine(MCFG, weights, max_seqs=2, num_blocks=24, tokens_per_dispatch=0)
    with pytest.raises(EngineError, match="sampling must be a dsa_jax.sampling.Sampling"):
        Engine(MCFG, weights, max_seqs=2, num_blocks=24, sampling="greedy")
    eng = Engine(MCFG, weights, max_seqs=2, num_blocks=24)
    with pytest.raises(EngineError, match="exceeds max_context 96"):
        eng.submit([1] * 90, 10)
