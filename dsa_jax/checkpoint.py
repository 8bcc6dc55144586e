"""Orbax checkpoints of folded weights and of whole engine states.

Two kinds of checkpoint, both orbax-checkpoint directories with two items:
- `arrays`: the arrays (an orbax `StandardSave` pytree: `{"layers": {"0": {field: array}},
  "extra": {key: array}}`), stored bit for bit in their own dtype (fp8, bf16, f32, int32).
- `dsa_jax`: JSON metadata: the kind (`"weights"` or `"state"`), a format version, the
  `DsaConfig` (its fields as JSON), per-layer facts (which layers have an indexer, the model
  layer ids of a converted checkpoint, the state's sequence and block counts) and the
  JSON-able part of a state's `extra`.

`save_weights` / `restore_weights`: a list of per-layer `DsaWeights` (a "shared" layer's
indexer fields are None and are stored as absent). `save_state` / `restore_state`: a list of
per-layer `DsaState` plus an optional dict of host metadata (an allocator's free list, request
ids), so a long prefix can be computed once and reused. `convert_hf_checkpoint`: Hugging Face
safetensors -> a weights checkpoint, folded once.

Config checks on restore: a state checkpoint must be restored into a config equal to the saved
one in every field except `implementation`, `batch_invariant` and `colaunch` (run-time
choices of how to compute: the stored arrays do not depend on them; an `Engine` runs
batch-invariant), and `weight_block` unless either config has fp8 weights. A weights
checkpoint ignores the serving geometry as well (`max_context`, `block_size`, `max_verify`,
`cache_dtype`, `index_cache_dtype`): folded weights do not depend on it, so one converted
checkpoint serves any geometry. Any other difference is a
`CheckpointError` listing every differing field with both values.

Paths are made absolute (orbax requires it). Writing over an existing path takes
`overwrite=True`, and even then only replaces an earlier dsa_jax checkpoint or an empty
directory, never an unrelated directory. Saves are atomic (the old checkpoint stays until the
new one is complete: a save that fails leaves it as it was), and every stored array's SHA-256
is kept in the metadata and verified on restore (`checkpoint_io.py`); a checkpoint written
before format 3 has no checksums and restores without that comparison.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import checkpoint_io, fp8
from dsa_jax.checkpoint_io import CheckpointError
from dsa_jax.config import DsaConfig
from dsa_jax.state import DsaState, init_state, ring_from_rows
from dsa_jax.weights import (
    DsaWeights,
    checkpoint_files,
    fold_weights,
    hf_shapes,
    read_hf_tensors,
)

FORMAT = "dsa_jax.checkpoint"
# 2: weights in the current layout (version 1 fused the indexer's query rows into q_proj);
# 3: per-array checksums in the metadata, verified on restore;
# 4: states hold the indexer ring (`dsa_jax.state`: `index_k`, `index_g` [B, Rr, Di]) instead of
# max_context raw rows; 5: states hold the pool keys in the index cache dtype (they were fp32);
# 6: fp8 weights (`param_dtype="float8_e4m3fn"`) as their blocks, each field's layout in the
# metadata (`fp8.layout`). bf16 / fp32 weights are unchanged since version 2.
FORMAT_VERSION = 6
# Weights of an older format have another layout. A state checkpoint before version 4 holds
# every raw indexer row: restore converts it to the ring (the rows the ring's mark says it
# holds, exactly as a ring state at that mark holds them). A state before version 5 holds fp32
# pool keys: restore rounds them to the index cache dtype once, as a step now stores them (the
# same fp32 key rounded: the bits this version writes). Checksums exist from version 3 on
# (older checkpoints restore without them).
MIN_VERSION = {"weights": 2, "state": 1}
CHECKSUM_VERSION = 3
RING_VERSION = 4
POOL_KEY_VERSION = 5
FP8_VERSION = 6
ARRAYS_ITEM = "arrays"
META_ITEM = "dsa_jax"
# Fields a restore does not compare, per kind (see the module docstring).
RUNTIME_FIELDS = ("implementation", "batch_invariant", "colaunch")
SERVING_FIELDS = ("max_context", "block_size", "max_verify", "cache_dtype", "index_cache_dtype")
IGNORED_FIELDS = {"weights": RUNTIME_FIELDS + SERVING_FIELDS, "state": RUNTIME_FIELDS}

_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.q_a_proj\.weight$")


# ----------------------------------------------------------------------------- config

def config_to_json(cfg: DsaConfig) -> dict[str, Any]:
    """The config's fields as a JSON-able dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_from_json(data: Mapping[str, Any]) -> DsaConfig:
    """The inverse of `config_to_json` (validated by `DsaConfig` itself)."""
    return DsaConfig(**dict(data))


