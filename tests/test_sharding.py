"""Tensor and data parallelism over 8 host devices against one device (tests/mesh_check.py, in
one subprocess for every case), and the mesh API's errors in this process."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import dsa_jax
from dsa_jax import sharding
from dsa_jax.layer import StepError
from dsa_jax.shapes import ODD
from dsa_jax.testing import assert_trees_bitwise_equal

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_with_devices(script: str, devices: int, args=(), timeout: int = 400):
    """Run `script` in a subprocess that sees `devices` CPU devices. The XLA CPU backend at
    optimization level 0 compiles in about half the time; both sides of every comparison run
    in that one process, under the same flags."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                         "--xla_backend_optimization_level=0 "
                         "--xla_llvm_disable_expensive_passes=true",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, script, *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("meshes, weights", [
    (((2, 4),), "bf16"),  # dp and tp together, the split selection on
    pytest.param(((1, 2), (1, 4), (1, 8), (4, 2), (8, 1)), "bf16", marks=pytest.mark.long),
    pytest.param(((2, 4),), "fp8", marks=pytest.mark.long),  # fp8 blocks cut per rank
])
def test_every_mesh_matches_one_device(meshes, weights):
    out = run_with_devices(os.path.join(HERE, "mesh_check.py"), 8,
                           [f"{dp}x{tp}" for dp, tp in meshes] + ["fp8"] * (weights == "fp8"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    extras = ["extras"] if (2, 4) in meshes else []  # mesh_check runs them on the (2, 4) mesh
    for case in [f"dp {dp} x tp {tp}" for dp, tp in meshes] + extras:
        assert f"{case}: ok" in out.stdout, case
    assert "mesh == one device: ok" in out.stdout


def test_mesh_errors_name_the_values():
    with pytest.raises(sharding.ShardingError, match=r"a 2 x 3 \(dp x tp\) mesh needs 6 "):
        sharding.mesh(2, 3)
    with pytest.raises(sharding.ShardingError, match="tp must be a positive integer, got 0"):
        sharding.mesh(1, 0)
    m = sharding.mesh(1, 1)
    assert sharding.degrees(m) == (1, 1)
    cfg = ODD.replace(num_heads=6, tp_degree=2)
    with pytest.raises(sharding.ShardingError, match=r"cfg.tp_degree is 2 but the mesh's tp "
                                                     r"axis has 1 devices"):
        sharding.init_state(cfg, m, 2)


@pytest.mark.parametrize("cfg", [ODD, ODD.replace(param_dtype="float8_e4m3fn",
                                                  weight_block=(4, 8))], ids=["f32", "fp8"])
def test_one_device_mesh_is_the_plain_step(cfg):
    """dp = tp = 1: the mapped step is the layer's step, bitwise (fp8 weights too)."""
    m = sharding.mesh(1, 1)
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(0))
    w = sharding.shard_weights(cfg, hf, m)
    x = jax.random.normal(jax.random.key(1), (3, 9, cfg.hidden_size))
    s = sharding.init_state(cfg, m, 3, kv_scale=0.5)
    y, s, sel = sharding.dp_tp_prefill(cfg, m, w, s, x, num_tokens=np.array([9, 4, 7]))
    y1, s1, sel1 = dsa_jax.prefill(cfg, dsa_jax.fold_weights(cfg, hf),
                                   dsa_jax.init_state(cfg, 3, kv_scale=0.5), x,
                                   num_tokens=np.array([9, 4, 7]))
    assert_trees_bitwise_equal((y, sel, s.latent), (y1, sel1, s1.latent))
    # The first release's names (README): a replicated state and tp_prefill, the same step.
    y2, _, _ = sharding.tp_prefill(cfg, sharding.tp_mesh(cfg), w,
                                   sharding.replicate(dsa_jax.init_state(cfg, 3, kv_scale=0.5),
                                                      m), x, num_tokens=np.array([9, 4, 7]))
    assert_trees_bitwise_equal(y2, y1)
    # Host checks run per dp shard before anything is written; the state stays usable.
    with pytest.raises(StepError, match=r"dp shard 0 .*sequence 0: writing 90 token\(s\) at "
                                        r"position 9 would reach 99, past max_context 96"):
        sharding.dp_tp_prefill(cfg, m, w, s, jax.numpy.ones((3, 90, cfg.hidden_size)))
    y, s, _ = sharding.dp_tp_decode(cfg, m, w, s, x[:, 0])
    assert np.asarray(s.lengths).tolist() == [10, 5, 8]


def test_split_rule():
    """The selection splits over tp where asked and possible, and by default where every rank
    gets at least SPLIT_MIN_SEQS_PER_RANK sequences; an impossible split is refused."""
    cfg = ODD.replace(num_heads=6, tp_degree=2)
    least = sharding.steps.SPLIT_MIN_SEQS_PER_RANK
    assert sharding.split_rule(cfg, 2 * least)
    assert not sharding.split_rule(cfg, 2 * least - 2)
    assert not sharding.split_rule(cfg, 2 * least + 1)  # does not divide
    assert sharding.split_rule(cfg, 2, True) and not sharding.split_rule(cfg, 64, False)
    assert not sharding.split_rule(ODD, 64) and not sharding.split_rule(ODD, 64, True)  # tp 1
    with pytest.raises(sharding.ShardingError, match=r"split_selection=True: a dp shard's 3 "
                                                     r"sequences do not split over tp=2"):
        sharding.split_rule(cfg, 3, True)


@pytest.mark.long
def test_split_select_kernels_and_a_far_rewind_on_a_mesh():
    """tests/mesh_rewind_select_check.py on 4 host devices: the split selection with the
    kernels (the score kernel's first sequence traced from the rank) == one device, bitwise;
    `sharding.rewind` to pool boundaries past Rr below the mark bounds the kept mark, and the
    decodes after it give the bits of a state prefilled to those lengths."""
    out = run_with_devices(os.path.join(HERE, "mesh_rewind_select_check.py"), 4)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "split select kernels: ok" in out.stdout
    assert "sharded rewind far: ok" in out.stdout
    assert "row gemms on a mesh: ok" in out.stdout
