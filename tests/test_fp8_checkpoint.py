"""fp8 weights in orbax checkpoints (format 6): saved as their blocks with each field's layout
in the metadata, restored bit for bit, converted from an fp8 Hugging Face checkpoint without
dequantizing; a damaged layout or an fp8 field under a bf16 config is refused by name."""

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import dsa_jax
from dsa_jax import checkpoint, fp8
from dsa_jax import testing as T
from dsa_jax.checkpoint_io import CheckpointError
from dsa_jax.shapes import tiny

TINY8 = tiny(param_dtype="float8_e4m3fn", weight_block=(32, 32), implementation="xla")


def _layers(cfg, keys=(1, 2)):
    """A full and a shared layer's fp8 HF tensors, folded."""
    hf = [dsa_jax.init_random_hf_tensors(cfg, jax.random.key(k), has_indexer=i == 0)
          for i, k in enumerate(keys)]
    return hf, [dsa_jax.fold_weights(cfg, t) for t in hf]


def _same(a, b):
    """The same fields, fp8 blocks as blocks (types, blocks and every array's bits)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    T.assert_trees_bitwise_equal(jax.tree.leaves(a), jax.tree.leaves(b))


def test_fp8_weights_save_and_restore_as_their_blocks(tmp_path):
    _, layers = _layers(TINY8)
    path = tmp_path / "w8"
    checkpoint.save_weights(path, TINY8, layers)
    info = checkpoint.read_info(path)
    assert info["version"] == 6 and info["layouts"][0]["o_proj"]["fp8"]["block"] == [32, 32]
    got = checkpoint.restore_weights(path, TINY8.replace(implementation="pallas-interpret"))
    for g, w in zip(got, layers, strict=True):
        _same(g, w)
    assert isinstance(got[0].x_proj, fp8.StackedRows) and got[1].qi_proj is None
    stored = sum(a.nbytes for a in jax.tree.leaves(got))
    dense = sum(a.nbytes for a in jax.tree.leaves(
        [dsa_jax.fold_weights(TINY8.replace(param_dtype="bfloat16"), t) for t in _layers(
            TINY8)[0]]))
    assert stored < 0.52 * dense  # the checkpoint's bytes, not 2x
    with pytest.raises(CheckpointError, match="param_dtype: checkpoint 'float8_e4m3fn'"):
        checkpoint.restore_weights(path, TINY8.replace(param_dtype="bfloat16"))
    with pytest.raises(CheckpointError, match="weight_block: checkpoint"):
        checkpoint.restore_weights(path, TINY8.replace(weight_block=(32, 64)))


def test_convert_keeps_an_fp8_checkpoint_fp8(tmp_path):
    hf, layers = _layers(TINY8, keys=(3, 4))
    src = str(tmp_path / "model.safetensors")
    save_file({f"model.layers.{5 + i}.self_attn.{k}": np.asarray(v)
               for i, t in enumerate(hf) for k, v in t.items()}, src)
    assert checkpoint.convert_hf_checkpoint(src, tmp_path / "c8", TINY8) == [5, 6]
    for g, w in zip(checkpoint.restore_weights(tmp_path / "c8", TINY8), layers, strict=True):
        _same(g, w)
    # the bf16 conversion of the same file: the dequantized weights, as before
    c16 = TINY8.replace(param_dtype="bfloat16")
    checkpoint.convert_hf_checkpoint(src, tmp_path / "c16", c16)
    assert checkpoint.read_info(tmp_path / "c16").get("layouts") is None
    for g, w in zip(checkpoint.restore_weights(tmp_path / "c16", c16), layers, strict=True):
        T.assert_trees_bitwise_equal(tuple(g), tuple(fp8.dense(f) for f in w))


def test_checkpoints_of_format_5_restore_and_weight_block_matters_only_for_fp8(
        tmp_path, monkeypatch):
    """A checkpoint written before format 6 has no `weight_block` (nor `colaunch`, a run-time
    choice) in its config: bf16 weights and states restore from it; a bf16 conversion of an
    fp8 release restores under any `weight_block`; fp8 weights compare it."""
    c16 = TINY8.replace(param_dtype="bfloat16")
    _, layers = _layers(TINY8)
    dense = [type(w)(*[fp8.dense(f) for f in w]) for w in layers]
    checkpoint.save_weights(tmp_path / "w", c16, dense)
    checkpoint.save_state(tmp_path / "s", c16, [dsa_jax.init_state(c16, 2, kv_scale=0.5)])
    metas = {}
    for kind in ("w", "s"):
        meta = checkpoint.read_info(tmp_path / kind)
        meta["version"] = 5
        for name in ("weight_block", "colaunch"):
            del meta["config"][name]
        metas[str(tmp_path / kind)] = meta
    real = checkpoint.read_info
    monkeypatch.setattr(checkpoint, "read_info", lambda p: metas.get(str(p)) or real(p))
    for cfg in (c16, c16.replace(weight_block=(128, 128), colaunch=False)):
        for g, w in zip(checkpoint.restore_weights(tmp_path / "w", cfg), dense, strict=True):
            T.assert_trees_bitwise_equal(tuple(g), tuple(w))
        assert len(checkpoint.restore_state(tmp_path / "s", cfg)[0]) == 1
    with pytest.raises(CheckpointError, match="weight_block: not in the checkpoint"):
        checkpoint.restore_weights(tmp_path / "w", TINY8)


def test_a_damaged_fp8_layout_or_field_is_refused_by_name(tmp_path, monkeypatch):
    _, layers = _layers(TINY8, keys=(5, 6))
    with pytest.raises(CheckpointError, match="field x_proj holds fp8 blocks, but the "
                                              "config's param_dtype is 'bfloat16'"):
        checkpoint.save_weights(tmp_path / "x", TINY8.replace(param_dtype="bfloat16"), layers)
    assert not (tmp_path / "x").exists()
    odd = layers[0]._replace(o_proj=fp8.Fp8Block(layers[0].o_proj.values,
                                                 layers[0].o_proj.scale[:, :4], (32, 32)))
    with pytest.raises(CheckpointError, match=r"field o_proj holds a scale grid \[8, 4\]"):
        checkpoint.save_weights(tmp_path / "x", TINY8, [odd])
    checkpoint.save_weights(tmp_path / "w8", TINY8, layers)
    meta = checkpoint.read_info(tmp_path / "w8")
    meta["layouts"][1]["u_k"]["fp8"]["block"] = [16, 32]
    monkeypatch.setattr(checkpoint, "read_info", lambda path: meta)
    with pytest.raises(CheckpointError, match=r"layer 1 field u_k holds fp8 blocks of "
                                              r"\(16, 32\)"):
        checkpoint.restore_weights(tmp_path / "w8", TINY8)
    meta["version"], meta["layouts"][1]["u_k"]["fp8"]["block"] = 5, [32, 32]
    with pytest.raises(CheckpointError, match="layouts are missing from the metadata "
                                              r"\(format version 5"):
        checkpoint.restore_weights(tmp_path / "w8", TINY8)


def test_dsa_jax_convert_and_run_keep_an_fp8_release_fp8(tmp_path, capsys):
    """An fp8 release (its config's quantization_config.weight_block_size) through `dsa-jax
    convert --param-dtype float8_e4m3fn` and `dsa-jax run --checkpoint`, which shows the
    weights' memory: the checkpoint's bytes."""
    import json
    import os

    from dsa_jax import cli, hf_oracle
    from dsa_jax.weights import quantize_hf_tensors

    config = hf_oracle.make_config(hidden_size=64, num_heads=2, q_lora_rank=32,
                                   kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=8,
                                   index_n_heads=4, index_head_dim=16,
                                   indexer_types=("full", "shared"))
    hf_dir = str(tmp_path / "hf")
    tensors = hf_oracle.checkpoint_tensors(hf_oracle.make_attention_layers(config, 3))
    fp8_tensors = {}
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.self_attn."
        short = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        fp8_tensors.update({prefix + k: v for k, v in quantize_hf_tensors(short, (8, 8)).items()})
    hf_oracle.save_checkpoint(config, [], hf_dir, tensors=fp8_tensors)
    path = os.path.join(hf_dir, "config.json")
    hf_config = json.load(open(path))
    hf_config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8]}
    json.dump(hf_config, open(path, "w"))
    dst = str(tmp_path / "folded")
    assert cli.main(["convert", hf_dir, dst, "--max-context", "128", "--block-size", "16",
                     "--param-dtype", "float8_e4m3fn"]) == 0, capsys.readouterr().err
    assert "(folded, float8_e4m3fn" in capsys.readouterr().out
    assert checkpoint.read_info(dst)["layouts"][0]["o_proj"]["fp8"]["block"] == [8, 8]
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({**{k: hf_config[k] for k in (
        "hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
        "index_n_heads", "index_head_dim", "index_topk", "index_kpool")},
        "num_heads": 2, "indexer_types": ["full", "shared"], "max_context": 128,
        "block_size": 16, "param_dtype": "float8_e4m3fn", "weight_block": [8, 8]}))
    code = cli.main(["--config", str(serving), "--checkpoint", dst, "--prompt-len", "20",
                     "--steps", "4", "--num-seqs", "2", "--quiet", "--out", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "weights of the 2 DSA layers" in out.out and "float8_e4m3fn blocks" in out.out