def _ignored_fields(kind: str, saved: Mapping[str, Any], cfg: DsaConfig) -> tuple[str, ...]:
    """Fields a restore of `kind` does not compare: `IGNORED_FIELDS`, and `weight_block` where
    neither config has fp8 weights (only fp8 blocks depend on it; checkpoints before format 6
    do not store it)."""
    fp8_weights = fp8.FP8 in (saved.get("param_dtype"), cfg.param_dtype)
    return IGNORED_FIELDS[kind] + (() if fp8_weights else ("weight_block",))


def _check_config(path: str, kind: str, saved: Mapping[str, Any], cfg: DsaConfig) -> None:
    given = config_to_json(cfg)
    ignored = _ignored_fields(kind, saved, cfg)
    diffs = []
    for name in sorted(set(saved) | set(given)):
        if name in ignored:
            continue
        if name not in saved:
            diffs.append(f"  {name}: not in the checkpoint, {given[name]!r} in the given config")
        elif name not in given:
            diffs.append(f"  {name}: {saved[name]!r} in the checkpoint, not a field of this "
                         f"version's DsaConfig")
        elif saved[name] != given[name]:
            diffs.append(f"  {name}: checkpoint {saved[name]!r}, given config {given[name]!r}")
    if diffs:
        extra = f" ({', '.join(ignored)} may differ)" if ignored else ""
        raise CheckpointError(
            f"{path}: the {kind} checkpoint was saved with a different DsaConfig{extra}; "
            f"{len(diffs)} field(s) differ:\n" + "\n".join(diffs))


# ----------------------------------------------------------------------------- orbax I/O

