"""Loading under other checkpoint prefixes, and the per-rank (tensor-parallel) folds."""

import chex
import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import dsa_jax
from dsa_jax.shapes import ODD
from dsa_jax.testing import assert_trees_bitwise_equal
from dsa_jax.weights import WeightError, head_weight_scale


def test_multimodal_prefix_loads_the_named_layer(tmp_path):
    cfg = ODD
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(0))
    other = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(1), has_indexer=False)
    tensors = {f"model.language_model.layers.3.self_attn.{k}": v for k, v in hf.items()}
    tensors.update({f"model.language_model.layers.4.self_attn.{k}": v for k, v in other.items()})
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    got = dsa_jax.read_hf_tensors(path, cfg, 3)
    assert_trees_bitwise_equal(got, hf)
    shared = dsa_jax.load_hf_layer(path, cfg, 4)
    assert not shared.has_indexer and shared.k_norm_w is None
    with pytest.raises(WeightError, match="no attention tensors for layer 0"):
        dsa_jax.load_hf_layer(path, cfg, 0)


def test_tensor_parallel_ranks_partition_the_heads():
    cfg = ODD.replace(num_heads=6, tp_degree=3)
    full_cfg = cfg.replace(tp_degree=1)
    hf = dsa_jax.init_random_hf_tensors(full_cfg, jax.random.key(2))
    full = dsa_jax.fold_weights(full_cfg, hf)
    ranks = [dsa_jax.fold_weights(cfg, hf, tp_rank=r) for r in range(3)]
    hdn = cfg.local_heads * cfg.qk_nope_head_dim
    np.testing.assert_array_equal(np.concatenate([w.u_k for w in ranks]), full.u_k)
    np.testing.assert_array_equal(np.concatenate([w.u_v for w in ranks]), full.u_v)
    np.testing.assert_array_equal(np.concatenate([w.o_proj for w in ranks], axis=1),
                                  full.o_proj)
    np.testing.assert_array_equal(np.concatenate([w.q_proj for w in ranks]), full.q_proj)
    assert ranks[0].q_proj.shape == (hdn, cfg.q_lora_rank)
    for w in ranks:  # the indexer and the input projection: replicated, degree-free shapes
        np.testing.assert_array_equal(w.qi_proj, full.qi_proj)
        np.testing.assert_array_equal(w.x_proj, full.x_proj)
    with pytest.raises(WeightError, match=r"tp_rank 3 is outside \[0, tp_degree=3\)"):
        dsa_jax.fold_weights(cfg, hf, tp_rank=3)


def test_head_weight_fold_is_the_two_scales():
    cfg = ODD
    hf = dsa_jax.init_random_hf_tensors(cfg.replace(param_dtype="float32"), jax.random.key(3))
    w = dsa_jax.fold_weights(cfg.replace(param_dtype="float32"), hf)
    rows = w.x_proj[-cfg.index_n_heads:]
    want = hf["indexer.weights_proj.weight"] * cfg.index_n_heads ** -0.5 \
        * cfg.index_head_dim ** -0.5
    chex.assert_trees_all_close(rows, want, rtol=1e-6)
    assert head_weight_scale(cfg) == pytest.approx(want[0, 0] / hf[
        "indexer.weights_proj.weight"][0, 0])
