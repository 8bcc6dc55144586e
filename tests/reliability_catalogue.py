"""The error catalogue's cases (docs/errors.md), one per entry: `(id, what is refused, type,
message regex, call)`, the call taking the context of tests/test_reliability_errors.py."""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from reliability_catalogue_serving import SERVING_CASES

import dsa_jax
from dsa_jax import checkpoint, layer, sharding
from dsa_jax.checkpoint import CheckpointError
from dsa_jax.config import ConfigError, DsaConfig
from dsa_jax.implementation import ImplementationError, resolve
from dsa_jax.pallas.common import KernelLimitError
from dsa_jax.pallas.pool_topk import AUTO_TRITON_MIN_ROWS, PoolTopkTuning, pool_topk_pallas
from dsa_jax.pallas.pool_topk_triton import MissingDependencyError
from dsa_jax.pallas.sparse_attend import sparse_attend_pallas
from dsa_jax.shapes import ODD
from dsa_jax.sharding import ShardingError
from dsa_jax.state import StateError
from dsa_jax.weights import WeightError, dequantize_fp8, fold_weights, read_hf_tensors

F = dict(hidden_size=80, num_heads=3, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12,
         v_head_dim=20, index_n_heads=3, index_head_dim=12, index_topk=12, index_kpool=4)
HF = {"hidden_size": 80, "num_attention_heads": 3, "q_lora_rank": 40, "kv_lora_rank": 24,
      "qk_nope_head_dim": 12, "v_head_dim": 20, "index_n_heads": 3, "index_head_dim": 12,
      "index_topk": 12, "index_kpool": 4}


def _cfg(**kw):
    return DsaConfig(**{**F, **kw})


def _json(c, name, data):
    path = os.path.join(c.tmp, name)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))
    return path


def x_rows(*shape):
    return jax.random.normal(jax.random.key(sum(shape)), (*shape, ODD.hidden_size))


def _sel(*shape, fill=-1):
    return jnp.full((*shape, ODD.sel_width), fill, jnp.int32)


def _tables(edit):
    t = np.arange(2 * ODD.blocks_per_seq, dtype=np.int32).reshape(2, -1)
    edit(t)
    return t


ODD8 = ODD.replace(param_dtype="float8_e4m3fn", weight_block=(4, 8))


def _fp8(c, scale=True, grid=(1, 1)):
    hf = dict(c.hf)
    hf["q_a_proj.weight"] = np.asarray(hf["q_a_proj.weight"]).astype(jnp.float8_e4m3fn)
    if scale:
        hf["q_a_proj.weight_scale_inv"] = np.ones(grid, np.float32)
    return hf


def _state_with(c, **fields):
    return c.state._replace(**{k: jnp.asarray(v) for k, v in fields.items()})


def _out(deleted=False):
    """Fresh (y, sel) buffers for a decode of 2 sequences; sel deleted if asked."""
    y = jnp.zeros((2, ODD.hidden_size), jnp.float32)  # [B, D]
    sel = jnp.zeros((2, ODD.sel_width), jnp.int32)  # [B, W]
    if deleted:
        sel.delete()
    return y, sel


def _save_twice(c, name, **kw):
    checkpoint.save_weights(os.path.join(c.tmp, name), ODD, [c.w])
    checkpoint.save_weights(os.path.join(c.tmp, name), ODD, [c.w], **kw)


def _changed_byte(c):
    path = os.path.join(c.tmp, "flip")
    checkpoint.save_weights(path, ODD, [c.w])
    meta = os.path.join(path, "dsa_jax", "metadata")
    data = json.load(open(meta))
    key = "layers/0/x_proj"
    data["checksums"][key] = "sha256:" + "0" * 64  # as if x_proj's bytes had changed
    json.dump(data, open(meta, "w"))
    checkpoint.restore_weights(path, ODD)


def _damaged(c):
    path = os.path.join(c.tmp, "damaged")
    checkpoint.save_weights(path, ODD, [c.w])
    for root, _, files in os.walk(os.path.join(path, "arrays")):
        for f in files:
            if os.sep + "d" + os.sep in os.path.join(root, f) + os.sep:
                open(os.path.join(root, f), "wb").write(b"garbage")
    checkpoint.restore_weights(path, ODD)


def _version(c, version):
    path = os.path.join(c.tmp, f"version{version}")
    checkpoint.save_weights(path, ODD, [c.w])
    meta = os.path.join(path, "dsa_jax", "metadata")
    data = json.load(open(meta))
    data["version"] = version
    json.dump(data, open(meta, "w"))
    checkpoint.restore_weights(path, ODD)


def _hf_folder(c, name: str, files: dict[str, bytes]):
    """A checkpoint folder `name` holding `files` (file name -> bytes)."""
    path = os.path.join(c.tmp, name)
    os.makedirs(path, exist_ok=True)
    for file, data in files.items():
        open(os.path.join(path, file), "wb").write(data)
    return path


def _hf_file(c, drop=None, layer=0):
    from safetensors.numpy import save_file

    path = os.path.join(c.tmp, f"hf-{drop}-{layer}.safetensors")
    save_file({f"model.layers.{layer}.self_attn.{k}": np.asarray(v) for k, v in c.hf.items()
               if k != drop}, path)
    return path


