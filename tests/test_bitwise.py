"""`dsa_jax.bitwise`: every program the library compiles carries `BITWISE_OPTIONS`, a nested
call inlines, and under `pytest -m gpu` (the H200 run) a batched prefill selects what each
sequence alone selects at GLM-5.3-Flash shapes (XLA's per-program GEMM split-K broke that)."""

import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import BITWISE_OPTIONS, bitwise_jit, nnx, serve  # noqa: F401 (nnx: its programs)
from dsa_jax.bitwise import BitwiseJitted
from dsa_jax.shapes import glm53_flash
from dsa_jax.sharding import steps  # noqa: F401 (its programs)
from dsa_jax.testing import assert_trees_bitwise_equal, copy_tree, random_rows, random_state

# Module-level jitted functions that run no GEMM (padding, a minimum): plain `jax.jit` is fine.
NO_GEMM = {"dsa_jax.nnx:_pad", "dsa_jax.nnx:_unpad", "dsa_jax.sharding.steps:_minimum"}


def _module_programs():
    """Every jitted function held at module level by a dsa_jax module (directly or in a
    dict of programs), as "module:name" -> the function."""
    found = {}
    for name, mod in sorted(sys.modules.items()):
        if not (name == "dsa_jax" or name.startswith("dsa_jax.")):
            continue
        for attr, value in vars(mod).items():
            for i, v in enumerate(value.values() if isinstance(value, dict) else [value]):
                if (not isinstance(v, type) and callable(getattr(v, "lower", None))
                        and callable(getattr(v, "trace", None))):
                    found[f"{name}:{attr}" + (f"[{i}]" if isinstance(value, dict) else "")] = v
    return found


def test_every_library_program_compiles_with_the_bitwise_options():
    importlib.import_module("dsa_jax.engine")
    programs = _module_programs()
    bitwise = {k for k, v in programs.items() if isinstance(v, BitwiseJitted)}
    assert {"dsa_jax.layer:layout_step", "dsa_jax.serve:_RUN[0]", "dsa_jax.serve:_RUN[1]",
            "dsa_jax.sharding.steps:_step_jit", "dsa_jax.nnx:_step"} <= bitwise
    assert set(programs) - bitwise <= NO_GEMM
    for k in bitwise:
        assert BITWISE_OPTIONS.items() <= programs[k].compiler_options.items(), k
    in_place = programs["dsa_jax.serve:_RUN[1]"].compiler_options
    assert serve.IN_PLACE_WEIGHTS.items() <= in_place.items()


def test_nested_call_inlines_and_equals_the_top_level_call():
    f = bitwise_jit(lambda a, b: a @ b + 1)
    a = jax.random.normal(jax.random.key(0), (5, 7))
    b = jax.random.normal(jax.random.key(1), (7, 3))
    top = f(a, b)
    nested = jax.jit(lambda a, b: f(a, b) * 1)(a, b)  # jax refuses options on a nested jit
    np.testing.assert_array_equal(np.asarray(top), np.asarray(nested))


def test_options_that_would_override_the_bitwise_ones_are_refused():
    key = next(iter(BITWISE_OPTIONS))
    with pytest.raises(ValueError, match=key):
        bitwise_jit(lambda a: a, compiler_options={key: 4})
    bitwise_jit(lambda a: a, compiler_options={"xla_gpu_enable_dynamic_slice_fusion": True})


@pytest.mark.gpu
def test_batched_prefill_selects_what_each_sequence_alone_selects_at_glm53_flash_shapes():
    """Two sequences' 128-row prompt chunks in one prefill (256 GEMM rows) against each alone
    (128): the selections and the indexer cache bit for bit, the outputs within bf16 rounding.
    Without the options XLA split the indexer's GEMMs differently at 256 and 128 rows: on the
    H200 42 of these 256 rows selected another pool (2026-11-30)."""
    cfg = glm53_flash(max_context=4096, implementation="pallas")
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(5))
    base = random_state(cfg, weights, 2, 1531, 7, kv_scale=1 / 64, dtype=jnp.bfloat16)
    x = random_rows(8, 2, 128, cfg.hidden_size, dtype=jnp.bfloat16)
    y, both, sel = dsa_jax.prefill(cfg, weights, copy_tree(base), x)
    for s in range(2):
        y_s, alone, sel_s = dsa_jax.prefill(cfg, weights, _one_sequence(copy_tree(base), s),
                                            x[s:s + 1])
        assert_trees_bitwise_equal(sel[s:s + 1], sel_s)
        for name in ("pool_keys", "index_k", "index_g"):
            assert_trees_bitwise_equal(getattr(both, name)[s:s + 1], getattr(alone, name))
        np.testing.assert_allclose(np.asarray(y[s:s + 1], np.float32),
                                   np.asarray(y_s, np.float32), rtol=2 ** -7, atol=2 ** -7)


def _one_sequence(state, s):
    """Sequence `s` of `state` alone (the shared block pool kept whole)."""
    per_seq = ("block_tables", "index_k", "index_g", "pool_keys", "lengths", "index_lengths")
    return state._replace(**{n: getattr(state, n)[s:s + 1] for n in per_seq})
