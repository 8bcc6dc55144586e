"""Orbax checkpoints: weights and engine states round-trip bit for bit, a decode after a restore
equals one without, config mismatches and missing layers are clear errors, no silent overwrite."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import checkpoint
from dsa_jax.checkpoint import CheckpointError
from dsa_jax.shapes import ODD
from dsa_jax.testing import assert_trees_bitwise_equal, permuted_block_tables, random_rows

# Two layers (a full one and a shared one), fp8 latents, bf16 indexer cache. (bf16 weights
# are round-tripped too, but not run: XLA:CPU has no bf16 x bf16 -> f32 dot.)
CFG = ODD.replace(cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16",
                  indexer_types=("full", "shared"))
BF16 = CFG.replace(param_dtype="bfloat16")


def _weights(cfg=CFG):
    return [dsa_jax.init_random_weights(cfg, jax.random.key(1)),
            dsa_jax.init_random_weights(cfg, jax.random.key(2), has_indexer=False)]


def _step(states, weights, x, fn):
    """One step through the two-layer stack: the shared layer reuses layer 0's selection."""
    y0, s0, sel = fn(CFG, weights[0], states[0], x)
    y1, s1, _ = fn(CFG, weights[1], states[1], y0, shared_sel=sel)
    return y1, [s0, s1], sel


def test_weights_round_trip_bitwise(tmp_path):
    weights = _weights(BF16)
    path = tmp_path / "w"
    checkpoint.save_weights(path, BF16, weights)
    restored = checkpoint.restore_weights(path, BF16)
    assert len(restored) == 2
    assert restored[0].has_indexer and not restored[1].has_indexer
    assert restored[1].k_norm_w is None and restored[1].ape is None
    assert restored[0].x_proj.dtype == jnp.bfloat16
    assert_trees_bitwise_equal(restored, weights)
    info = checkpoint.read_info(path)
    assert info["kind"] == "weights" and info["layers"] == [0, 1]
    assert info["has_indexer"] == [True, False]
    # Serving geometry is not part of the weights: another max_context restores fine.
    other = checkpoint.restore_weights(path, BF16.replace(max_context=192, block_size=16,
                                                          cache_dtype="float32"))
    assert_trees_bitwise_equal(other, weights)


def test_state_round_trip_and_decode_after_restore_bitwise(tmp_path, monkeypatch):
    weights = _weights()
    b, nb = 2, 2 * CFG.blocks_per_seq + 3  # an allocator's pool: more blocks than needed
    tables = permuted_block_tables(CFG, b, 3, num_blocks=nb)
    states = [dsa_jax.init_state(CFG, b, num_blocks=nb, kv_scale=0.07, block_tables=tables),
              dsa_jax.init_state(CFG, b, num_blocks=nb, kv_scale=0.11, block_tables=tables,
                                 has_indexer=False)]
    # A ragged prefix: 37 and 22 tokens.
    _, states, _ = _step(states, weights, random_rows(4, b, 37, CFG.hidden_size),
                         lambda *a, **k: dsa_jax.prefill(*a, num_tokens=[37, 22], **k))
    assert states[0].latent.dtype == jnp.float8_e4m3fn
    assert float(jnp.max(jnp.abs(states[0].latent.astype(jnp.float32)))) > 0
    extra = {"free_blocks": np.setdiff1d(np.arange(nb), tables), "next_request": 7,
             "requests": {"a": [0, 37], "b": [1, 22]}, "empty": np.zeros((0,), np.int64)}
    monkeypatch.chdir(tmp_path)  # a relative path is made absolute for orbax
    checkpoint.save_state("prefix", CFG, states, extra)
    restored, extra_back = checkpoint.restore_state(tmp_path / "prefix", CFG)
    assert_trees_bitwise_equal(restored, states)
    assert restored[1].index_k.shape == (b, 0, CFG.index_head_dim)
    assert np.asarray(restored[0].lengths).tolist() == [37, 22]
    assert extra_back["next_request"] == 7 and extra_back["requests"] == extra["requests"]
    assert isinstance(extra_back["free_blocks"], np.ndarray)
    assert_trees_bitwise_equal(extra_back["free_blocks"], extra["free_blocks"])
    assert extra_back["empty"].shape == (0,) and extra_back["empty"].dtype == np.int64

    # The saved states were not consumed: decode both copies with the same rows.
    ours, theirs = states, restored
    for t in range(5):
        x = random_rows(10 + t, b, CFG.hidden_size)
        y_a, ours, sel_a = _step(ours, weights, x, dsa_jax.decode)
        y_b, theirs, sel_b = _step(theirs, weights, x, dsa_jax.decode)
        assert_trees_bitwise_equal((y_a, sel_a), (y_b, sel_b))
    assert_trees_bitwise_equal(theirs, ours)

    # Without extra, restore gives None; `implementation` may differ.
    checkpoint.save_state(tmp_path / "noextra", CFG, ours)
    again, none = checkpoint.restore_state(tmp_path / "noextra", CFG.replace(implementation="auto"))
    assert none is None
    assert_trees_bitwise_equal(again, ours)


