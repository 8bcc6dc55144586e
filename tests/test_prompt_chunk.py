"""A prompt batch the kernels cannot address in one step is cut into chunks that fit
(`dsa_jax.prompt_chunk`): the engine's prefill of 64 GLM-5.3-Flash prompts at a chunk of 1024
rows would pass the Triton kernels' 32-bit offsets (`KernelLimitError` while tracing); the
engine prefills at the largest chunk that fits instead."""

import jax
import jax.numpy as jnp
import pytest

from dsa_jax import KernelLimitError, prompt_chunk
from dsa_jax.engine import Engine
from dsa_jax.model import ModelConfig, init_model
from dsa_jax.pallas import common
from dsa_jax.shapes import ODD, glm53_flash
from dsa_jax.state import DsaState, expected_state_fields
from dsa_jax.step import step
from dsa_jax.weights import DsaWeights, expected_weight_fields


def _trace(cfg, b, rows, nb):
    shapes = lambda f: {k: None if v is None else jax.ShapeDtypeStruct(*v) for k, v in f.items()}
    w = DsaWeights(**shapes(expected_weight_fields(cfg, True)))
    s = DsaState(**shapes(expected_state_fields(cfg, b, nb, True)))
    x = jax.ShapeDtypeStruct((b, rows, cfg.hidden_size), jnp.float32)
    n = jax.ShapeDtypeStruct((b,), jnp.int32)
    return jax.eval_shape(lambda w, s, x, n: step(cfg, w, s, x, n), w, s, x, n)


def test_64_glm_prompts_at_1024_rows_are_cut_to_the_largest_chunk_that_fits():
    cfg = glm53_flash(implementation="pallas-interpret", max_context=4096)
    nb = 64 * cfg.max_context // cfg.block_size
    with pytest.raises(KernelLimitError, match=r"matmul's v \(65536, 64, 512\)"):
        _trace(cfg, 64, 1024, nb)
    prompt_chunk.fits.cache_clear()
    assert prompt_chunk.largest_chunk(cfg, 64, nb, 1024) == 1023  # 65472 rows
    _trace(cfg, 64, 1023, nb)  # traces
    assert prompt_chunk.largest_chunk(cfg, 32, nb, 1024) == 1024  # 32768 rows fit as asked
    assert prompt_chunk.largest_chunk(cfg.replace(implementation="xla"), 64, nb, 1024) == 1024


def test_the_engine_prefills_at_the_chunk_that_fits(monkeypatch):
    """The addressing limit lowered so that the tiny-shape engine meets it: its prefill chunk
    is the largest that traces, and a chunk that fits is kept."""
    cfg = ODD.replace(implementation="pallas-interpret", param_dtype="bfloat16")
    mcfg = ModelConfig(cfg, vocab_size=11)
    weights = init_model(mcfg, jax.random.key(0))
    prompt_chunk.fits.cache_clear()
    monkeypatch.setattr(common, "TRITON_OFFSET_ELEMENTS", 4 * 40 * 3 * 24)  # rows x H x C
    try:
        engine = Engine(mcfg, weights, max_seqs=4, num_blocks=48, prefill_chunk=64)
        chunk = engine.prefill_chunk
        assert 1 <= chunk < 40  # 4 x 40 rows x 3 heads x 24 would reach the limit
        assert prompt_chunk.fits(cfg, 4, 48, chunk)
        assert not prompt_chunk.fits(cfg, 4, 48, chunk + 1)
        assert Engine(mcfg, weights, max_seqs=4, num_blocks=48,
                      prefill_chunk=chunk).prefill_chunk == chunk
    finally:
        prompt_chunk.fits.cache_clear()


def test_a_prefill_too_wide_for_the_kernels_runs_in_chunks_with_the_bits_of_one(monkeypatch):
    """`dsa_jax.prefill` of a width the (lowered) limit refuses runs as prefills of the largest
    chunk that fits, as a chunked prefill does: the selections and lengths of one unsplit
    prefill bit for bit, its outputs within fp32 rounding."""
    import numpy as np

    import dsa_jax
    from dsa_jax.testing import assert_trees_bitwise_equal, copy_tree, random_rows

    cfg = ODD.replace(implementation="pallas-interpret", param_dtype="bfloat16")  # kernel GEMMs
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(2))
    base = dsa_jax.init_state(cfg, 2, kv_scale=0.5)
    x = random_rows(3, 2, 60, cfg.hidden_size)
    counts = np.array([60, 41])
    want = dsa_jax.prefill(cfg, weights, copy_tree(base), x, num_tokens=counts)
    prompt_chunk.fits.cache_clear()
    # Above every weight's and the latent cache's elements, below what 2 x 60 prompt rows
    # need in the GEMMs.
    monkeypatch.setattr(common, "TRITON_OFFSET_ELEMENTS", 8000)
    try:
        chunk = prompt_chunk.largest_chunk(cfg, 2, base.latent.shape[0], 60)
        assert 1 <= chunk < 60  # the prefill is cut
        got = dsa_jax.prefill(cfg, weights, copy_tree(base), x, num_tokens=counts)
    finally:
        prompt_chunk.fits.cache_clear()
    assert_trees_bitwise_equal((got[2], got[1].lengths), (want[2], want[1].lengths))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_the_engine_serves_64_glm_prompts_of_2048_tokens_at_a_chunk_of_1024():
    """The workload that once died in the prompt's output projection (`KernelLimitError`),
    compiled: 64 prompts of 2048 tokens at GLM-5.3-Flash shapes, `prefill_chunk=1024` asked,
    prefilled at the largest chunk that fits and decoded."""
    cfg = glm53_flash(implementation="pallas", max_context=4096)
    mcfg = ModelConfig(cfg, vocab_size=256)
    weights = init_model(mcfg, jax.random.key(0))
    prompt_chunk.fits.cache_clear()
    eng = Engine(mcfg, weights, max_seqs=64, num_blocks=64 * 4096 // cfg.block_size,
                 prefill_chunk=1024)
    assert eng.prefill_chunk == 1023
    reqs = [eng.submit([(7 * i + 3 * n) % 256 for i in range(2048)], 3) for n in range(64)]
    eng.run_until_done()
    assert [len(r.output) for r in reqs] == [3] * 64
    assert all(0 <= t < 256 for r in reqs for t in r.output)