def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def _abspath(path: str | os.PathLike) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def _read_meta(path: str) -> dict[str, Any] | None:
    """The metadata item of a dsa_jax checkpoint at `path`, or None if it is not one."""
    if not os.path.isfile(os.path.join(path, META_ITEM, "metadata")):
        return None
    ocp = _ocp()
    try:
        with checkpoint_io.checkpointer() as ckptr:
            meta = ckptr.restore(path, args=ocp.args.Composite(
                **{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except Exception:  # anything unreadable is "not ours"
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    return meta


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's metadata: `kind`, `config` (JSON), `has_indexer`, `layers`, ..."""
    path = _abspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no checkpoint there (the path does not exist)")
    meta = _read_meta(path)
    if meta is None:
        raise CheckpointError(f"{path}: not a dsa_jax checkpoint (no readable '{META_ITEM}' "
                              f"metadata item)")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {meta['version']} is newer "
                              f"than this dsa_jax reads ({FORMAT_VERSION})")
    return meta


def check_destination(path: str, overwrite: bool) -> None:
    """CheckpointError unless a checkpoint may be written at `path` (absolute): nothing there,
    an empty folder, or (with `overwrite`) an earlier dsa_jax checkpoint."""
    if not os.path.exists(path):
        return
    if not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
    if os.path.isdir(path) and not os.listdir(path):
        return
    if _read_meta(path) is None:
        raise CheckpointError(f"{path} exists and is not a dsa_jax checkpoint; refusing to "
                              f"overwrite it even with overwrite=True (remove it yourself)")


def _is_stored(leaf) -> bool:
    """Orbax cannot write zero-size arrays: those are rebuilt from the config on restore."""
    return int(np.prod(leaf.shape)) > 0


def _save(path: str, arrays: dict, meta: dict, overwrite: bool) -> None:
    """Check, checksum and write atomically (`checkpoint_io`): nothing is written unless every
    array can be stored, and an existing checkpoint stays until the new one is complete."""
    checkpoint_io.check_live(arrays)
    check_destination(path, overwrite)
    meta = {**meta, "checksums": {name: checkpoint_io.digest(a)
                                  for name, a in checkpoint_io.leaves(arrays).items()}}
    ocp = _ocp()
    checkpoint_io.write_atomically(path, {ARRAYS_ITEM: ocp.args.StandardSave(arrays),
                                          META_ITEM: ocp.args.JsonSave(meta)})


def _restore_arrays(path: str, meta: dict, target: dict) -> dict:
    """Read the arrays, then compare every one with its stored checksum."""
    ocp = _ocp()
    restored = checkpoint_io.restore(path, {ARRAYS_ITEM: ocp.args.StandardRestore(target)})
    restored = restored[ARRAYS_ITEM]
    checkpoint_io.verify(path, restored, meta.get("checksums")
                         if meta.get("version", 1) >= CHECKSUM_VERSION else None)
    return restored


def _abstract(shape_dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape_dtype.shape), jnp.dtype(shape_dtype.dtype),
                                sharding=sharding)


def _sharding(device):
    return jax.sharding.SingleDeviceSharding(device if device is not None else jax.devices()[0])


def _check_leaves(what: str, fields: Sequence[str], got, want) -> None:
    """Every field of `got` has the shape and dtype of `want` (both NamedTuples)."""
    for name in fields:
        g, w = getattr(got, name), getattr(want, name)
        if (g is None) != (w is None):
            raise CheckpointError(f"{what}: field {name} is {'None' if g is None else 'set'}, "
                                  f"expected {'None' if w is None else 'an array'}")
        if g is None:
            continue
        if tuple(g.shape) != tuple(w.shape) or jnp.dtype(g.dtype) != jnp.dtype(w.dtype):
            raise CheckpointError(f"{what}: field {name} is {jnp.dtype(g.dtype).name}"
                                  f"{list(g.shape)}, but the config implies "
                                  f"{jnp.dtype(w.dtype).name}{list(w.shape)}")


# ----------------------------------------------------------------------------- weights

def expected_weights(cfg: DsaConfig, has_indexer: bool = True) -> DsaWeights:
    """The shapes and dtypes (`jax.ShapeDtypeStruct`) of one layer's folded weights; under
    fp8 weights, the shapes and compute dtypes of their fields (`Fp8Block.shape`, `.dtype`)."""
    if cfg.param_dtype == fp8.FP8:
        cfg = cfg.replace(param_dtype="bfloat16")
    hf = {name: jax.ShapeDtypeStruct(shape, jnp.float32)
          for name, shape in hf_shapes(cfg, has_indexer).items()}
    return jax.eval_shape(lambda t: fold_weights(cfg, t), hf)


def save_weights(path: str | os.PathLike, cfg: DsaConfig, weights_by_layer: Sequence[DsaWeights],
                 *, layers: Sequence[int] | None = None, tp_rank: int = 0,
                 overwrite: bool = False) -> None:
    """Write per-layer folded weights (and `cfg`) as an orbax checkpoint at `path`.

    `layers`: the model layer id of each entry (recorded, returned by `read_info`); default
    `0..n-1`. `tp_rank`: the tensor-parallel rank the weights were folded for (recorded).
    """
    path = _abspath(path)
    if isinstance(weights_by_layer, DsaWeights) or not isinstance(weights_by_layer, Sequence):
        raise CheckpointError("weights_by_layer must be a list of DsaWeights, one per layer")
    if not weights_by_layer:
        raise CheckpointError("weights_by_layer is empty: nothing to save")
    layers = list(range(len(weights_by_layer))) if layers is None else [int(l) for l in layers]
    if len(layers) != len(weights_by_layer):
        raise CheckpointError(f"layers names {len(layers)} layer ids for "
                              f"{len(weights_by_layer)} weights")
    arrays, has_indexer, layouts = {}, [], []
    for i, w in enumerate(weights_by_layer):
        if not isinstance(w, DsaWeights):
            raise CheckpointError(f"weights_by_layer[{i}] is a {type(w).__name__}, not DsaWeights")
        _check_fp8(f"weights_by_layer[{i}]", cfg, w)
        _check_leaves(f"weights_by_layer[{i}]", DsaWeights._fields, w,
                      expected_weights(cfg, w.has_indexer))
        has_indexer.append(bool(w.has_indexer))
        kept = {name: getattr(w, name) for name in DsaWeights._fields
                if getattr(w, name) is not None and _is_stored(getattr(w, name))}
        arrays[str(i)] = {name: fp8.stored_arrays(f) for name, f in kept.items()}
        layouts.append({name: fp8.layout(f) for name, f in kept.items()})
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "kind": "weights",
            "config": config_to_json(cfg), "num_layers": len(weights_by_layer),
            "has_indexer": has_indexer, "layers": layers, "tp_rank": int(tp_rank)}
    if cfg.param_dtype == fp8.FP8:
        meta["layouts"] = layouts
    _save(path, {"layers": arrays}, meta, overwrite)


