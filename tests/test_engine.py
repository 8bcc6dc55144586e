"""The serving engine: allocator safety, admission and release, speculation invariance."""

import jax
import numpy as np
import pytest

from dsa_jax.engine import (
    BlockAllocator,
    Engine,
    EngineError,
    ModelConfig,
    OutOfBlocks,
    init_model,
    ngram_draft,
)
from dsa_jax.shapes import ODD

MCFG = ModelConfig(ODD.replace(indexer_types=("full", "shared"), cache_dtype="float8_e4m3fn",
                               index_cache_dtype="bfloat16"), vocab_size=37)


@pytest.fixture(scope="module")
def weights():
    return init_model(MCFG, jax.random.key(0))


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    # Repetitive prompts so the n-gram drafter has something to find.
    return [list(rng.integers(0, 5, size=int(rng.integers(3, 30)))) for _ in range(n)]


def _generate(weights, speculate, prompts, max_new, max_seqs=3, num_blocks=24):
    eng = Engine(MCFG, weights, max_seqs=max_seqs, num_blocks=num_blocks, speculate=speculate,
                 prefill_chunk=8)
    reqs = [eng.submit(p, m) for p, m in zip(prompts, max_new, strict=True)]
    eng.run_until_done()
    return [r.output for r in reqs], eng


def test_speculative_tokens_equal_plain_tokens(weights):
    prompts = _prompts(5)
    max_new = [12, 3, 20, 7, 15]
    plain, eng0 = _generate(weights, 0, prompts, max_new)
    spec, eng3 = _generate(weights, 3, prompts, max_new)
    assert spec == plain
    assert [len(o) for o in plain] == max_new
    assert eng3.stats.drafted > 0 and eng3.stats.accepted > 0  # speculation really ran
    assert eng3.stats.steps < eng0.stats.steps


def test_allocator_never_double_hands_and_frees_everything(weights):
    # 7 requests of very different lengths through 3 slots and a tight pool: they queue,
    # finish out of order, and their blocks are reused.
    prompts = _prompts(7, seed=1)
    max_new = [2, 40, 5, 1, 25, 9, 3]
    eng = Engine(MCFG, weights, max_seqs=3, num_blocks=16, speculate=2, prefill_chunk=8)
    reqs = [eng.submit(p, m) for p, m in zip(prompts, max_new, strict=True)]
    seen_owners = []
    while eng.queue or any(r is not None for r in eng.slots):
        eng.step()
        owners = eng.allocator.owners()
        live = {r.slot: set(r.blocks) for r in eng.slots if r is not None}
        for slot, blocks in live.items():
            assert all(owners[b] == slot for b in blocks)
        all_blocks = [b for bs in live.values() for b in bs]
        assert len(all_blocks) == len(set(all_blocks))
        seen_owners.append(len(owners))
    assert eng.allocator.num_free == 16 and not eng.allocator.owners()
    assert [len(r.output) for r in reqs] == max_new
    order = [eng.finished.index(r) for r in reqs]
    assert order != sorted(order)  # finished out of submission order
    assert max(seen_owners) > 0


def test_block_allocator_errors():
    alloc = BlockAllocator(4)
    got = alloc.allocate(3, owner=0)
    with pytest.raises(OutOfBlocks, match="2 blocks wanted, 1 of 4 free"):
        alloc.allocate(2, owner=1)
    alloc.release(got)
    with pytest.raises(ValueError, match="released but not allocated"):
        alloc.release(got[:1])


def test_bad_requests_are_refused(weights):
    eng = Engine(MCFG, weights, max_seqs=2, num_blocks=24, speculate=1)
    assert eng.program.weights_in_place is True  # the default: the stacked weights in place
    with pytest.raises(EngineError, match=r"exceeds max_context 96"):
        eng.submit([1] * 90, 10)
    with pytest.raises(EngineError, match=r"outside the vocabulary \[0, 37\)"):
        eng.submit([1, 99], 3)
    with pytest.raises(EngineError, match=r"speculate=4 drafts need 5 verify rows; max_verify "
                                          r"is 4"):
        Engine(MCFG, weights, max_seqs=2, num_blocks=24, speculate=4)
    with pytest.raises(EngineError, match=r"weights_in_place must be a bool, got 'yes'"):
        Engine(MCFG, weights, max_seqs=2, num_blocks=24, weights_in_place="yes")


def test_ngram_draft():
    assert ngram_draft([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert ngram_draft([5, 6, 7], 2) == []
    assert ngram_draft([4, 8, 4], 2) == [8, 4]


def test_snapshot_restores_and_continues_identically(weights, tmp_path):
    prompts = _prompts(4, seed=3)
    max_new = [14, 6, 18, 9]
    # One round per step: the snapshot falls mid-run. weights_in_place off (not the default):
    # the snapshot keeps it (on the CPU its programs compute the default's bits).
    eng = Engine(MCFG, weights, max_seqs=2, num_blocks=24, speculate=2, prefill_chunk=8,
                 tokens_per_dispatch=1, weights_in_place=False)
    reqs = [eng.submit(p, m) for p, m in zip(prompts, max_new, strict=True)]
    for _ in range(4):
        eng.step()
    eng.save(tmp_path / "snap")
    eng.run_until_done()
    want = {tuple(r.prompt): r.output for r in reqs}

    again = Engine.restore(tmp_path / "snap", MCFG, weights)
    assert again.program.weights_in_place is False
    live = [r for r in again.slots if r is not None] + list(again.queue)
    assert live and all(len(r.output) < r.max_new_tokens for r in live)
    again.run_until_done()
    for r in again.finished:
        assert r.output == want[tuple(r.prompt)]
    assert again.allocator.num_free == 24
