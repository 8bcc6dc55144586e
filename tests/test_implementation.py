"""The op registry, the shared kernel helpers and the shipped-config lookup."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import ImplementationError
from dsa_jax.implementation import OPS, Op, pool_topk_op, resolve
from dsa_jax.pallas import common
from dsa_jax.pallas.pool_scores import PoolScoresTuning
from dsa_jax.shapes import CONFIG_DIR, load_config, shipped_configs, tiny


def _cfg(implementation):
    return types.SimpleNamespace(implementation=implementation)


def _recording_op(**extra):
    calls = []
    op = Op("probe", lambda a, *, scale: calls.append(("reference", a, scale)) or "ref",
            lambda a, *, scale, interpret, **kw: calls.append(("kernel", a, scale, interpret,
                                                               kw)) or "kernel", **extra)
    return op, calls


def test_op_runs_what_the_config_names():
    op, calls = _recording_op()
    assert op(_cfg("xla"), 3, scale=2.0, kernel_options={"hint": 1}) == "ref"
    assert op(_cfg("pallas-interpret"), 4, scale=5.0, kernel_options={"hint": 1}) == "kernel"
    assert calls == [("reference", 3, 2.0), ("kernel", 4, 5.0, True, {"hint": 1})]
    if jax.default_backend() != "gpu":
        assert op(_cfg("auto"), 5, scale=1.0) == "ref"
        with pytest.raises(ImplementationError, match="pallas-interpret"):
            op(_cfg("pallas"), 6, scale=1.0)


def test_op_runs_the_reference_where_the_kernel_does_not_cover_the_shape():
    op, calls = _recording_op(kernel_covers=lambda a, *, scale: a < 10)
    op(_cfg("pallas-interpret"), 9, scale=1.0)
    op(_cfg("pallas-interpret"), 10, scale=1.0)
    assert [c[0] for c in calls] == ["kernel", "reference"]
    wide = jnp.zeros((2, 4097), jnp.float32)
    assert not pool_topk_op.kernel_covers(wide, 3)  # past KERNEL_MAX_P: lax.top_k


def test_every_op_is_registered_under_its_name():
    assert sorted(OPS) == ["index_write", "latent_write", "matmul", "meta_matmul", "per_head",
                           "pool_scores", "pool_topk", "rms_norm", "scaled_q_abs",
                           "sparse_attend", "topk_matmul"]
    assert all(name == op.name for name, op in OPS.items())
    assert resolve("xla") == "xla"


def test_row_gemms_follow_the_gemm_field_the_weights_and_the_implementation():
    """`gemm="auto"` takes the row-invariant GEMMs for bf16 weights where the kernels run;
    never under "xla" (XLA's GEMMs everywhere there, decode padded to max_verify rows)."""
    from dsa_jax.implementation import row_gemms
    from dsa_jax.shapes import ODD

    bf16 = ODD.replace(param_dtype="bfloat16")
    assert row_gemms(bf16.replace(implementation="pallas-interpret"))  # auto: the kernels
    assert not row_gemms(bf16.replace(implementation="pallas-interpret", gemm="xla"))
    assert not row_gemms(ODD.replace(implementation="pallas-interpret"))  # fp32 weights
    assert not row_gemms(bf16.replace(implementation="xla", gemm="pallas"))


def test_next_pow2():
    assert [common.next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 17, 64, 65)] == \
        [1, 1, 2, 4, 4, 8, 32, 64, 128]


def test_fp8_quantize_saturates_and_other_dtypes_cast():
    c = jnp.array([1000.0, -1000.0, 3.0, -0.3], jnp.float32)
    got = common.quantize(c, jnp.float32(0.5), jnp.float8_e4m3fn)
    assert got.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  [448.0, -448.0, 6.0, np.float32(jnp.float8_e4m3fn(-0.6))])
    np.testing.assert_array_equal(np.asarray(common.quantize(c, jnp.float32(0.5), jnp.bfloat16)),
                                  np.asarray(c.astype(jnp.bfloat16)))


def test_sm_count_reads_the_device_or_says_its_default():
    assert common.sm_count(types.SimpleNamespace(core_count=78)) == 78
    assert common.sm_count(types.SimpleNamespace()) == common.DEFAULT_SM_COUNT
    if jax.default_backend() == "cpu":
        assert common.sm_count() == common.DEFAULT_SM_COUNT


def test_tuning_overrides_by_keyword_and_unknown_names_raise():
    tuned = common.with_overrides(PoolScoresTuning(), {"backend": "triton"})
    assert tuned == PoolScoresTuning(backend="triton")
    assert common.with_overrides(PoolScoresTuning(), {}) == PoolScoresTuning()
    with pytest.raises(TypeError, match=r"no field\(s\) \['block_p'\].*'backend'"):
        common.with_overrides(PoolScoresTuning(), {"block_p": 16})


def test_load_config_by_name_or_path(tmp_path):
    assert shipped_configs() == ["glm5.3-flash", "tiny"]
    path = tmp_path / "mine.json"
    path.write_text(open(f"{CONFIG_DIR}/tiny.json").read())
    assert load_config(str(path), max_context=256) == tiny(max_context=256)
    with pytest.raises(FileNotFoundError, match=r"'tiny\.jsn'.*\['glm5\.3-flash', 'tiny'\]"):
        load_config("tiny.jsn")