def test_mismatched_config_names_fields_and_values(tmp_path):
    checkpoint.save_weights(tmp_path / "w", CFG, _weights())
    state = dsa_jax.init_state(CFG, 1, kv_scale=0.5)
    checkpoint.save_state(tmp_path / "s", CFG, [state])

    bad = CFG.replace(index_topk=8, rms_norm_eps=1e-6)
    with pytest.raises(CheckpointError) as e:
        checkpoint.restore_weights(tmp_path / "w", bad)
    msg = str(e.value)
    assert "2 field(s) differ" in msg
    assert "index_topk: checkpoint 12, given config 8" in msg
    assert "rms_norm_eps: checkpoint 1e-05, given config 1e-06" in msg
    with pytest.raises(CheckpointError, match=r"param_dtype: checkpoint 'float32', given "
                                              r"config 'bfloat16'"):
        checkpoint.restore_weights(tmp_path / "w", BF16)
    # A state depends on the serving geometry too.
    with pytest.raises(CheckpointError) as e:
        checkpoint.restore_state(tmp_path / "s", CFG.replace(max_context=192,
                                                             cache_dtype="bfloat16"))
    msg = str(e.value)
    assert "max_context: checkpoint 96, given config 192" in msg
    assert "cache_dtype: checkpoint 'float8_e4m3fn', given config 'bfloat16'" in msg
    # The wrong kind, a missing path, arrays of the wrong shape for the config.
    with pytest.raises(CheckpointError, match="'state' checkpoint, not a 'weights'"):
        checkpoint.restore_weights(tmp_path / "s", CFG)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.restore_state(tmp_path / "nothing", CFG)
    with pytest.raises(CheckpointError, match="config implies"):
        checkpoint.save_weights(tmp_path / "w2", CFG.replace(hidden_size=96), _weights())
    with pytest.raises(CheckpointError, match=r"extra\['f'\] is neither"):
        checkpoint.save_state(tmp_path / "s2", CFG, [state], {"f": object()})
    assert not os.path.exists(tmp_path / "w2") and not os.path.exists(tmp_path / "s2")


