"""Issue #13's findings 1-8 and 10, one test each (written before the fixes; each failed then).

Finding 9 (the `dsa-jax` command) is in tests/test_reliability_cli.py. Every refusal here is
also an entry of docs/errors.md, checked by tests/test_reliability_errors.py.
"""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import StepError, checkpoint
from dsa_jax.checkpoint import CheckpointError
from dsa_jax.config import ConfigError, DsaConfig
from dsa_jax.engine import Engine, EngineError, ModelConfig, init_model
from dsa_jax.shapes import ODD
from dsa_jax.state import StateError
from dsa_jax.weights import WeightError


@pytest.fixture(scope="module")
def w():
    return dsa_jax.init_random_weights(ODD, jax.random.key(0))


def _x(*shape, seed=1):
    return jax.random.normal(jax.random.key(seed), (*shape, ODD.hidden_size))


# ------------------------------------------------------------------------------- finding 1

def _run(cfg, w, x, decodes):
    state = dsa_jax.init_state(cfg, 2)
    y, state, _ = dsa_jax.prefill(cfg, w, state, x)
    ys = [np.asarray(y)]
    for xt in decodes:
        y, state, _ = dsa_jax.decode(cfg, w, state, xt)
        ys.append(np.asarray(y)[:, None])
    return np.concatenate(ys, axis=1)  # [2, S + steps, D]


@pytest.mark.parametrize("impl", ["xla", "pallas-interpret"])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_1_garbage_in_one_sequence_never_reaches_another(w, impl, poison):
    """NaN / Inf in sequence 0's prefill: sequence 1's outputs, in the prefill and in the
    decodes after it, are bit for bit those of a run where sequence 0 is clean."""
    cfg = ODD.replace(implementation=impl)
    x = _x(2, 20)
    decodes = [_x(2, seed=10 + t) for t in range(2)]
    clean = _run(cfg, w, x, decodes)
    dirty = _run(cfg, w, x.at[0, 0].set(poison), decodes)
    assert np.isfinite(clean).all()
    assert not np.isfinite(dirty[0]).all()  # sequence 0 sees its own garbage
    np.testing.assert_array_equal(dirty[1], clean[1])


def test_1_nnx_module_isolates_sequences(w):
    from dsa_jax.nnx import DsaAttention

    x = _x(2, 20)
    outs = []
    for xx in (x, x.at[0, 0].set(jnp.nan)):
        model = DsaAttention.from_weights(ODD, w, 2)
        y, _ = model.prefill(xx)
        y2, _ = model.decode(_x(2, seed=5))
        outs.append((np.asarray(y[1]), np.asarray(y2[1])))
    np.testing.assert_array_equal(outs[1][0], outs[0][0])
    np.testing.assert_array_equal(outs[1][1], outs[0][1])


# ------------------------------------------------------------------------------- finding 2

def _state_after_prefill(w, seed):
    state = dsa_jax.init_state(ODD, 2)
    _, state, _ = dsa_jax.prefill(ODD, w, state, _x(2, 9, seed=seed))
    return state


@pytest.mark.parametrize("bad", ["strings", "objects", "donated"])
def test_2_a_failed_overwrite_keeps_the_old_checkpoint(w, tmp_path, bad):
    path = tmp_path / "ck"
    old = _state_after_prefill(w, 2)
    checkpoint.save_state(path, ODD, [old], {"note": 1})
    want = np.asarray(old.latent).copy()
    new = _state_after_prefill(w, 3)
    extra = {"note": 2}
    if bad == "strings":
        extra["ids"] = np.asarray(["a", "b"])
    elif bad == "objects":
        extra["ids"] = np.asarray([{"a": 1}, None], dtype=object)
    else:  # the arrays were donated to a step: they are gone
        dsa_jax.decode(ODD, w, new, _x(2, seed=4))
    with pytest.raises(CheckpointError):
        checkpoint.save_state(path, ODD, [new], extra, overwrite=True)
    states, got = checkpoint.restore_state(path, ODD)
    assert got == {"note": 1}
    np.testing.assert_array_equal(np.asarray(states[0].latent), want)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # nothing left beside it


