"""On the GPU (`pytest -m gpu`): the serving invariants that must hold where the kernels are
compiled, not only on the CPU. With tests/test_serving_paths.py's GLM-shape decode_k check
(bit-identical to serial decodes, TP 1 and the TP 8 rank), these replace the former device
script benchmarks/h200_serving.py."""

import io
from contextlib import redirect_stdout

import jax
import pytest

from dsa_jax import parity
from dsa_jax.engine import Engine, ModelConfig, init_model
from dsa_jax.shapes import tiny

pytestmark = pytest.mark.gpu


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