def _check_fp8(what: str, cfg: DsaConfig, w: DsaWeights) -> None:
    """Fields kept as fp8 only under fp8 weights, each in the config's blocks."""
    for name in DsaWeights._fields:
        f = getattr(w, name)
        if f is None:
            continue
        if fp8.is_fp8(f) and cfg.param_dtype != fp8.FP8:
            raise CheckpointError(f"{what}: field {name} holds fp8 blocks, but the config's "
                                  f"param_dtype is {cfg.param_dtype!r}")
        problem = fp8.layout_problem(fp8.layout(f), cfg.weight_block)
        if problem:
            raise CheckpointError(f"{what}: field {name} holds {problem}")


def _info_of_kind(path: str, kind: str, cfg: DsaConfig) -> dict[str, Any]:
    meta = read_info(path)
    if meta.get("kind") != kind:
        raise CheckpointError(f"{path}: this is a {meta.get('kind')!r} checkpoint, not a "
                              f"{kind!r} checkpoint")
    if meta.get("version", 0) < MIN_VERSION[kind]:
        raise CheckpointError(f"{path}: {kind} checkpoint format version {meta.get('version')} "
                              f"is older than this dsa_jax reads ({MIN_VERSION[kind]}); "
                              f"convert the Hugging Face checkpoint again")
    _check_config(path, kind, meta["config"], cfg)
    return meta


def weights_info(path: str | os.PathLike, cfg: DsaConfig) -> dict[str, Any]:
    """`read_info` of a weights checkpoint that `cfg` can restore (kind and config checked,
    no array read): CheckpointError otherwise."""
    return _info_of_kind(_abspath(path), "weights", cfg)


def restore_weights(path: str | os.PathLike, cfg: DsaConfig, *, device=None
                    ) -> list[DsaWeights]:
    """Read a `save_weights` checkpoint: one `DsaWeights` per saved layer, on `device`
    (default: the first device). `cfg` must match the saved config (module docstring)."""
    path = _abspath(path)
    meta = _info_of_kind(path, "weights", cfg)
    sharding = _sharding(device)
    expected = [expected_weights(cfg, hi) for hi in meta["has_indexer"]]
    layouts = _stored_layouts(path, meta, cfg, expected)
    target = {"layers": {
        str(i): {name: fp8.layout_targets(lay, lambda d, s: _abstract(
            jax.ShapeDtypeStruct(s, d), sharding)) for name, lay in layouts[i].items()}
        for i in range(len(expected))}}
    restored = _restore_arrays(path, meta, target)["layers"]
    out = []
    for i, e in enumerate(expected):
        got = restored.get(str(i), {})
        fields = {}
        for name in DsaWeights._fields:
            spec = getattr(e, name)
            if spec is None:
                fields[name] = None
            elif name in got:
                fields[name] = fp8.from_stored(got[name], layouts[i][name])
            else:  # zero-size: never written
                fields[name] = jax.device_put(jnp.zeros(spec.shape, spec.dtype), sharding)
        out.append(DsaWeights(**fields))
    for i, (w, e) in enumerate(zip(out, expected, strict=True)):  # an fp8 field's shape
        _check_leaves(f"{path}: layer {i}", DsaWeights._fields, w, e)
    return out