def test_2_a_save_that_dies_midway_keeps_the_old_checkpoint(w, tmp_path, monkeypatch):
    path = tmp_path / "ck"
    checkpoint.save_weights(path, ODD, [w])
    import orbax.checkpoint as ocp

    real_save = ocp.Checkpointer.save

    def dying_save(self, directory, *args, **kwargs):
        real_save(self, directory, *args, **kwargs)  # the new copy is written, then we die
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ocp.Checkpointer, "save", dying_save)
    other = dsa_jax.init_random_weights(ODD, jax.random.key(9))
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save_weights(path, ODD, [other], overwrite=True)
    monkeypatch.undo()
    got = checkpoint.restore_weights(path, ODD)[0]
    np.testing.assert_array_equal(np.asarray(got.x_proj), np.asarray(w.x_proj))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# ------------------------------------------------------------------------------- finding 3

def test_3_block_tables_are_validated_where_they_enter(w):
    mb = ODD.blocks_per_seq
    with pytest.raises(StateError, match=r"physical block 0 is mapped twice: sequence 0 "
                                         r"entry 0 and sequence 0 entry 1"):
        dsa_jax.init_state(ODD, 2, block_tables=np.zeros((2, mb), np.int32))
    tables = np.arange(2 * mb, dtype=np.int32).reshape(2, mb)
    tables[1, 3] = tables[0, 5]
    with pytest.raises(StateError, match=rf"physical block {tables[0, 5]} is mapped twice: "
                                         r"sequence 0 entry 5 and sequence 1 entry 3"):
        dsa_jax.init_state(ODD, 2, block_tables=tables)
    tables = np.arange(2 * mb, dtype=np.int32).reshape(2, mb)
    tables[0, 1] = 2 * mb
    with pytest.raises(StateError, match=rf"sequence 0 entry 1 is {2 * mb}, outside \[-1, "
                                         rf"{2 * mb}\)"):
        dsa_jax.init_state(ODD, 2, block_tables=tables)


def test_3_steps_recheck_every_block_they_read(w):
    state = dsa_jax.init_state(ODD, 2)
    _, state, _ = dsa_jax.prefill(ODD, w, state, _x(2, 20))
    tables = np.asarray(state.block_tables).copy()
    unmapped = tables.copy()
    unmapped[1, 0] = -1  # positions 0..7 of sequence 1 were written there
    with pytest.raises(StepError, match=r"sequence 1: block table entry 0 is -1, outside "
                                        r"\[0, 24\) physical blocks, but position 0 is read"):
        dsa_jax.decode(ODD, w, state._replace(block_tables=jnp.asarray(unmapped)), _x(2))
    shared = tables.copy()
    shared[1, 1] = tables[0, 0]
    with pytest.raises(StepError, match=rf"physical block {tables[0, 0]} is mapped twice: "
                                        r"sequence 0 entry 0 and sequence 1 entry 1"):
        dsa_jax.decode(ODD, w, state._replace(block_tables=jnp.asarray(shared)), _x(2))
    y, _, _ = dsa_jax.decode(ODD, w, state, _x(2))  # the state itself is untouched
    assert np.isfinite(np.asarray(y)).all()


# ------------------------------------------------------------------------------- finding 4

def test_4_shared_sel_past_the_length_is_refused():
    ws = dsa_jax.init_random_weights(ODD, jax.random.key(0), has_indexer=False)
    state = dsa_jax.init_state(ODD, 2, has_indexer=False)
    sel = np.full((2, 5, ODD.sel_width), -1, np.int32)
    sel[:, :, 0] = np.arange(5)
    _, state, _ = dsa_jax.prefill(ODD, ws, state, _x(2, 5), shared_sel=jnp.asarray(sel))
    bad = sel.copy()
    bad[1, 2, 3] = 8  # row 2 of sequence 1 is position 7
    with pytest.raises(StepError, match=r"sequence 1 row 2 \(position 7\): shared_sel slot 3 "
                                        r"holds token 8; ids must be -1 or in \[0, 7\]"):
        dsa_jax.prefill(ODD, ws, state, _x(2, 5), shared_sel=jnp.asarray(bad))
    far = np.full((2, ODD.sel_width), -1, np.int32)
    far[0, 0] = ODD.max_context
    with pytest.raises(StepError, match=r"sequence 0: shared_sel slot 0 holds token 96"):
        dsa_jax.decode(ODD, ws, state, _x(2), shared_sel=jnp.asarray(far))


