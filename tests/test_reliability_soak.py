"""Engine soak: thousands of steps over many sequences with random admission, completion,
speculation and rejection. Every step checks the allocator's invariants on the host; sampled
steps check the device state against the host's view (lengths, block rows, no block shared);
sampled finished requests are checked token by token against the fp32 reference model.

CI-sized by default (about 2000 engine steps); `pytest --long` runs 20000.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import reference
from dsa_jax.engine import Engine, ModelConfig, init_model
from dsa_jax.model import unfold_state
from dsa_jax.projection import rms_norm
from dsa_jax.shapes import ODD
from dsa_jax.state import mapped_twice
from dsa_jax.testing import random_hf_numpy
from dsa_jax.weights import fold_weights

# fp32 caches and weights: the engine's logits are the reference's to fp32 rounding.
CFG = ODD.replace(indexer_types=("full", "shared"), hidden_size=32, num_heads=2,
                  q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, v_head_dim=8,
                  index_n_heads=2, index_head_dim=8, index_topk=8, index_kpool=4,
                  max_context=64, block_size=4, max_verify=3)
MCFG = ModelConfig(CFG, vocab_size=11)
# Logits whose top two are closer than this may be ordered either way by fp32 rounding.
TIE = 1e-4


def _model():
    rng = np.random.default_rng(0)
    hf = [random_hf_numpy(CFG, rng, kind == "full") for kind in CFG.indexer_types]
    weights = init_model(MCFG, jax.random.key(0), tuple(fold_weights(CFG, t) for t in hf))
    return hf, weights


@jax.jit
def _reference_logits(hf, weights, tokens):
    """The toy model of dsa_jax.engine over one sequence `tokens [Tmax]`, every block by
    `dsa_jax.reference` (dense, fp32): logits [Tmax, V]. Causal, so padding after the real
    tokens changes no earlier row."""
    h = weights.embed[tokens]
    sel = None
    for i, layer_hf in enumerate(hf):
        out = reference.forward(CFG, layer_hf, rms_norm(h, weights.norms[i], CFG.rms_norm_eps),
                                shared_sel=None if "indexer.wk.weight" in layer_hf else sel)
        sel = out.sel
        h = h + out.y
    h = rms_norm(h, weights.final_norm, CFG.rms_norm_eps)
    return jnp.einsum("td,vd->tv", h, weights.lm_head.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def check_tokens(hf, weights, req) -> int:
    """Teacher-forced: each generated token is the reference's argmax after the tokens before
    it, unless the reference's top two logits tie within TIE. Returns tokens compared."""
    tokens = np.zeros(CFG.max_context, np.int32)
    seq = req.prompt + req.output
    tokens[:len(seq)] = seq
    logits = np.asarray(_reference_logits(hf, weights, jnp.asarray(tokens)))
    for i, tok in enumerate(req.output):
        row = logits[len(req.prompt) - 1 + i]
        if tok != int(np.argmax(row)):
            top2 = np.sort(row)[-2:]
            assert top2[1] - row[tok] <= TIE and top2[1] - top2[0] <= TIE, (req.prompt, i)
    return len(req.output)


def check_host(eng: Engine) -> None:
    """The allocator's and the slots' invariants (host only: free every step)."""
    eng.allocator.check_invariants()
    owners = eng.allocator.owners()
    held = []
    for slot, req in enumerate(eng.slots):
        if req is None:  # (its device length and row stay stale until the next admission)
            assert slot not in owners.values()
            continue
        need = -(-(len(req.prompt) + req.max_new_tokens + eng.speculate) // CFG.block_size)
        assert len(req.blocks) == need and all(owners[b] == slot for b in req.blocks)
        assert sorted(b for b, s in owners.items() if s == slot) == sorted(req.blocks)
        assert eng.lengths[slot] == len(req.prompt) + len(req.output) - 1
        assert 1 <= len(req.output) <= req.max_new_tokens
        held += req.blocks
    assert len(held) == len(set(held)) == len(owners)


def check_device(eng: Engine) -> None:
    """The device state agrees with the host: lengths in every layer, each live slot's block
    row, no physical block mapped twice in the rows a step reads."""
    live = np.asarray([r is not None for r in eng.slots])  # free slots hold stale values
    for st in unfold_state(MCFG, eng.serving.model):
        lengths, index_lengths, tables = (np.asarray(a) for a in jax.device_get(
            (st.lengths, st.index_lengths, st.block_tables)))
        assert lengths[live].tolist() == eng.lengths[live].tolist()
        if st.index_k.shape[1]:
            assert (index_lengths == lengths).all()
        for slot, req in enumerate(eng.slots):
            if req is not None:
                assert tables[slot, :len(req.blocks)].tolist() == req.blocks
        read = (np.arange(tables.shape[1])[None] < -(-lengths // CFG.block_size)[:, None])
        assert mapped_twice(tables, read & live[:, None], eng.allocator.num_blocks) is None


@pytest.mark.long
def test_engine_soak(pytestconfig):
    long_run = pytestconfig.getoption("--long")
    steps = 20000 if long_run else 2000
    hf, weights = _model()
    rng = np.random.default_rng(1 if long_run else 0)
    eng = Engine(MCFG, weights, max_seqs=4, num_blocks=40, speculate=2, prefill_chunk=8)
    submitted, checked, compared, seen = [], 0, 0, 0
    for i in range(steps):
        if rng.random() < 0.3 and len(eng.queue) < 6:
            # Repetitive prompts, so the n-gram drafter finds continuations (some rejected).
            motif = list(rng.integers(0, MCFG.vocab_size, size=int(rng.integers(1, 5))))
            prompt = (motif * 20)[:int(rng.integers(1, 24))]
            submitted.append(eng.submit(prompt, int(rng.integers(1, 36))))
        eng.step()
        check_host(eng)
        if i % 97 == 0:
            check_device(eng)
        for req in eng.finished[seen:]:  # every 3rd finished request against the reference
            if (seen := seen + 1) % 3 == 0 or long_run:
                compared += check_tokens(hf, weights, req)
                checked += 1
    eng.run_until_done()
    check_host(eng)
    check_device(eng)
    assert eng.allocator.num_free == 40 and not eng.allocator.owners()
    assert all(len(r.output) == r.max_new_tokens for r in submitted)
    st = eng.stats
    assert 0 < st.accepted < st.drafted  # speculation was accepted and rejected
    assert len(eng.finished) == len(submitted) > steps // 20
    assert checked > 30 and compared > 300, (checked, compared)