def _stored_layouts(path: str, meta: dict, cfg: DsaConfig, expected: list) -> list[dict]:
    """Each layer's stored fields and their layouts (`fp8.layout`): from the metadata under
    fp8 weights (checked against the config), else the config's arrays."""
    if cfg.param_dtype != fp8.FP8:
        return [{name: {"array": [jnp.dtype(spec.dtype).name, list(spec.shape)]}
                 for name in DsaWeights._fields
                 if (spec := getattr(e, name)) is not None and _is_stored(spec)}
                for e in expected]
    layouts = meta.get("layouts")
    if meta.get("version", 0) < FP8_VERSION or not isinstance(layouts, list) \
            or len(layouts) != len(expected):
        raise CheckpointError(f"{path}: the fp8 weights' layouts are missing from the "
                              f"metadata (format version {meta.get('version')}; fp8 weights "
                              f"are stored from version {FP8_VERSION} on)")
    for i, (lay, e) in enumerate(zip(layouts, expected, strict=True)):
        want = {name for name in DsaWeights._fields
                if (spec := getattr(e, name)) is not None and _is_stored(spec)}
        if set(lay) != want:
            raise CheckpointError(f"{path}: layer {i} stores fields {sorted(lay)}, the config "
                                  f"implies {sorted(want)}")
        for name, field in lay.items():
            problem = fp8.layout_problem(field, cfg.weight_block)
            if problem:
                raise CheckpointError(f"{path}: layer {i} field {name} holds {problem}")
    return layouts


def _hf_layers(src: str) -> list[int]:
    found = set()
    for name in checkpoint_files(src):
        m = _HF_LAYER.search(name)
        if m:
            found.add(int(m.group(1)))
    return sorted(found)


def convert_hf_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, cfg: DsaConfig,
                          layers: list[int] | None = None, *, tp_rank: int = 0,
                          overwrite: bool = False,
                          fp8_block: tuple[int, int] | None = None) -> list[int]:
    """Fold the DSA layers of a Hugging Face checkpoint into an orbax weights checkpoint.

    `src`: a safetensors file or a (sharded) checkpoint folder. `layers`: the model layer ids
    to convert; None means every layer with `*layers.{l}.self_attn.q_a_proj.weight`. Each
    layer is read and checked (`read_hf_tensors`), folded for `tp_rank` (`fold_weights`) and
    moved to host memory before the next is read. Returns the converted layer ids, in order;
    `restore_weights(dst, cfg)[i]` is layer `layers[i]`.
    """
    src_path, dst_path = os.fspath(src), _abspath(dst)
    found = _hf_layers(src_path)
    if layers is None:
        if not found:
            raise CheckpointError(f"{src_path}: no attention layers found (no tensor named "
                                  f"'*layers.<l>.self_attn.q_a_proj.weight')")
        layers = found
    else:
        layers = [int(l) for l in layers]
        if not layers:
            raise CheckpointError("layers is empty: nothing to convert")
        missing = [l for l in layers if l not in found]
        if missing:
            raise CheckpointError(
                f"{src_path}: layer(s) {missing} not found (no "
                f"'*layers.{missing[0]}.self_attn.q_a_proj.weight'); the checkpoint has "
                f"attention layers {found}")
    check_destination(dst_path, overwrite)  # fail before the (long) reading
    folded = [jax.device_get(fold_weights(cfg, read_hf_tensors(src_path, cfg, l,
                                                                fp8_block=fp8_block), tp_rank))
              for l in layers]
    save_weights(dst_path, cfg, folded, layers=layers, tp_rank=tp_rank, overwrite=overwrite)
    return list(layers)


