"""Batch invariance (`DsaConfig.batch_invariant`, docs/decisions.md): a sequence's outputs and
selections are the same bits alone and inside a batch of random others, at a random slot,
with ragged lengths and `active` masks, through a prefill, decodes, a verify, a rewind and
a decode after it; compared with `==`, on the XLA path and the kernels' (pallas-interpret
here, compiled under `pytest -m gpu`). And the engine (batch-invariant by default): a
request's greedy tokens alone equal its tokens amid other traffic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax.engine import Engine
from dsa_jax.model import ModelConfig, init_model
from dsa_jax.shapes import ODD, glm53_flash, tiny
from dsa_jax.testing import random_rows


def _run(cfg, weights, prompt: int, b: int, slot: int, seed: int):
    """The sequence at `slot` of a batch of `b`: its prompt, then 3 decodes (the others
    randomly inactive), a 3-row verify, a rewind of 2 and one more decode. Returns its `y`
    rows and its `sel` rows, stacked."""
    rng = np.random.default_rng(seed)
    d = cfg.hidden_size
    state = dsa_jax.init_state(cfg, b, kv_scale=0.5)
    x = np.array(random_rows(seed, b, prompt, d))
    x[slot] = np.asarray(random_rows(1, prompt, d))
    counts = rng.integers(1, prompt + 1, b)
    counts[slot] = prompt
    y, state, sel = dsa_jax.prefill(cfg, weights, state, jnp.asarray(x), num_tokens=counts)
    ys, sels = [y[slot]], [sel[slot]]
    for t in range(3):
        x = np.array(random_rows(seed + 10 + t, b, d))
        x[slot] = np.asarray(random_rows(20 + t, d))
        active = rng.random(b) < 0.7
        active[slot] = True
        y, state, sel = dsa_jax.decode(cfg, weights, state, jnp.asarray(x), active=active)
        ys.append(y[slot][None])
        sels.append(sel[slot][None])
    x = np.array(random_rows(seed + 30, b, 3, d))
    x[slot] = np.asarray(random_rows(30, 3, d))
    y, state, sel = dsa_jax.decode_k(cfg, weights, state, jnp.asarray(x))
    ys.append(y[slot])
    sels.append(sel[slot])
    lengths = np.asarray(state.lengths)
    state = dsa_jax.rewind(cfg, state, np.maximum(lengths - rng.integers(0, 3, b), 1)
                           if b > 1 else lengths - 2)
    if b > 1:  # the sequence itself rewinds by 2 in every batch
        state = dsa_jax.rewind(cfg, state, np.where(np.arange(b) == slot, lengths - 2,
                                                    np.asarray(state.lengths)))
    x = np.array(random_rows(seed + 40, b, d))
    x[slot] = np.asarray(random_rows(40, d))
    y, state, sel = dsa_jax.decode(cfg, weights, state, jnp.asarray(x))
    ys.append(y[slot][None])
    sels.append(sel[slot][None])
    return np.concatenate([np.asarray(a) for a in ys]), np.concatenate(
        [np.asarray(a) for a in sels])


def _check(cfg, prompt: int, batches, key: int = 0):
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(key))
    y1, s1 = _run(cfg, weights, prompt, 1, 0, 100)
    assert np.isfinite(y1).all() and (s1 >= 0).any()
    for b in batches:
        slot = int(np.random.default_rng(b).integers(0, b))
        yb, sb = _run(cfg, weights, prompt, b, slot, 200 + b)
        differ = np.any(yb != y1, axis=-1).sum(), np.any(sb != s1, axis=-1).sum()
        assert differ == (0, 0), (f"batch {b}, slot {slot}: y rows / sel rows that differ "
                                  f"from the sequence alone: {differ} of {len(y1)}")


# The tiny block with 150-token prompts (past its 64-token selection: the rows select among
# pools), and the odd-sized one with its fp8 latent and bf16 index cache.
TINY = tiny(max_context=512, batch_invariant=True)
ODD8 = ODD.replace(cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16",
                   batch_invariant=True)
CONFIGS = [pytest.param(TINY, 150, id="tiny"), pytest.param(ODD8, 60, id="odd")]


@pytest.mark.parametrize("cfg, prompt", [
    pytest.param(TINY, 150, id="tiny", marks=pytest.mark.long),  # CI time: odd covers 2, 8
    pytest.param(ODD8, 60, id="odd")])
def test_xla_rows_and_selections_are_the_same_in_any_batch(cfg, prompt):
    _check(cfg.replace(implementation="xla"), prompt, (2, 8))


@pytest.mark.parametrize("cfg, prompt", [
    pytest.param(TINY, 150, id="tiny", marks=pytest.mark.long),  # interpret mode is slow
    pytest.param(ODD8, 60, id="odd")])
def test_kernel_rows_and_selections_are_the_same_in_any_batch(cfg, prompt):
    cfg = cfg.replace(implementation="pallas-interpret", param_dtype="bfloat16")
    _check(cfg, min(prompt, 90), (8,))


@pytest.mark.long
@pytest.mark.parametrize("cfg, prompt", CONFIGS)
def test_xla_rows_and_selections_are_the_same_in_a_batch_of_64(cfg, prompt):
    _check(cfg.replace(implementation="xla"), prompt, (64,))


@pytest.mark.gpu
def test_kernel_rows_and_selections_are_the_same_in_any_batch_at_glm_shapes():
    """Compiled, GLM-5.3-Flash's block with a 1000-token prompt: past the selection's width,
    so each row's attend splits 2051 slots."""
    cfg = glm53_flash(implementation="pallas", max_context=4096, batch_invariant=True)
    _check(cfg, 2100, (2, 8, 64))