def test_overwrite_is_explicit(tmp_path):
    w1, w2 = _weights(), [dsa_jax.init_random_weights(CFG, jax.random.key(9))]
    path = tmp_path / "w"
    checkpoint.save_weights(path, CFG, w1)
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        checkpoint.save_weights(path, CFG, w2)
    assert_trees_bitwise_equal(checkpoint.restore_weights(path, CFG), w1)  # untouched
    checkpoint.save_weights(path, CFG, w2, overwrite=True)
    assert_trees_bitwise_equal(checkpoint.restore_weights(path, CFG), w2)
    # Never over a directory that is not one of ours, even with overwrite=True.
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a dsa_jax checkpoint; refusing"):
        checkpoint.save_weights(other, CFG, w1, overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"


def _write_hf(path, cfg):
    """A fake HF checkpoint: layer 0 full, layer 2 shared, layer 1 without attention."""
    from safetensors.numpy import save_file

    tensors = {"model.embed_tokens.weight": np.ones((4, cfg.hidden_size), np.float32),
               "model.layers.1.mlp.up_proj.weight": np.ones((4, 4), np.float32)}
    hf = {0: dsa_jax.init_random_hf_tensors(cfg, jax.random.key(20)),
          2: dsa_jax.init_random_hf_tensors(cfg, jax.random.key(21), has_indexer=False)}
    for layer, layer_tensors in hf.items():
        for name, value in layer_tensors.items():
            tensors[f"model.layers.{layer}.self_attn.{name}"] = value
    save_file(tensors, str(path))
    return hf


def test_convert_hf_checkpoint(tmp_path):
    src = tmp_path / "model.safetensors"
    hf = _write_hf(src, CFG)
    dst = tmp_path / "folded"
    assert checkpoint.convert_hf_checkpoint(src, dst, CFG) == [0, 2]
    restored = checkpoint.restore_weights(dst, CFG)
    assert_trees_bitwise_equal(restored, [dsa_jax.fold_weights(CFG, hf[0]),
                                          dsa_jax.fold_weights(CFG, hf[2])])
    assert checkpoint.read_info(dst)["layers"] == [0, 2]
    # One layer by id; a missing one names itself and what exists.
    assert checkpoint.convert_hf_checkpoint(tmp_path, tmp_path / "one", CFG, layers=[2]) == [2]
    assert not checkpoint.restore_weights(tmp_path / "one", CFG)[0].has_indexer
    with pytest.raises(CheckpointError, match=r"layer\(s\) \[1, 5\] not found .*"
                                              r"attention layers \[0, 2\]"):
        checkpoint.convert_hf_checkpoint(src, tmp_path / "bad", CFG, layers=[0, 1, 5])
    assert not os.path.exists(tmp_path / "bad")
    with pytest.raises(CheckpointError, match="already exists"):
        checkpoint.convert_hf_checkpoint(src, dst, CFG, layers=[0])
    assert checkpoint.convert_hf_checkpoint(src, dst, CFG, layers=[0], overwrite=True) == [0]
    assert len(checkpoint.restore_weights(dst, CFG)) == 1


_RESTORE_ALL = """
import gc, sys, time
from dsa_jax import checkpoint
from dsa_jax.shapes import ODD
for path in sys.argv[1:]:
    try:
        checkpoint.restore_weights(path, ODD)
        raise SystemExit(f"{path} restored")
    except checkpoint.CheckpointError as e:
        print(str(e).splitlines()[0][:60])
gc.collect()
time.sleep(0.5)  # the failed reads still in flight finish

class Broken:
    def __del__(self):
        raise ValueError("a user's own unraisable error")

Broken()
gc.collect()
"""


def test_a_damaged_checkpoint_fails_in_one_error_and_nothing_else_on_stderr(tmp_path):
    """Damaged array files (deleted, overwritten, truncated): each restore raises one
    `CheckpointError`; the reads orbax still had in flight print no tracebacks afterwards
    (a closed event loop, unretrieved futures), while another unraisable error still does."""
    import shutil
    import subprocess
    import sys

    w = dsa_jax.init_random_weights(ODD, jax.random.key(0))
    good = tmp_path / "good"
    checkpoint.save_weights(good, ODD, [w])
    arrays = good / "arrays"
    targets = [arrays / "manifest.ocdbt", *sorted((arrays / "d").iterdir())]
    assert len(targets) >= 2
    paths = []
    for i, target in enumerate(targets):
        for how in ("delete", "garbage", "truncate"):
            path = tmp_path / f"{how}{i}"
            shutil.copytree(good, path)
            file = path / target.relative_to(good)
            if how == "delete":
                file.unlink()
            elif how == "garbage":
                file.write_bytes(b"garbage")
            else:
                file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
            paths.append(str(path))
    out = subprocess.run([sys.executable, "-c", _RESTORE_ALL, *paths], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{p}: the stored arrays cannot be read"[:60]
                                       for p in paths], out.stdout
    # stderr holds the user's error alone
    assert out.stderr.startswith("Exception ignored in: <function Broken.__del__"), out.stderr
    assert out.stderr.count("Traceback") == 1, out.stderr
    assert out.stderr.rstrip().endswith("ValueError: a user's own unraisable error"), out.stderr