# ----------------------------------------------------------------------------- state

def _state_has_indexer(state: DsaState) -> bool:
    return state.index_k.shape[1] > 0


def expected_state(cfg: DsaConfig, num_seqs: int, num_blocks: int, has_indexer: bool = True
                   ) -> DsaState:
    """The shapes and dtypes (`jax.ShapeDtypeStruct`) of one layer's state."""
    return jax.eval_shape(lambda: init_state(cfg, num_seqs, num_blocks=num_blocks,
                                             has_indexer=has_indexer))


def _with_all_rows(cfg: DsaConfig, e: DsaState) -> DsaState:
    """`e` with the indexer rows of a checkpoint before version 4: `[B, max_context, Di]`."""
    shape = (e.index_k.shape[0], cfg.max_context, e.index_k.shape[2])
    return e._replace(index_k=jax.ShapeDtypeStruct(shape, e.index_k.dtype),
                      index_g=jax.ShapeDtypeStruct(shape, e.index_g.dtype))


def _with_f32_pool_keys(e: DsaState) -> DsaState:
    """`e` with the pool keys of a checkpoint before version 5: fp32."""
    return e._replace(pool_keys=jax.ShapeDtypeStruct(e.pool_keys.shape, jnp.float32))


def _split_extra(extra: Mapping[str, Any] | None) -> tuple[dict, dict, dict]:
    """Host metadata -> (arrays, their manifest, JSON values)."""
    if extra is None:
        return {}, {}, {}
    if not isinstance(extra, Mapping):
        raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}")
    arrays, manifest, values = {}, {}, {}
    for key, value in extra.items():
        if not isinstance(key, str):
            raise CheckpointError(f"extra keys must be strings, got {key!r}")
        if isinstance(value, (np.ndarray, jax.Array)):
            if isinstance(value, jax.Array) and value.is_deleted():
                raise CheckpointError(f"extra[{key!r}] was donated to a step (or deleted)")
            a = np.asarray(value)
            if not checkpoint_io.storable(a):
                raise CheckpointError(f"extra[{key!r}] is an array of dtype {a.dtype}; only "
                                      f"numbers and bools can be stored (convert it to a list "
                                      f"for JSON)")
            manifest[key] = {"shape": list(a.shape), "dtype": a.dtype.name}
            if _is_stored(a):
                arrays[key] = a
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"extra[{key!r}] is neither an array nor JSON-serializable "
                                  f"({e}); convert it first (numpy scalars: .item())") from e
        values[key] = value
    return arrays, manifest, values


def save_state(path: str | os.PathLike, cfg: DsaConfig, states: Sequence[DsaState],
               extra: Mapping[str, Any] | None = None, *, overwrite: bool = False) -> None:
    """Write an engine state: per-layer `DsaState` (caches, block tables, lengths) + `extra`.

    `extra`: host metadata, a dict with string keys whose values are numpy/jax arrays
    (restored as numpy arrays of the same dtype and shape) or JSON values (restored through
    JSON: tuples come back as lists). The states are read, not consumed: they stay usable.
    """
    path = _abspath(path)
    if isinstance(states, DsaState) or not isinstance(states, Sequence):
        raise CheckpointError("states must be a list of DsaState, one per layer")
    if not states:
        raise CheckpointError("states is empty: nothing to save")
    num_seqs, num_blocks = states[0].num_seqs, int(states[0].latent.shape[0])
    arrays, has_indexer = {}, []
    for i, s in enumerate(states):
        if not isinstance(s, DsaState):
            raise CheckpointError(f"states[{i}] is a {type(s).__name__}, not DsaState")
        hi = _state_has_indexer(s)
        _check_leaves(f"states[{i}]", DsaState._fields, s,
                      expected_state(cfg, num_seqs, num_blocks, hi))
        has_indexer.append(hi)
        arrays[str(i)] = {name: getattr(s, name) for name in DsaState._fields
                          if _is_stored(getattr(s, name))}
    extra_arrays, manifest, values = _split_extra(extra)
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "kind": "state",
            "config": config_to_json(cfg), "num_layers": len(states),
            "has_indexer": has_indexer, "num_seqs": num_seqs, "num_blocks": num_blocks,
            "extra": None if extra is None else {"arrays": manifest, "values": values}}
    _save(path, {"layers": arrays, "extra": extra_arrays}, meta, overwrite)