def _engine_tokens(mcfg, weights, prompts, **kw):
    eng = Engine(mcfg, weights, max_seqs=len(prompts), num_blocks=16 * len(prompts), **kw)
    reqs = [eng.submit(p, 8) for p in prompts]
    eng.run_until_done()
    return [r.output for r in reqs]


@pytest.mark.parametrize("implementation", [
    "xla", pytest.param("pallas-interpret", marks=pytest.mark.long),  # slow in interpret mode
    pytest.param("pallas", marks=pytest.mark.gpu)])
def test_a_requests_tokens_are_the_same_alone_and_amid_traffic(implementation):
    """Greedy: the same request's tokens alone and in an engine of 3 other requests of other
    lengths (admitted together, finishing at other times)."""
    cfg = tiny(implementation=implementation, max_context=256,
               param_dtype="bfloat16" if implementation != "xla" else "float32")
    mcfg = ModelConfig(cfg, vocab_size=97)
    weights = init_model(mcfg, jax.random.key(3))
    rng = np.random.default_rng(0)
    mine = [int(t) for t in rng.integers(0, 97, 70)]
    others = [[int(t) for t in rng.integers(0, 97, n)] for n in (5, 90, 33)]
    alone = _engine_tokens(mcfg, weights, [mine])[0]
    amid = _engine_tokens(mcfg, weights, others[:2] + [mine] + others[2:])[2]
    assert amid == alone


_DP_SCRIPT = """
import numpy as np, jax, dsa_jax
from dsa_jax import sharding
from dsa_jax.shapes import ODD
cfg = ODD.replace(batch_invariant=True)
hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (8, 40, cfg.hidden_size))
xd = jax.random.normal(jax.random.key(2), (8, cfg.hidden_size))
n = np.array([40, 33, 12, 40, 7, 25, 40, 19])
s1 = dsa_jax.init_state(cfg, 8, kv_scale=0.5)
w1 = dsa_jax.fold_weights(cfg, hf)
y1, s1, sel1 = dsa_jax.prefill(cfg, w1, s1, x, num_tokens=n)
yd1, s1, seld1 = dsa_jax.decode(cfg, w1, s1, xd)
for dp in (2, 8):
    m = sharding.mesh(dp, 1)
    w = sharding.shard_weights(cfg, hf, m)
    s = sharding.init_state(cfg, m, 8, kv_scale=0.5)
    y, s, sel = sharding.dp_tp_prefill(cfg, m, w, s, x, num_tokens=n)
    yd, s, seld = sharding.dp_tp_decode(cfg, m, w, s, xd)
    got = [np.asarray(a) for a in (y, sel, yd, seld)]
    want = [np.asarray(a) for a in (y1, sel1, yd1, seld1)]
    print(dp, all((g == w_).all() for g, w_ in zip(got, want)))
"""


@pytest.mark.long  # CI time (a subprocess of 8 CPU devices, ~16 s)
def test_a_data_parallel_mesh_gives_each_sequence_the_bits_of_one_device():
    """Under `batch_invariant` a sequence's bits do not depend on how many sequences share its
    device either: prefill and decode over 2 and 8 data-parallel shards of 8 sequences (4 and 1
    per shard) == one device holding all 8."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", _DP_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["2", "True", "8", "True"], out.stdout