# ------------------------------------------------------------------------------- finding 5

MCFG = ModelConfig(ODD.replace(indexer_types=("full", "shared")), vocab_size=37)


@pytest.fixture(scope="module")
def model():
    return init_model(MCFG, jax.random.key(0))


@pytest.mark.parametrize("prompt, max_new, message", [
    ([1, 2, 3], -30, r"max_new_tokens must be a positive integer, got -30"),
    ([1, 2, 3], 0, r"max_new_tokens must be a positive integer, got 0"),
    ([1, 2, 3], 2.5, r"max_new_tokens must be a positive integer, got 2.5"),
    ([1, 2.7, 3], 4, r"prompt\[1\] is 2.7, not an integer token id"),
    ([1, True, 3], 4, r"prompt\[1\] is True, not an integer token id"),
    ([1, 37, 3], 4, r"prompt\[1\] is 37, outside the vocabulary \[0, 37\)"),
    ([-1], 4, r"prompt\[0\] is -1, outside the vocabulary \[0, 37\)"),
    ("abc", 4, r"prompt must be a list of token ids, got str"),
])
def test_5_engine_refuses_bad_requests(model, prompt, max_new, message):
    eng = Engine(MCFG, model, max_seqs=2, num_blocks=24)
    with pytest.raises(EngineError, match=message):
        eng.submit(prompt, max_new)
    assert not eng.queue


def test_5_max_new_tokens_one_generates_one(model):
    eng = Engine(MCFG, model, max_seqs=2, num_blocks=24)
    req = eng.submit(np.asarray([1, 2, 3], np.int64), 1)
    eng.run_until_done()
    assert len(req.output) == 1


# ------------------------------------------------------------------------------- finding 6