def restore_state(path: str | os.PathLike, cfg: DsaConfig, *, device=None
                  ) -> tuple[list[DsaState], dict[str, Any] | None]:
    """Read a `save_state` checkpoint: `(states, extra)`, the states on `device` (default:
    the first device); `extra` is None if none was saved. `cfg` must match the saved config in
    every field but the run-time ones (`RUNTIME_FIELDS`) and `weight_block` unless either
    config has fp8 weights."""
    path = _abspath(path)
    meta = _info_of_kind(path, "state", cfg)
    sharding = _sharding(device)
    expected = [expected_state(cfg, meta["num_seqs"], meta["num_blocks"], hi)
                for hi in meta["has_indexer"]]
    # Before version 4 an indexer layer stored max_context raw rows: read those, then convert.
    all_rows = meta.get("version", 1) < RING_VERSION
    f32_keys = meta.get("version", 1) < POOL_KEY_VERSION
    stored = [_with_all_rows(cfg, e) if all_rows and hi else e
              for e, hi in zip(expected, meta["has_indexer"], strict=True)]
    stored = [_with_f32_pool_keys(e) if f32_keys else e for e in stored]
    layer_target = {str(i): {name: _abstract(getattr(e, name), sharding)
                             for name in DsaState._fields if _is_stored(getattr(e, name))}
                    for i, e in enumerate(stored)}
    extra_meta = meta.get("extra")
    manifest = extra_meta["arrays"] if extra_meta else {}
    extra_target = {key: np.zeros(m["shape"], np.dtype(m["dtype"]))
                    for key, m in manifest.items() if int(np.prod(m["shape"])) > 0}
    restored = _restore_arrays(path, meta, {"layers": layer_target, "extra": extra_target})
    states = []
    for i, e in enumerate(expected):
        got = dict(restored["layers"].get(str(i), {}))
        if all_rows and meta["has_indexer"][i]:
            marks = np.asarray(got["index_lengths"])
            for name in ("index_k", "index_g"):
                got[name] = jax.device_put(ring_from_rows(cfg, got[name], marks), sharding)
        if f32_keys and "pool_keys" in got:
            got["pool_keys"] = jax.device_put(
                jnp.asarray(got["pool_keys"]).astype(e.pool_keys.dtype), sharding)
        states.append(DsaState(**{
            name: got[name] if name in got else
            jax.device_put(jnp.zeros(getattr(e, name).shape, getattr(e, name).dtype), sharding)
            for name in DsaState._fields}))
    if extra_meta is None:
        return states, None
    extra: dict[str, Any] = dict(extra_meta["values"])
    for key, m in manifest.items():
        got = restored.get("extra", {}).get(key)
        extra[key] = (np.asarray(got) if got is not None
                      else np.zeros(m["shape"], np.dtype(m["dtype"])))
    return states, extra


__all__ = [
    "CheckpointError", "check_destination", "config_from_json", "config_to_json",
    "convert_hf_checkpoint",
    "expected_state", "expected_weights", "read_info", "restore_state", "restore_weights",
    "save_state", "save_weights", "weights_info",
]
