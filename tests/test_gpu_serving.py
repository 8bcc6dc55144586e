"""On the GPU (`pytest -m gpu`): the serving invariants that must hold where the kernels are
compiled, not only on the CPU, bit for bit (`==`). With tests/test_serving_paths.py's GLM-shape
decode_k check and tests/test_model.py's scanned == unrolled at GLM shapes, these hold what
the serving loop promises: the device loop equals the per-step Python loop, and speculative
tokens equal plain tokens (n-gram drafter, the target as its own draft model, a scripted
drafter on a 16K context), greedy and top-p sampled; the engine's speculation and
`dsa-jax parity` compiled. Their CPU twins are in tests/test_serve_loop.py."""

import io
from contextlib import redirect_stdout

import jax
import loop_checks
import pytest

from dsa_jax import parity
from dsa_jax.engine import Engine, ModelConfig, init_model
from dsa_jax.shapes import glm53_flash, tiny

pytestmark = pytest.mark.gpu

# GLM-5.3-Flash blocks (full, shared), a 4K context: the prompts (past the selection's width,
# 2051 tokens) make the top-k choose among the pools.
GLM = glm53_flash(implementation="pallas", max_context=4096, indexer_types=("full", "shared"))
TINY = tiny(implementation="pallas", indexer_types=("full", "shared") * 2)


def _engine_tokens(weights, mcfg, speculate):
    eng = Engine(mcfg, weights, max_seqs=2, num_blocks=64, speculate=speculate,
                 tokens_per_dispatch=8)
    prompts = [[(7 * i + 3 * n) % 256 for i in range(n)] for n in (40, 90, 17)]
    reqs = [eng.submit(p, 40) for p in prompts]
    eng.run_until_done()
    return [r.output for r in reqs]


def test_engine_speculative_tokens_equal_plain_tokens_compiled():
    mcfg = ModelConfig(tiny(implementation="pallas"), vocab_size=256)
    weights = init_model(mcfg, jax.random.key(0))
    assert _engine_tokens(weights, mcfg, 3) == _engine_tokens(weights, mcfg, 0)


def test_dsa_jax_parity_passes_on_the_gpu():
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = parity.main([])
    assert code == 0, buf.getvalue()


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("cfg", [GLM, TINY], ids=["glm53_flash", "tiny"])
def test_device_loop_equals_python_loop_and_speculation_equals_plain(cfg, mode):
    """Three sequences (limits 23, 9, 30), 8 tokens per dispatch: the device loop ==
    the per-step Python loop; 3 drafts a round from the n-gram drafter and from the target as
    its own draft model == plain decoding."""
    got = loop_checks.loop_checks(cfg, 256, (mode,))
    assert len(got) == 4 and [k for k, ok in got.items() if not ok] == []


def test_the_checks_hold_for_programs_that_copy_their_weights():
    """`Program(weights_in_place=False)` (XLA's own GEMM choice): the same loop checks."""
    got = loop_checks.loop_checks(TINY, 256, in_place=False)
    assert len(got) == 8 and [k for k, ok in got.items() if not ok] == []


def test_speculation_equals_plain_on_a_full_16k_context():
    """The `spec-b1-l8-k3` bench point's model (8 GLM-5.3-Flash layers, 16K context, caches
    filled with random values almost to the end): 32 tokens plain, then speculating with a
    scripted drafter right 7 times in 10, from the same state: the same tokens."""
    cfg = glm53_flash(implementation="pallas", indexer_types=("full", "shared") * 4)
    got = loop_checks.scripted_speculation(cfg, 256, 32)
    assert got["speculative"] == got["plain"] and len(got["plain"]) == 32
    assert 0 < got["kept"] < got["drafted"]  # drafts were kept and drafts were rejected