def _fp8_block_quantize(a, block=(128, 128)):
    """fp32 [out, in] -> (e4m3 weight, fp32 weight_scale_inv [ceil(out/b0), ceil(in/b1)])."""
    r, c = a.shape
    gr, gc = -(-r // block[0]), -(-c // block[1])
    scale = np.zeros((gr, gc), np.float32)
    q = np.zeros(a.shape, jnp.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            blk = a[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            s = np.float32(np.abs(blk).max() / 448.0)
            scale[i, j] = s
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                (blk / s).astype(jnp.float8_e4m3fn)
    return q, scale


def _fp8_layer():
    hf = dsa_jax.init_random_hf_tensors(ODD, jax.random.key(3))
    q, s = _fp8_block_quantize(hf["q_a_proj.weight"], (16, 32))
    exact = dict(hf)
    exact["q_a_proj.weight"] = q.astype(np.float32) * np.repeat(
        np.repeat(s, 16, 0), 32, 1)[:q.shape[0], :q.shape[1]]
    return hf, q, s, exact


def test_6_fp8_tensor_without_its_scale_is_refused():
    hf, q, s, exact = _fp8_layer()
    with pytest.raises(WeightError, match=r"tensor 'q_a_proj.weight' is float8_e4m3fn without "
                                          r"its scale 'q_a_proj.weight_scale_inv'"):
        dsa_jax.fold_weights(ODD, {**hf, "q_a_proj.weight": q})
    folded = dsa_jax.fold_weights(ODD, {**hf, "q_a_proj.weight": q,
                                        "q_a_proj.weight_scale_inv": s}, fp8_block=(16, 32))
    want = dsa_jax.fold_weights(ODD, exact)
    np.testing.assert_array_equal(np.asarray(folded.x_proj), np.asarray(want.x_proj))


def test_6_f8_e4m3_safetensors_file_loads_with_its_scales(tmp_path):
    import torch
    from safetensors.torch import save_file

    hf, q, s, exact = _fp8_layer()
    tensors = {f"model.layers.0.self_attn.{k}": torch.from_numpy(np.array(v))
               for k, v in hf.items() if k != "q_a_proj.weight"}
    prefix = "model.layers.0.self_attn.q_a_proj."
    tensors[prefix + "weight"] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    save_file(dict(tensors), str(tmp_path / "nosc.safetensors"))
    with pytest.raises(WeightError, match=r"is float8_e4m3fn without its scale"):
        dsa_jax.load_hf_layer(tmp_path / "nosc.safetensors", ODD, 0)
    tensors[prefix + "weight_scale_inv"] = torch.from_numpy(s)
    save_file(dict(tensors), str(tmp_path / "fp8.safetensors"))
    got = dsa_jax.load_hf_layer(tmp_path / "fp8.safetensors", ODD, 0, fp8_block=(16, 32))
    want = dsa_jax.fold_weights(ODD, exact)
    np.testing.assert_array_equal(np.asarray(got.x_proj), np.asarray(want.x_proj))


# ------------------------------------------------------------------------------- finding 7

def test_7_numbers_are_checked_not_coerced(w, tmp_path):
    for scale in (float("inf"), float("nan"), 0.0, -1.0, 1 + 2j, "1.0", True):
        with pytest.raises(StateError, match="kv_scale must be a finite real number > 0"):
            dsa_jax.init_state(ODD, 2, kv_scale=scale)
    state = dsa_jax.init_state(ODD, 2)
    with pytest.raises(StepError, match=r"x has dtype complex64; expected a real floating"):
        dsa_jax.prefill(ODD, w, state, _x(2, 4).astype(jnp.complex64))
    with pytest.raises(StepError, match=r"num_tokens must be integers, got float64 "
                                        r"\[2.5, 3.7\]"):
        dsa_jax.prefill(ODD, w, state, _x(2, 4), num_tokens=[2.5, 3.7])
    _, state, _ = dsa_jax.prefill(ODD, w, state, _x(2, 4))
    with pytest.raises(StepError, match=r"rewind lengths must be integers, got float64 "
                                        r"\[2.5, 3.0\]"):
        dsa_jax.rewind(ODD, state, [2.5, 3.0])
    fields = json.loads(json.dumps(dataclasses.asdict(ODD)))
    for key, value, message in [
        ("always_select_tail", "false", r"always_select_tail must be a bool \(true or false\), "
                                        r"got 'false'"),
        ("rms_norm_eps", "1e-5", r"rms_norm_eps must be a finite real number > 0, got '1e-5'"),
        ("rms_norm_eps", float("inf"), r"rms_norm_eps must be a finite real number > 0"),
        ("cache_dtype", 3, r"cache_dtype must be one of"),
        ("indexer_types", "full", r"indexer_types must be a list of 'full' / 'shared'"),
    ]:
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({**fields, key: value}))
        with pytest.raises(ConfigError, match=message):
            DsaConfig.from_json(path)
    hf = {"hidden_size": 80, "num_attention_heads": 3, "q_lora_rank": 40, "kv_lora_rank": 24,
          "qk_nope_head_dim": 12, "v_head_dim": 20, "index_n_heads": 3, "index_head_dim": 12,
          "index_topk": 12, "index_kpool": 4}
    with pytest.raises(ConfigError, match=r"index_kpool_always_select_tail must be a bool"):
        DsaConfig.from_hf_config({**hf, "index_kpool_always_select_tail": "false"})
    with pytest.raises(ConfigError, match=r"rms_norm_eps must be a finite real number > 0, "
                                          r"got '1e-5'"):
        DsaConfig.from_hf_config({**hf, "rms_norm_eps": "1e-5"})


# ------------------------------------------------------------------------------- finding 8

def test_8_mismatches_are_step_errors_before_jit(w):
    state = dsa_jax.init_state(ODD, 2)
    with pytest.raises(StepError, match=r"prefill takes x \[B, S, D\], got shape \(10, 80\)"):
        dsa_jax.prefill(ODD, w, state, _x(2, 10)[0])
    with pytest.raises(StepError, match=r"got shape \(1, 2, 10, 80\)"):
        dsa_jax.prefill(ODD, w, state, _x(2, 10)[None])
    with pytest.raises(StepError, match=r"prefill of 0 rows: x has shape \(2, 0, 80\)"):
        dsa_jax.prefill(ODD, w, state, _x(2, 0))
    with pytest.raises(StepError, match=r"these weights run an indexer \(a 'full' layer\) but "
                                        r"the state has no indexer cache"):
        dsa_jax.prefill(ODD, w, dsa_jax.init_state(ODD, 2, has_indexer=False), _x(2, 3))
    ws = dsa_jax.init_random_weights(ODD, jax.random.key(0), has_indexer=False)
    sel = jnp.full((2, 3, ODD.sel_width), -1, jnp.int32)
    with pytest.raises(StepError, match=r"these weights have no indexer \(a 'shared' layer\) "
                                        r"but the state has an indexer cache"):
        dsa_jax.prefill(ODD, ws, state, _x(2, 3), shared_sel=sel)
    other = ODD.replace(kv_lora_rank=16)
    with pytest.raises(StepError, match=r"state field latent is float32\[24, 8, 16\], but the "
                                        r"config implies float32\[24, 8, 24\]"):
        dsa_jax.prefill(ODD, w, dsa_jax.init_state(other, 2), _x(2, 3))
    with pytest.raises(StepError, match=r"weights field x_proj is float32\[83, 80\], but the "
                                        r"config implies float32\[91, 80\]"):
        dsa_jax.prefill(ODD, dsa_jax.init_random_weights(other, jax.random.key(0)), state,
                        _x(2, 3))
    y, _, _ = dsa_jax.prefill(ODD, w, state, _x(2, 3))
    assert np.isfinite(np.asarray(y)).all()


# ------------------------------------------------------------------------------- finding 10

def test_10_a_changed_data_byte_fails_restore(w, tmp_path):
    """Flip one byte at several places of the largest data file: every restore fails with a
    CheckpointError, at least one of them a checksum mismatch naming the array (the bytes
    decoded to other values: before checksums, a silent restore)."""
    path = tmp_path / "ck"
    checkpoint.save_weights(path, ODD, [w])
    files = [os.path.join(root, f) for root, _, fs in os.walk(path) for f in fs
             if os.sep + "d" + os.sep in os.path.join(root, f)]
    data = max(files, key=os.path.getsize)
    original = open(data, "rb").read()
    checksum_hits = 0
    for at in np.linspace(len(original) // 4, 3 * len(original) // 4, 5).astype(int):
        changed = bytearray(original)
        changed[at] ^= 0x10
        open(data, "wb").write(bytes(changed))
        with pytest.raises(CheckpointError) as err:
            checkpoint.restore_weights(path, ODD)
        checksum_hits += bool(re.search(r"array layers/0/\w+: checksum mismatch",
                                        str(err.value)))
    open(data, "wb").write(original)
    assert checksum_hits
    np.testing.assert_array_equal(np.asarray(checkpoint.restore_weights(path, ODD)[0].x_proj),
                                  np.asarray(w.x_proj))



def test_4_a_full_layers_selection_is_checked_without_a_device_read(monkeypatch):
    """The selection a full layer's step returned, given to a shared layer at the same
    positions, needs no device read (the host knows it is valid); a hand-made one is read."""
    w = dsa_jax.init_random_weights(ODD, jax.random.key(0))
    ws = dsa_jax.init_random_weights(ODD, jax.random.key(1), has_indexer=False)
    full, shared = dsa_jax.init_state(ODD, 2), dsa_jax.init_state(ODD, 2, has_indexer=False)
    _, full, sel = dsa_jax.prefill(ODD, w, full, _x(2, 6))
    _, shared, _ = dsa_jax.prefill(ODD, ws, shared, _x(2, 6), shared_sel=sel)
    _, full, sel = dsa_jax.decode(ODD, w, full, _x(2))
    reads = []
    real_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda a: reads.append(a) or real_get(a))
    layout, _ = dsa_jax.layer.prepare_step(ODD, ws, shared, _x(2), kind="decode",
                                           shared_sel=sel)
    assert reads == []
    dsa_jax.layer.prepare_step(ODD, ws, shared, _x(2), kind="decode",
                               shared_sel=jnp.asarray(np.asarray(sel)))
    assert len(reads) == 1