def _donated(c):
    st = dsa_jax.init_state(ODD, 2)
    dsa_jax.decode(ODD, c.w, st, x_rows(2))
    checkpoint.save_state(os.path.join(c.tmp, "donated"), ODD, [st])


# (id, condition, type, message regex, call)
def without_jax_triton(c):
    """The compiled top-k with backend "auto" (a prompt's rows: the raw Triton kernel) where
    jax-triton cannot be imported (as on a machine without the `gpu` extra; hidden here so
    that the case holds where it is installed)."""
    with mock.patch.dict(sys.modules, {"jax_triton": None}):
        return pool_topk_pallas(jnp.zeros((AUTO_TRITON_MIN_ROWS, 64)), 8,
                                tuning=PoolTopkTuning(backend="auto"))


CASES = [
    # ---- config
    ("config.int-field", "an integer field not a positive int (bools too)", ConfigError,
     r"hidden_size must be a positive integer, got True", lambda c: _cfg(hidden_size=True)),
    ("config.tail-not-bool", "always_select_tail not a JSON bool", ConfigError,
     r"always_select_tail must be a bool \(true or false\), got 'false'",
     lambda c: _cfg(always_select_tail="false")),
    ("config.batch-invariant", "batch_invariant not a bool", ConfigError,
     r"batch_invariant must be a bool \(true or false\), got 1",
     lambda c: _cfg(batch_invariant=1)),
    ("config.eps", "rms_norm_eps not a finite number > 0", ConfigError,
     r"rms_norm_eps must be a finite real number > 0, got '1e-5'",
     lambda c: _cfg(rms_norm_eps="1e-5")),
    ("config.rope-type", "qk_rope_head_dim not an integer", ConfigError,
     r"qk_rope_head_dim must be an integer \(0\)", lambda c: _cfg(qk_rope_head_dim=0.0)),
    ("config.rope", "qk_rope_head_dim not 0", ConfigError, r"qk_rope_head_dim must be 0",
     lambda c: _cfg(qk_rope_head_dim=64)),
    ("config.topk-kpool", "index_topk not a multiple of index_kpool", ConfigError,
     r"index_topk \(12\) must be a multiple of index_kpool \(5\)",
     lambda c: _cfg(index_kpool=5, max_context=100, block_size=4)),
    ("config.heads-tp", "num_heads not divisible by tp_degree", ConfigError,
     r"num_heads \(3\) must be divisible by tp_degree \(2\)", lambda c: _cfg(tp_degree=2)),
    ("config.context-block", "max_context not a multiple of block_size", ConfigError,
     r"max_context \(4096\) must be a multiple of block_size \(48\)",
     lambda c: _cfg(block_size=48)),
    ("config.context-kpool", "max_context not a multiple of index_kpool", ConfigError,
     r"max_context \(104\) must be a multiple of index_kpool \(12\)",
     lambda c: _cfg(index_kpool=12, max_context=104, block_size=8)),
    ("config.cache-dtype", "unknown cache_dtype", ConfigError, r"cache_dtype must be one of",
     lambda c: _cfg(cache_dtype="int8")),
    ("config.index-cache-dtype", "unknown index_cache_dtype", ConfigError,
     r"index_cache_dtype must be one of", lambda c: _cfg(index_cache_dtype="float8_e4m3fn")),
    ("config.param-dtype", "unknown param_dtype", ConfigError, r"param_dtype must be one of",
     lambda c: _cfg(param_dtype="float16")),
    ("config.implementation", "unknown implementation", ConfigError,
     r"implementation must be one of", lambda c: _cfg(implementation="cuda")),
    ("config.indexer-types-type", "indexer_types not a list of strings", ConfigError,
     r"indexer_types must be a list of 'full' / 'shared'", lambda c: _cfg(indexer_types="full")),
    ("config.indexer-types-empty", "indexer_types empty", ConfigError,
     r"indexer_types must name at least one layer", lambda c: _cfg(indexer_types=())),
    ("config.indexer-types-value", "an indexer_types entry not full/shared", ConfigError,
     r"indexer_types\[1\] must be one of", lambda c: _cfg(indexer_types=("full", "dense"))),
    ("config.indexer-types-first", "the first layer not 'full'", ConfigError,
     r"indexer_types\[0\] must be 'full'", lambda c: _cfg(indexer_types=("shared",))),
    ("config.file-unreadable", "a config file that cannot be read", ConfigError,
     r"cannot read the config \(No such file or directory\)",
     lambda c: DsaConfig.from_json(os.path.join(c.tmp, "none.json"))),
    ("config.file-not-json", "a config file that is not JSON", ConfigError,
     r"not valid JSON", lambda c: DsaConfig.from_json(_json(c, "b.json", "{x"))),
    ("config.file-not-object", "a config file whose JSON is not an object", ConfigError,
     r"expected a JSON object of config fields, got list",
     lambda c: DsaConfig.from_json(_json(c, "l.json", [1]))),
    ("config.unknown-keys", "a key that is not a DsaConfig field", ConfigError,
     r"unknown config keys \['hiden_size'\]",
     lambda c: DsaConfig.from_json(_json(c, "u.json", {**F, "hiden_size": 1}))),
    ("config.missing-keys", "a required field missing from a config file", ConfigError,
     r"required config keys \['hidden_size'\] are missing",
     lambda c: DsaConfig.from_json(_json(c, "m.json", {k: v for k, v in F.items()
                                                       if k != "hidden_size"}))),
    ("config.hf-missing", "an HF config without a required field", ConfigError,
     r"HF config lacks required fields \['index_topk'\]",
     lambda c: DsaConfig.from_hf_config({k: v for k, v in HF.items() if k != "index_topk"})),
    ("config.hf-tail", "index_kpool_always_select_tail not a bool", ConfigError,
     r"index_kpool_always_select_tail must be a bool \(true or false\), got 'false'",
     lambda c: DsaConfig.from_hf_config({**HF, "index_kpool_always_select_tail": "false"})),
    ("config.hf-indexer-types", "an HF indexer_types that is not a list", ConfigError,
     r"indexer_types must be a list, got 'full'",
     lambda c: DsaConfig.from_hf_config({**HF, "indexer_types": "full"})),
    ("config.hf-no-dsa-layer", "an HF config whose layer_types hold no DSA layer",
     ConfigError, r"layer_types \['linear_attention'\] has no DSA layer",
     lambda c: DsaConfig.from_hf_config({**HF, "indexer_types": ["full", "full"],
                                         "layer_types": ["linear_attention"] * 2})),
    ("config.serving-unknown", "an unknown serving field", ConfigError,
     r"serving fields: unknown config keys \['max_ctx'\]",
     lambda c: DsaConfig.from_hf_config(HF, max_ctx=4)),
    # ---- loader
    ("weights.missing", "a tensor missing from the HF tensors", WeightError,
     r"tensor 'o_proj.weight' is missing \(expected shape \(80, 60\)\)",
     lambda c: fold_weights(ODD, {k: v for k, v in c.hf.items() if k != "o_proj.weight"})),
    ("weights.shape", "a tensor of the wrong shape", WeightError,
     r"tensor 'o_proj.weight' has shape \(80, 59\), expected \(80, 60\)",
     lambda c: fold_weights(ODD, {**c.hf, "o_proj.weight": np.ones((80, 59), np.float32)})),
    ("weights.dtype", "a tensor of a non-floating dtype", WeightError,
     r"tensor 'o_proj.weight' has dtype int32, expected a floating dtype",
     lambda c: fold_weights(ODD, {**c.hf, "o_proj.weight": np.ones((80, 60), np.int32)})),
    ("weights.fp8-no-scale", "an fp8 tensor without its weight_scale_inv", WeightError,
     r"tensor 'q_a_proj.weight' is float8_e4m3fn without its scale "
     r"'q_a_proj.weight_scale_inv'", lambda c: fold_weights(ODD, _fp8(c, scale=False))),
    ("weights.fp8-grid", "a block scale whose grid does not fit the weight", WeightError,
     r"scale of 'q_a_proj.weight' has shape \[2, 2\], but a \[40, 80\] weight in \[128, 128\] "
     r"blocks needs \[1, 1\]", lambda c: fold_weights(ODD, _fp8(c, grid=(2, 2)))),
    ("weights.scale-alone", "a scale beside a tensor that is not fp8", WeightError,
     r"scale 'o_proj.weight_scale_inv' is there, but 'o_proj.weight' is float32",
     lambda c: dequantize_fp8({**c.hf, "o_proj.weight_scale_inv": np.ones((1,), np.float32)})),
    ("weights.fp8-nonfinite", "a NaN or inf block scale", WeightError,
     r"scale of 'q_a_proj.weight' holds 1 non-finite value\(s\) \(NaN or inf\)",
     lambda c: fold_weights(ODD, {**_fp8(c), "q_a_proj.weight_scale_inv": np.full(
         (1, 1), np.nan, np.float32)})),
    ("weights.fp8-kept-e5m2", "an e5m2 weight under param_dtype float8_e4m3fn", WeightError,
     r"tensor 'q_a_proj.weight' is float8_e5m2; weights kept as fp8 are float8_e4m3fn",
     lambda c: fold_weights(ODD.replace(param_dtype="float8_e4m3fn"), {
         **_fp8(c), "q_a_proj.weight": np.asarray(c.hf["q_a_proj.weight"]).astype(
             jnp.float8_e5m2)})),
    ("weights.fp8-cut", "fp8 weights cut off a block boundary (heads per rank, blocks)",
     WeightError, r"'kv_b_proj.weight' has 32 rows per head, not a whole number of fp8 "
     r"blocks of 128", lambda c: fold_weights(ODD.replace(param_dtype="float8_e4m3fn"), {
         **c.hf, "kv_b_proj.weight": np.asarray(c.hf["kv_b_proj.weight"]).astype(
             jnp.float8_e4m3fn), "kv_b_proj.weight_scale_inv": np.ones((1, 1), np.float32)})),
    ("weights.tp-rank", "tp_rank outside [0, tp_degree)", WeightError,
     r"tp_rank 1 is outside \[0, tp_degree=1\)", lambda c: fold_weights(ODD, c.hf, 1)),
    ("weights.no-layer", "no attention tensors for the layer in the file", WeightError,
     r"no attention tensors for layer 3", lambda c: read_hf_tensors(_hf_file(c), ODD, 3)),
    ("weights.index-no-map", "a model.safetensors.index.json without weight_map", WeightError,
     r"model.safetensors.index.json: no \"weight_map\" object \(tensor name -> file\), got "
     r"NoneType",
     lambda c: read_hf_tensors(_hf_folder(c, "nomap", {"model.safetensors.index.json":
                                                       b'{"metadata": {}}'}), ODD, 0)),
    ("weights.shard-missing", "an index naming a shard that is not there", WeightError,
     r"missing.safetensors: cannot read tensor 'model.layers.0.self_attn.",
     lambda c: read_hf_tensors(_hf_folder(c, "noshard", {
         "model.safetensors.index.json": json.dumps({"weight_map": {
             f"model.layers.0.self_attn.{k}": "missing.safetensors" for k in c.hf}}).encode()}),
         ODD, 0)),
    ("weights.shard-corrupt", "a safetensors file that is not one (corrupt or truncated)",
     WeightError, r"model.safetensors: not a readable safetensors file \(",
     lambda c: read_hf_tensors(_hf_folder(c, "corrupt", {"model.safetensors": b"garbage!"}),
                               ODD, 0)),
    ("weights.file-missing", "a file lacking one of the layer's tensors", WeightError,
     r"tensor 'model.layers.0.self_attn.o_proj.weight' is missing",
     lambda c: read_hf_tensors(_hf_file(c, drop="o_proj.weight"), ODD, 0)),
    ("weights.folder", "a folder with neither an index nor model.safetensors", WeightError,
     r"neither model.safetensors.index.json nor model.safetensors is there",
     lambda c: read_hf_tensors(c.tmp_empty, ODD, 0)),
    # ---- state
    ("state.num-seqs", "num_seqs not a positive integer", StateError,
     r"num_seqs must be a positive integer, got 0", lambda c: dsa_jax.init_state(ODD, 0)),
    ("state.num-blocks", "num_blocks not a positive integer", StateError,
     r"num_blocks must be a positive integer, got 2.5",
     lambda c: dsa_jax.init_state(ODD, 1, num_blocks=2.5)),
    ("state.kv-scale", "kv_scale not a finite real number > 0", StateError,
     r"kv_scale must be a finite real number > 0, got inf",
     lambda c: dsa_jax.init_state(ODD, 1, kv_scale=float("inf"))),
    ("state.has-indexer", "has_indexer not a bool", StateError,
     r"has_indexer must be a bool, got 'no'",
     lambda c: dsa_jax.init_state(ODD, 1, has_indexer="no")),
    ("state.tables-shape", "block_tables not [num_seqs, max_context / block_size]", StateError,
     r"block_tables has shape \(2, 3\), expected \(2, 12\)",
     lambda c: dsa_jax.init_state(ODD, 2, block_tables=np.zeros((2, 3), np.int32))),
    ("state.tables-dtype", "block_tables not integers", StateError,
     r"block_tables must hold integers, got dtype float32",
     lambda c: dsa_jax.init_state(ODD, 2, block_tables=np.zeros((2, 12), np.float32))),
    ("state.tables-range", "a block_tables entry outside [-1, num_blocks)", StateError,
     r"sequence 1 entry 0 is 24, outside \[-1, 24\)",
     lambda c: dsa_jax.init_state(ODD, 2, block_tables=_tables(lambda t: t.__setitem__(
         (1, 0), 24)))),
    ("state.tables-shared", "one physical block mapped twice", StateError,
     r"physical block 3 is mapped twice: sequence 0 entry 3 and sequence 1 entry 0",
     lambda c: dsa_jax.init_state(ODD, 2, block_tables=_tables(lambda t: t.__setitem__(
         (1, 0), 3)))),
    ("state.shards", "shards not dividing the sequences and blocks", StateError,
     r"shards must be a positive integer dividing num_seqs 2 and num_blocks 24, got 5",
     lambda c: dsa_jax.init_state(ODD, 2, shards=5)),
    # ---- entry points (prefill / decode / decode_k / write_kv_row / rewind / prepare_step)
    ("kernel.triton-offsets", "a latent cache the Pallas Triton gather-attend would address "
     "with wrapping 32-bit offsets (2**31+ elements, at most 2**32 bytes); the Mosaic GPU "
     "attend (the fp8 default at 32+ heads per device) and the latent write (its rows stored "
     "by XLA there) take such a cache", KernelLimitError,
     r"latent cache \(65536, 64, 512\) float8_e4m3fn is 2147483648 bytes: the Pallas Triton "
     r"kernels address arrays of at most 4294967296 bytes with 32-bit offsets",
     lambda c: jax.eval_shape(lambda lat: sparse_attend_pallas(
         jnp.ones((1, 1, 8, 512)), lat, jnp.float32(1.0), jnp.zeros((1, 1), jnp.int32),
         jnp.zeros((1, 1, 4), jnp.int32), softmax_scale=0.1, interpret=True),
         jax.ShapeDtypeStruct((65536, 64, 512), jnp.float8_e4m3fn))),
    ("kernel.triton-topk-missing", "the raw Triton top-k (PoolTopkTuning backend 'auto' or "
     "'triton') "
     "without jax-triton installed", MissingDependencyError,
     r"needs the 'jax-triton' package \(jax-triton==0.3.1\)", without_jax_triton),
    ("step.kind", "prepare_step with an unknown kind", layer.StepError,
     r"step kind 'chunk' is not one of",
     lambda c: layer.prepare_step(ODD, c.w, c.state, x_rows(2, 3), kind="chunk")),
    ("step.rank", "x of the wrong rank", layer.StepError,
     r"prefill takes x \[B, S, D\], got shape \(2, 80\)",
     lambda c: dsa_jax.prefill(ODD, c.w, c.state, x_rows(2))),
    ("step.empty", "a prefill of S = 0 rows", layer.StepError,
     r"prefill of 0 rows: x has shape \(2, 0, 80\)",
     lambda c: dsa_jax.prefill(ODD, c.w, c.state, x_rows(2, 0))),
    ("step.verify-rows", "a verify of more than max_verify rows", layer.StepError,
     r"a 5-row verify does not fit max_verify 4",
     lambda c: dsa_jax.decode_k(ODD, c.w, c.state, x_rows(2, 5))),
    ("step.x-shape", "x whose batch or width does not fit", layer.StepError,
     r"x has shape \(3, 80\); expected leading dim 2",
     lambda c: dsa_jax.decode(ODD, c.w, c.state, x_rows(3))),
    ("step.x-dtype", "x of a complex or integer dtype", layer.StepError,
     r"x has dtype complex64; expected a real floating dtype",
     lambda c: dsa_jax.decode(ODD, c.w, c.state, x_rows(2).astype(jnp.complex64))),
    ("step.counts-type", "fractional num_tokens / active", layer.StepError,
     r"num_tokens must be integers, got float64 \[2.5, 3.0\]",
     lambda c: dsa_jax.prefill(ODD, c.w, c.state, x_rows(2, 4), num_tokens=[2.5, 3.0])),
    ("step.counts-range", "num_tokens outside [0, S]", layer.StepError,
     r"num_tokens: per-sequence row counts \[3, 40\] must be 2 values in \[0, 4\]",
     lambda c: dsa_jax.prefill(ODD, c.w, c.state, x_rows(2, 4), num_tokens=[3, 40])),
    ("step.sel-missing", "a shared layer without shared_sel", layer.StepError,
     r"these weights have no indexer \(a 'shared' layer\): pass shared_sel",
     lambda c: dsa_jax.decode(ODD, c.ws, c.sstate, x_rows(2))),
    ("step.sel-shape", "shared_sel of the wrong shape", layer.StepError,
     r"shared_sel has shape \(2, 2, 15\), expected \(2, 3, 15\)",
     lambda c: dsa_jax.decode_k(ODD, c.ws, c.sstate, x_rows(2, 3), shared_sel=_sel(2, 2))),
    ("step.sel-dtype", "shared_sel not integers", layer.StepError,
     r"shared_sel has dtype float32; expected integer token ids",
     lambda c: dsa_jax.decode(ODD, c.ws, c.sstate, x_rows(2),
                              shared_sel=_sel(2).astype(jnp.float32))),
    ("step.sel-unexpected", "shared_sel given to a full layer", layer.StepError,
     r"shared_sel was given but these weights run their own indexer",
     lambda c: dsa_jax.decode(ODD, c.w, c.state, x_rows(2), shared_sel=_sel(2))),
    ("step.sel-range", "a shared_sel id past the row's position or max_context",
     layer.StepError, r"sequence 0: shared_sel slot 0 holds token 5; ids must be -1 or in "
     r"\[0, 4\]", lambda c: dsa_jax.decode(ODD, c.ws, c.sstate, x_rows(2), shared_sel=_sel(
         2).at[0, 0].set(5))),
    ("step.state-no-indexer", "full-layer weights with a shared-layer state",
     layer.StepError, r"these weights run an indexer \(a 'full' layer\) but the state has no "
     r"indexer cache", lambda c: dsa_jax.decode(ODD, c.w, c.sstate, x_rows(2))),
    ("step.state-indexer", "shared-layer weights with a full-layer state", layer.StepError,
     r"these weights have no indexer \(a 'shared' layer\) but the state has an indexer cache",
     lambda c: dsa_jax.decode(ODD, c.ws, c.state, x_rows(2), shared_sel=_sel(2))),
    ("step.weights-config", "weights made for another config", layer.StepError,
     r"weights field x_proj is float32\[91, 80\], but the config implies "
     r"float32\[83, 80\]", lambda c: dsa_jax.decode(ODD.replace(kv_lora_rank=16), c.w,
                                                          c.state, x_rows(2))),
    ("step.state-config", "a state made for another config", layer.StepError,
     r"state field latent is float32\[24, 8, 24\], but the config implies "
     r"bfloat16\[24, 8, 24\]", lambda c: dsa_jax.decode(ODD.replace(cache_dtype="bfloat16"),
                                                           c.w, c.state, x_rows(2))),
    ("step.indexer-behind", "the indexer length behind the sequence length",
     layer.StepError, r"sequence 0: indexer length 3 is behind the sequence length 4",
     lambda c: dsa_jax.decode(ODD, c.w, _state_with(c, index_lengths=[3, 4]), x_rows(2))),
    ("step.max-context", "a write past max_context", layer.StepError,
     r"sequence 0: writing 93 token\(s\) at position 4 would reach 97, past max_context 96",
     lambda c: dsa_jax.prefill(ODD, c.w, c.state, x_rows(2, 93))),
    ("step.block-write", "a block to be written that is not mapped", layer.StepError,
     r"sequence 1: block table entry 1 is -1, outside \[0, 24\) physical blocks, but position "
     r"8 is to be written there", lambda c: dsa_jax.prefill(ODD, c.w, _state_with(
         c, block_tables=_tables(lambda t: t.__setitem__((1, 1), -1))), x_rows(2, 5))),
    ("step.block-read", "a block the step reads that is not mapped", layer.StepError,
     r"sequence 1: block table entry 0 is 99, outside \[0, 24\) physical blocks, but position "
     r"0 is read", lambda c: dsa_jax.decode(ODD, c.w, _state_with(
         c, lengths=[9, 9], index_lengths=[9, 9],
         block_tables=_tables(lambda t: t.__setitem__((1, 0), 99))), x_rows(2))),
    ("step.block-shared", "two read blocks mapped to one physical block", layer.StepError,
     r"physical block 0 is mapped twice: sequence 0 entry 0 and sequence 1 entry 0",
     lambda c: dsa_jax.decode(ODD, c.w, _state_with(
         c, block_tables=_tables(lambda t: t.__setitem__((1, 0), 0))), x_rows(2))),
    ("step.rewind-type", "fractional rewind lengths", layer.StepError,
     r"rewind lengths must be integers, got float64 \[2.5, 3.0\]",
     lambda c: dsa_jax.rewind(ODD, c.state, [2.5, 3.0])),
    ("step.rewind-shape", "rewind lengths not one per sequence", layer.StepError,
     r"rewind lengths have shape \(3,\), expected \(2,\)",
     lambda c: dsa_jax.rewind(ODD, c.state, [1, 2, 3])),
    ("step.rewind-range", "a rewind that would grow a sequence", layer.StepError,
     r"sequence 1: cannot rewind to length 5; it must be in \[0, 4\]",
     lambda c: dsa_jax.rewind(ODD, c.state, [1, 5])),
    ("step.rewind-reach", "a rewind past the indexer ring's reach", layer.StepError,
     r"cannot rewind to length 27: sequence 1: at length 27 the pool being filled needs the "
     r"indexer rows 24\.\.26, but the indexer ring \(16 rows, mark 40, guard 3\) holds raw "
     r"rows only from position 27 on",
     lambda c: dsa_jax.rewind(ODD, _state_with(c, lengths=[4, 40], index_lengths=[4, 40]),
                              [4, 27])),
    ("step.ring-reach", "a length lowered past the indexer ring's reach", layer.StepError,
     r"sequence 1: at length 27 the pool being filled needs the indexer rows 24\.\.26",
     lambda c: dsa_jax.decode(ODD, c.w, _state_with(c, lengths=[4, 27], index_lengths=[4, 40]),
                              x_rows(2))),
    ("step.out-pair", "decode's out= that is not a pair (y, sel)", layer.StepError,
     r"out must be a pair \(y, sel\) of arrays, got tuple of 1",
     lambda c: dsa_jax.decode(ODD, c.w, c.state, x_rows(2), out=_out()[:1])),
    ("step.out-array", "an out= buffer that is not a jax.Array (a numpy array)",
     layer.StepError,
     r"out y must be a concrete jax.Array \(it is donated: a call at the top level, not under "
     r"jit\), got ndarray",
     lambda c: dsa_jax.decode(ODD, c.w, c.state, x_rows(2),
                              out=(np.zeros((2, ODD.hidden_size), np.float32), _out()[1]))),
    ("step.out-shape", "an out= buffer of the wrong shape or dtype", layer.StepError,
     r"out sel is float32\[2, 15\], expected int32\[2, 15\]",
     lambda c: dsa_jax.decode(ODD, c.w, c.state, x_rows(2),
                              out=(_out()[0], _out()[1].astype(jnp.float32)))),
    ("step.out-deleted", "an out= buffer already donated (or deleted)", layer.StepError,
     r"out sel was donated to a step \(or deleted\): pass a live array",
     lambda c: dsa_jax.decode(ODD, c.w, c.state, x_rows(2), out=_out(deleted=True))),
    ("step.out-alias", "out= buffers that are one another or an input (they are donated)",
     layer.StepError, r"out y and sel must be two arrays of their own: neither one another nor "
     r"the weights, the state, x or shared_sel",
     lambda c: (lambda x: dsa_jax.decode(ODD, c.w, c.state, x, out=(x, _out()[1])))(
         jnp.zeros((2, ODD.hidden_size)))),
    ("step.out-traced", "out= buffers under the caller's jax.jit", layer.StepError,
     r"out= buffers need the eager call; inside jax.jit XLA places the outputs itself: drop "
     r"out=",
     lambda c: jax.jit(lambda s: dsa_jax.decode(ODD, c.w, s, x_rows(2), out=_out()))(c.state)),
    ("step.donated", "a state already donated to an earlier step", layer.StepError,
     r"state field latent was donated to an earlier step \(or deleted\): decode, decode_k, "
     r"prefill and write_kv_row donate the state they are given; use the state that call "
     r"returned",
     lambda c: (lambda s: (dsa_jax.decode(ODD, c.w, s, x_rows(2)),
                           dsa_jax.decode(ODD, c.w, s, x_rows(2))))(
         jax.tree.map(jnp.copy, c.state))),
    ("step.arg-order", "the arguments in another order (weights before cfg)", TypeError,
     r"cfg must be a DsaConfig, got DsaWeights \(the order is cfg, weights, state, x\)",
     lambda c: dsa_jax.decode(c.w, ODD, c.state, x_rows(2))),
    ("step.serving-kind", "serving_step of an unknown kind", layer.StepError,
     r"serving_step kind 'chunk' is not one of \('decode', 'verify', 'prefill'\)",
     lambda c: dsa_jax.serving_step(ODD, "chunk")),
    ("step.serving-rows", "a decode serving step of more than one row", layer.StepError,
     r"a decode takes one row per sequence, got rows=2; use kind='verify' for 2 rows",
     lambda c: dsa_jax.serving_step(ODD, "decode", rows=2)),
    ("step.serving-x", "x that is not the serving step's shape", layer.StepError,
     r"this decode step takes x of shape \(2, 80\), got \(2, 1, 80\)",
     lambda c: dsa_jax.serving_step(ODD, "decode")(c.w, c.state, x_rows(2, 1))),
    ("impl.pallas-off-gpu", "implementation 'pallas' off a GPU (CPU only)", ImplementationError,
     r"implementation='pallas' compiles the kernels for a GPU", lambda c: resolve("pallas")),
    ("sharding.degree", "a mesh degree that is not a positive integer", ShardingError,
     r"dp must be a positive integer, got 0", lambda c: sharding.mesh(0, 1)),
    ("sharding.devices", "a mesh needing more devices than given", ShardingError,
     r"a 1 x 2 \(dp x tp\) mesh needs 2 devices; 1 were given",
     lambda c: sharding.mesh(1, 2, jax.devices()[:1])),
    ("sharding.tp-degree", "cfg.tp_degree not the mesh's tp size", ShardingError,
     r"cfg.tp_degree is 3 but the mesh's tp axis has 1 devices",
     lambda c: sharding.init_state(ODD.replace(tp_degree=3), sharding.mesh(1, 1), 2)),
    ("sharding.split", "sequences that do not split over the dp shards", ShardingError,
     r"num_seqs must be a positive multiple of dp=1, got 0",
     lambda c: sharding.init_state(ODD, sharding.mesh(1, 1), 0)),
    ("sharding.split-selection", "a selection split over tp ranks that the sequences do not "
     "divide", ShardingError,
     r"split_selection=True: a dp shard's 3 sequences do not split over tp=2 ranks",
     lambda c: sharding.split_rule(ODD.replace(num_heads=6, tp_degree=2), 3, True)),
    ("nnx.no-weights", "DsaAttention without rngs or weights", TypeError,
     r"DsaAttention needs rngs \(random weights\) or weights",
     lambda c: __import__("dsa_jax.nnx").nnx.DsaAttention(ODD, num_seqs=1)),
    ("nnx.weights-type", "DsaAttention weights that are not DsaWeights", TypeError,
     r"weights must be DsaWeights, got dict",
     lambda c: __import__("dsa_jax.nnx").nnx.DsaAttention(ODD, num_seqs=1, weights={})),
    # ---- checkpoints
    ("ckpt.weights-list", "weights to save not a list of DsaWeights", CheckpointError,
     r"weights_by_layer must be a list of DsaWeights",
     lambda c: checkpoint.save_weights(os.path.join(c.tmp, "wl"), ODD, c.w)),
    ("ckpt.empty", "nothing to save", CheckpointError, r"weights_by_layer is empty",
     lambda c: checkpoint.save_weights(os.path.join(c.tmp, "we"), ODD, [])),
    ("ckpt.layer-ids", "layer ids not one per layer", CheckpointError,
     r"layers names 2 layer ids for 1 weights",
     lambda c: checkpoint.save_weights(os.path.join(c.tmp, "wi"), ODD, [c.w], layers=[0, 1])),
    ("ckpt.leaf", "an array whose shape or dtype the config does not imply",
     CheckpointError, r"weights_by_layer\[0\]: field x_proj is float32\[91, 80\], but the "
     r"config implies float32\[91, 96\]", lambda c: checkpoint.save_weights(
         os.path.join(c.tmp, "wf"), ODD.replace(hidden_size=96), [c.w])),
    ("ckpt.states-list", "states to save not a list of DsaState", CheckpointError,
     r"states must be a list of DsaState",
     lambda c: checkpoint.save_state(os.path.join(c.tmp, "sl"), ODD, c.state)),
    ("ckpt.exists", "an existing path without overwrite=True", CheckpointError,
     r"already exists; pass overwrite=True to replace it", lambda c: _save_twice(c, "twice")),
    ("ckpt.not-ours", "overwriting something that is not a dsa_jax checkpoint",
     CheckpointError, r"exists and is not a dsa_jax checkpoint; refusing to overwrite it",
     lambda c: checkpoint.save_weights(_json(c, "notes.txt", "keep"), ODD, [c.w],
                                       overwrite=True)),
    ("ckpt.donated", "arrays donated to a step (their buffers are gone)", CheckpointError,
     r"array layers/0/latent was donated to a step \(or deleted\)", _donated),
    ("ckpt.extra-type", "extra not a dict", CheckpointError, r"extra must be a dict, got list",
     lambda c: checkpoint.save_state(os.path.join(c.tmp, "e1"), ODD, [c.state], [1])),
    ("ckpt.extra-key", "an extra key that is not a string", CheckpointError,
     r"extra keys must be strings, got 1",
     lambda c: checkpoint.save_state(os.path.join(c.tmp, "e2"), ODD, [c.state], {1: 2})),
    ("ckpt.extra-value", "an extra value neither an array nor JSON", CheckpointError,
     r"extra\['f'\] is neither an array nor JSON-serializable", lambda c: checkpoint.save_state(
         os.path.join(c.tmp, "e3"), ODD, [c.state], {"f": object()})),
    ("ckpt.extra-dtype", "an extra array of strings or objects", CheckpointError,
     r"extra\['ids'\] is an array of dtype <U1; only numbers and bools can be stored",
     lambda c: checkpoint.save_state(os.path.join(c.tmp, "e4"), ODD, [c.state],
                                     {"ids": np.asarray(["a", "b"])})),
    ("ckpt.missing", "restoring a path that does not exist", CheckpointError,
     r"no checkpoint there \(the path does not exist\)",
     lambda c: checkpoint.restore_weights(os.path.join(c.tmp, "nothing"), ODD)),
    ("ckpt.not-checkpoint", "restoring a folder that is not a dsa_jax checkpoint",
     CheckpointError, r"not a dsa_jax checkpoint \(no readable 'dsa_jax' metadata item\)",
     lambda c: checkpoint.restore_weights(c.tmp_empty, ODD)),
    ("ckpt.newer", "a checkpoint format newer than this dsa_jax", CheckpointError,
     r"checkpoint format version 99 is newer than this dsa_jax reads \(6\)",
     lambda c: _version(c, 99)),
    ("ckpt.older", "a weights checkpoint of the layout before format 2", CheckpointError,
     r"weights checkpoint format version 1 is older than this dsa_jax reads \(2\)",
     lambda c: _version(c, 1)),
    ("ckpt.kind", "a state checkpoint restored as weights (or the reverse)", CheckpointError,
     r"this is a 'state' checkpoint, not a 'weights' checkpoint",
     lambda c: checkpoint.restore_weights(c.state_ckpt, ODD)),
    ("ckpt.config", "a checkpoint saved with another DsaConfig", CheckpointError,
     r"the state checkpoint was saved with a different DsaConfig .*1 field\(s\) differ: "
     r"max_context: checkpoint 96, given config 192",
     lambda c: checkpoint.restore_state(c.state_ckpt, ODD.replace(max_context=192))),
    ("ckpt.checksum", "an array whose bytes changed after the save", CheckpointError,
     r"array layers/0/x_proj: checksum mismatch", _changed_byte),
    ("ckpt.unreadable", "array files that cannot be decoded", CheckpointError,
     r"the stored arrays cannot be read", _damaged),
    ("ckpt.convert-none", "an HF checkpoint without attention layers", CheckpointError,
     r"no attention layers found",
     lambda c: checkpoint.convert_hf_checkpoint(_hf_file(c, drop="q_a_proj.weight"),
                                                os.path.join(c.tmp, "cv1"), ODD)),
    ("ckpt.convert-layers", "asking to convert layers the checkpoint lacks",
     CheckpointError, r"layer\(s\) \[4\] not found .* attention layers \[0\]",
     lambda c: checkpoint.convert_hf_checkpoint(_hf_file(c), os.path.join(c.tmp, "cv2"), ODD,
                                                layers=[4])),
    ("ckpt.convert-empty", "an empty list of layers to convert", CheckpointError,
     r"layers is empty: nothing to convert", lambda c: checkpoint.convert_hf_checkpoint(
         _hf_file(c), os.path.join(c.tmp, "cv3"), ODD, layers=[])),
    ("ckpt.fp8-under-bf16", "fp8 weights saved under a bf16 config", CheckpointError,
     r"field x_proj holds fp8 blocks, but the config's param_dtype is 'float32'",
     lambda c: checkpoint.save_weights(os.path.join(c.tmp, "fp8"), ODD, [fold_weights(
         ODD8, dsa_jax.init_random_hf_tensors(ODD8, jax.random.key(0)))])),
]

CASES += SERVING_CASES
