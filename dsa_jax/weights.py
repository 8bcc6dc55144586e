"""The weights pytree, Hugging Face safetensors loading, and the load-time folds.

Two forms exist:
- *HF tensors*: a dict from the HF tensor name inside one layer (`"q_a_proj.weight"`,
  `"indexer.wk.weight"`, ...) to an array of the checkpoint's shape. The reference consumes
  this form, unfolded, so it stays a literal rendering of SPEC.md.
- `DsaWeights`: what the serving paths consume, built by `fold_weights`. Every fold is listed
  in `fold_weights`'s docstring and happens there, once.

fp8 checkpoints (Hugging Face "fine-grained fp8", as in the DeepSeek-V3 / GLM-5 FP8 releases):
a `float8_e4m3fn` (or `float8_e5m2`) tensor `name` is stored with a float32 scale
`name + "_scale_inv"`, one per `[128, 128]` block of the `[out, in]` weight (grid
`[ceil(out / 128), ceil(in / 128)]`; a one-element scale is per tensor), and its value is
`weight * scale_inv` blockwise. `dequantize_fp8` applies it (in fp32); `fold_weights` and
`read_hf_tensors` call it, so an fp8 tensor is never used without its scale: one without
refuses with `WeightError`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsa_jax import fp8
from dsa_jax.config import DsaConfig
from dsa_jax.errors import WeightError

FP8_DTYPES, SCALE_SUFFIX = fp8.FP8_DTYPES, fp8.SCALE_SUFFIX
DEFAULT_FP8_BLOCK = (128, 128)  # HF quantization_config.weight_block_size of the fp8 releases
# safetensors dtypes that its numpy reader cannot build (numpy has no fp8): read raw.
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
               "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def _dtype_name(a) -> str:
    return jnp.dtype(a.dtype).name


def dequantize_fp8(hf: Mapping[str, np.ndarray | jax.Array], *,
                   block: tuple[int, int] = DEFAULT_FP8_BLOCK, where: str = "layer"
                   ) -> dict[str, np.ndarray | jax.Array]:
    """HF tensors with fp8 weights and their `*_scale_inv` scales -> the same tensors with
    every fp8 one replaced by `float32(weight) * scale` (blockwise, `block = [rows, cols]`
    per scale entry) and the scale entries dropped. Other tensors pass through untouched.

    `WeightError`: an fp8 tensor without its scale, a scale whose grid does not fit the
    weight and `block`, or a scale beside a tensor that is not fp8.
    """
    out = {}
    for name, value in hf.items():
        if name.endswith(SCALE_SUFFIX):
            base = name[:-len(SCALE_SUFFIX)]
            if base not in hf or _dtype_name(hf[base]) not in FP8_DTYPES:
                raise WeightError(f"{where}: scale {name!r} is there, but {base!r} is "
                                  f"{'missing' if base not in hf else _dtype_name(hf[base])}"
                                  f", not an fp8 tensor {FP8_DTYPES}")
            continue
        if _dtype_name(value) not in FP8_DTYPES:
            out[name] = value
            continue
        scale_name = name + SCALE_SUFFIX
        if scale_name not in hf:
            raise WeightError(f"{where}: tensor {name!r} is {_dtype_name(value)} without its "
                              f"scale {scale_name!r}: its values are meaningless unscaled "
                              f"(HF fp8 checkpoints store it beside the weight)")
        out[name] = _apply_scale(name, np.asarray(value), np.asarray(hf[scale_name]), block,
                                 where)
    return out


def _apply_scale(name: str, w: np.ndarray, scale: np.ndarray, block: tuple[int, int],
                 where: str) -> np.ndarray:
    """`w [out, in]` fp8 times its per-block (or per-tensor) scale, in fp32."""
    s = fp8.scale_grid(name, w, scale, block, where)
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:w.shape[0], :w.shape[1]]
    return w.astype(np.float32) * full


def hf_shapes(cfg: DsaConfig, has_indexer: bool = True) -> dict[str, tuple[int, ...]]:
    """The HF name and `[out, in]` shape of every tensor of one layer (all heads)."""
    D, H, R, C = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dv, Hi, Di, KP = (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.index_n_heads,
                          cfg.index_head_dim, cfg.index_kpool)
    shapes = {
        "q_a_proj.weight": (R, D),
        "q_a_layernorm.weight": (R,),
        "q_b_proj.weight": (H * Dn, R),
        "kv_a_proj_with_mqa.weight": (C + cfg.qk_rope_head_dim, D),
        "kv_a_layernorm.weight": (C,),
        "kv_b_proj.weight": (H * (Dn + Dv), C),
        "o_proj.weight": (D, H * Dv),
    }
    if has_indexer:
        shapes.update({
            "indexer.wq_b.weight": (Hi * Di, R),
            "indexer.wk.weight": (Di, D),
            "indexer.k_norm.weight": (Di,),
            "indexer.k_norm.bias": (Di,),
            "indexer.weights_proj.weight": (Hi, D),
            "indexer.index_kpool_compress_gate": (Di, D),
            "indexer.index_kpool_compress_ape": (KP, Di),
        })
    return shapes


class DsaWeights(NamedTuple):
    """One layer's folded weights for one tensor-parallel rank (`Hl` = heads on the rank).

    `Nx = R_q + C (+ 2*Di + Hi)`: the indexer's k, gate and head-weight rows ride along in the
    input GEMM, whose shape is the same at every tensor-parallel degree. The indexer's query
    (`qi_proj`) is a GEMM of its own over `q_resid`, never fused with this rank's `q_b` rows:
    fused, its shape (and so, on a GPU, its algorithm and its bits) would change with the
    degree, and the selection with it. A "shared" layer has no indexer and its indexer fields
    are None.
    """

    x_proj: jax.Array  # [Nx, D] param dtype: q_a ; kv_a ; indexer wk ; gate ; weights_proj*s
    q_a_norm: jax.Array  # [R_q] f32
    kv_a_norm: jax.Array  # [C] f32
    q_proj: jax.Array  # [Hl*Dn, R_q] param dtype: q_b, this rank's heads
    qi_proj: jax.Array | None  # [Hi*Di, R_q] param dtype: indexer wq_b (every rank, all of it)
    u_k: jax.Array  # [Hl, Dn, C] param dtype: key half of kv_b_proj
    u_v: jax.Array  # [Hl, Dv, C] param dtype: value half of kv_b_proj
    o_proj: jax.Array  # [D, Hl*Dv] param dtype
    k_norm_w: jax.Array | None  # [Di] f32
    k_norm_b: jax.Array | None  # [Di] f32
    ape: jax.Array | None  # [KP, Di] f32

    @property
    def has_indexer(self) -> bool:
        return self.k_norm_w is not None


def head_weight_scale(cfg: DsaConfig) -> float:
    """`Hi^-0.5 * Di^-0.5`, folded into `weights_proj` (relu(s*a) = s*relu(a) for s > 0)."""
    return float(cfg.index_n_heads) ** -0.5 * float(cfg.index_head_dim) ** -0.5


def compute_dtype(cfg: DsaConfig) -> np.dtype:
    """The dtype the projections' GEMMs multiply in: `param_dtype`, bf16 for fp8 weights."""
    return jnp.dtype(fp8.COMPUTE_DTYPE if cfg.param_dtype == fp8.FP8 else cfg.param_dtype)


@functools.cache
def expected_weight_fields(cfg: DsaConfig, has_indexer: bool
                           ) -> dict[str, tuple[tuple[int, ...], np.dtype] | None]:
    """Field -> (shape, dtype) of one rank's folded weights (what `fold_weights` makes);
    None for the indexer fields of a "shared" layer. Cached: read it, do not change it."""
    D, R, C, Hl = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.local_heads
    Dn, Dv, Hi, Di = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.index_n_heads, cfg.index_head_dim
    pdt, f32 = compute_dtype(cfg), np.dtype(np.float32)
    nx = R + C + (2 * Di + Hi if has_indexer else 0)
    fields = {
        "x_proj": ((nx, D), pdt), "q_a_norm": ((R,), f32), "kv_a_norm": ((C,), f32),
        "q_proj": ((Hl * Dn, R), pdt), "qi_proj": ((Hi * Di, R), pdt),
        "u_k": ((Hl, Dn, C), pdt), "u_v": ((Hl, Dv, C), pdt), "o_proj": ((D, Hl * Dv), pdt),
        "k_norm_w": ((Di,), f32), "k_norm_b": ((Di,), f32),
        "ape": ((cfg.index_kpool, Di), f32),
    }
    if not has_indexer:
        fields.update(qi_proj=None, k_norm_w=None, k_norm_b=None, ape=None)
    return fields


def fold_weights(cfg: DsaConfig, hf: Mapping[str, np.ndarray | jax.Array], tp_rank: int = 0,
                 *, fp8_block: tuple[int, int] | None = None) -> DsaWeights:
    """HF tensors of one layer -> `DsaWeights` for rank `tp_rank`.

    The folds, all exact rewrites of SPEC.md:
    - `weights_proj` is multiplied by `Hi^-0.5 * Di^-0.5` (in fp32, then cast), so pool scores
      are `sum_h w[h] * relu(qi[h] . K_p)` with no further scaling.
    - `kv_b_proj` is split into `U_k [H, Dn, C]` and `U_v [H, Dv, C]` and applied at run time
      (no absorption into `q_b_proj`/`o_proj`: at batch 1 that reads fewer weight bytes).
    - `q_a`, `kv_a`, the indexer's `wk`, gate and `weights_proj` are stacked into one `[Nx, D]`
      GEMM over the input. `q_b` (this rank's heads) and the indexer's `wq_b` stay two GEMMs
      over `q_resid`, so that every indexer GEMM has the same shape at every TP degree
      (selection bitwise independent of the degree; `DsaWeights`).
    - Heads `[tp_rank*Hl, (tp_rank+1)*Hl)` of `q_b`, `kv_b` and `o_proj` are kept; the
      input GEMM and the indexer are the same on every rank.
    - Norm weights, the LayerNorm bias and `ape` are stored fp32.
    An fp8 tensor is first multiplied by its `*_scale_inv` (`dequantize_fp8`, `fp8_block`:
    the checkpoint's block, default `cfg.weight_block`), except under
    `cfg.param_dtype="float8_e4m3fn"`: there every fp8 GEMM weight stays fp8 with its scales
    (`fp8.Fp8Block`; the same folds on whole blocks, `_fold_fp8`).
    """
    if not isinstance(tp_rank, (int, np.integer)) or not 0 <= tp_rank < cfg.tp_degree:
        raise WeightError(f"tp_rank {tp_rank!r} is outside [0, tp_degree={cfg.tp_degree})")
    fp8_block = tuple(cfg.weight_block if fp8_block is None else fp8_block)
    if cfg.param_dtype == fp8.FP8:
        return _fold_fp8(cfg, hf, tp_rank, fp8_block)
    hf = dequantize_fp8(hf, block=fp8_block)
    has_indexer = any(name.startswith("indexer.") for name in hf)
    check_hf_tensors(cfg, hf, has_indexer)
    pdt = jnp.dtype(cfg.param_dtype)
    H, Hl, C = cfg.num_heads, cfg.local_heads, cfg.kv_lora_rank
    Dn, Dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    heads = slice(tp_rank * Hl, (tp_rank + 1) * Hl)

    def f32(name):
        return jnp.asarray(hf[name], jnp.float32)

    q_b = f32("q_b_proj.weight").reshape(H, Dn, -1)[heads].reshape(Hl * Dn, -1)
    kv_b = f32("kv_b_proj.weight").reshape(H, Dn + Dv, C)[heads]
    o = f32("o_proj.weight").reshape(cfg.hidden_size, H, Dv)[:, heads].reshape(
        cfg.hidden_size, Hl * Dv)
    x_rows = [f32("q_a_proj.weight"), f32("kv_a_proj_with_mqa.weight")[:C]]
    if has_indexer:
        x_rows += [f32("indexer.wk.weight"), f32("indexer.index_kpool_compress_gate"),
                   f32("indexer.weights_proj.weight") * head_weight_scale(cfg)]
    return DsaWeights(
        x_proj=jnp.concatenate(x_rows, axis=0).astype(pdt),
        q_a_norm=f32("q_a_layernorm.weight"),
        kv_a_norm=f32("kv_a_layernorm.weight"),
        q_proj=q_b.astype(pdt),
        qi_proj=f32("indexer.wq_b.weight").astype(pdt) if has_indexer else None,
        u_k=kv_b[:, :Dn].astype(pdt),
        u_v=kv_b[:, Dn:].astype(pdt),
        o_proj=o.astype(pdt),
        k_norm_w=f32("indexer.k_norm.weight") if has_indexer else None,
        k_norm_b=f32("indexer.k_norm.bias") if has_indexer else None,
        ape=f32("indexer.index_kpool_compress_ape") if has_indexer else None,
    )


def _fold_fp8(cfg: DsaConfig, hf, tp_rank: int, block: tuple[int, int]) -> DsaWeights:
    """`fold_weights` keeping fp8 GEMM weights in their blocks: the same folds, on whole
    blocks (head slices, the U_k / U_v split, the stacked input rows); unquantized tensors
    are bf16 (norms, bias and `ape` fp32), and `weights_proj` (scaled by a fold) dense."""
    where = "layer"
    has_indexer = any(name.startswith("indexer.") for name in hf)
    view = {n: jax.ShapeDtypeStruct(v.shape, jnp.float32 if _dtype_name(v) in FP8_DTYPES
                                    else v.dtype)
            for n, v in hf.items() if not n.endswith(SCALE_SUFFIX)}
    for n in hf:
        if n.endswith(SCALE_SUFFIX) and (n[:-len(SCALE_SUFFIX)] not in hf or _dtype_name(
                hf[n[:-len(SCALE_SUFFIX)]]) not in FP8_DTYPES):
            raise WeightError(f"{where}: scale {n!r} is there, but its tensor is not an fp8 "
                              f"tensor {FP8_DTYPES}")
    check_hf_tensors(cfg, view, has_indexer)
    H, Hl, C = cfg.num_heads, cfg.local_heads, cfg.kv_lora_rank
    Dn, Dv = cfg.qk_nope_head_dim, cfg.v_head_dim

    def kept(name):
        return fp8.kept(hf, name, block, where)

    def f32(name):
        return jnp.asarray(hf[name], jnp.float32)

    q_b = fp8.cut(kept("q_b_proj.weight"), -2, tp_rank * Hl * Dn, (tp_rank + 1) * Hl * Dn,
                  "q_b_proj.weight", where)
    kv_b = fp8.split_heads(kept("kv_b_proj.weight"), H, "kv_b_proj.weight", where)
    # kv_b: [H, Dn + Dv, C]
    heads = slice(tp_rank * Hl, (tp_rank + 1) * Hl)  # the rank's heads: a leading axis
    kv_b = fp8.Fp8Block(kv_b.values[heads], kv_b.scale[heads], kv_b.block) \
        if isinstance(kv_b, fp8.Fp8Block) else kv_b[heads]
    o = fp8.cut(kept("o_proj.weight"), -1, tp_rank * Hl * Dv, (tp_rank + 1) * Hl * Dv,
                "o_proj.weight", where)
    rows = [kept("q_a_proj.weight"),
            fp8.cut(kept("kv_a_proj_with_mqa.weight"), -2, 0, C, "kv_a_proj_with_mqa.weight",
                    where)]
    if has_indexer:  # weights_proj: the fold scales its fp32 values (dequantized if fp8)
        wp = dequantize_fp8({k: v for k, v in hf.items()
                             if k.startswith("indexer.weights_proj.weight")}, block=block,
                            where=where)["indexer.weights_proj.weight"]
        rows += [kept("indexer.wk.weight"), kept("indexer.index_kpool_compress_gate"),
                 np.asarray(wp, np.float32) * np.float32(head_weight_scale(cfg))]
    return DsaWeights(
        x_proj=fp8.stack_rows(rows),
        q_a_norm=f32("q_a_layernorm.weight"),
        kv_a_norm=f32("kv_a_layernorm.weight"),
        q_proj=fp8.compute(q_b),
        qi_proj=fp8.compute(kept("indexer.wq_b.weight")) if has_indexer else None,
        u_k=fp8.compute(fp8.cut(kv_b, -2, 0, Dn, "kv_b_proj.weight", where)),
        u_v=fp8.compute(fp8.cut(kv_b, -2, Dn, Dn + Dv, "kv_b_proj.weight", where)),
        o_proj=fp8.compute(o),
        k_norm_w=f32("indexer.k_norm.weight") if has_indexer else None,
        k_norm_b=f32("indexer.k_norm.bias") if has_indexer else None,
        ape=f32("indexer.index_kpool_compress_ape") if has_indexer else None,
    )


def check_hf_tensors(cfg: DsaConfig, hf: Mapping[str, np.ndarray | jax.Array],
                     has_indexer: bool, where: str = "layer") -> None:
    """Every expected tensor present, of the expected shape and a floating dtype."""
    for name, shape in hf_shapes(cfg, has_indexer).items():
        if name not in hf:
            raise WeightError(f"{where}: tensor {name!r} is missing (expected shape {shape})")
        found = tuple(hf[name].shape)
        if found != shape:
            raise WeightError(f"{where}: tensor {name!r} has shape {found}, expected {shape}")
        dtype = jnp.dtype(hf[name].dtype)
        if dtype.name in FP8_DTYPES:
            raise WeightError(f"{where}: tensor {name!r} is {dtype.name} without its scale "
                              f"{name + SCALE_SUFFIX!r} applied (use dequantize_fp8)")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise WeightError(f"{where}: tensor {name!r} has dtype {dtype}, expected a "
                              f"floating dtype (float32, bfloat16 or float16)")


def checkpoint_files(path: str) -> dict[str, str]:
    """Map tensor name -> safetensors file, for one file or a sharded checkpoint folder."""
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise WeightError(f"{index}: not a JSON object ({e})") from None
            if not isinstance(weight_map, dict):
                raise WeightError(f"{index}: no \"weight_map\" object (tensor name -> file), "
                                  f"got {type(weight_map).__name__}")
            return {name: os.path.join(path, file) for name, file in weight_map.items()}
        single = os.path.join(path, "model.safetensors")
        if not os.path.exists(single):
            raise WeightError(f"{path}: neither model.safetensors.index.json nor "
                              f"model.safetensors is there")
        path = single
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            return {name: path for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise WeightError(f"{path}: not a readable safetensors file ({e})") from None


def _layer_prefix(names, layer: int) -> str | None:
    """The prefix under which layer `layer`'s attention lives (text or multimodal model)."""
    marker = f"layers.{layer}.self_attn."
    for name in names:
        at = name.find(marker)
        if at >= 0 and (at == 0 or name[at - 1] == "."):
            return name[:at + len(marker)]
    return None


def _read_tensor(file: str, name: str) -> np.ndarray:
    """One tensor of a safetensors file in its stored dtype; a shard that is missing or not a
    safetensors file is a `WeightError` naming it."""
    from safetensors import SafetensorError

    try:
        return _read_stored(file, name)
    except WeightError:
        raise  # already names the file and the tensor
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise WeightError(f"{file}: cannot read tensor {name!r} ({type(e).__name__}: "
                          f"{e})") from None


def _read_stored(file: str, name: str) -> np.ndarray:
    """One tensor of a safetensors file in its stored dtype (fp8 too: numpy has no fp8, so
    those are read from the file's bytes through ml_dtypes)."""
    from safetensors import safe_open

    with safe_open(file, framework="numpy") as f:
        stored = f.get_slice(name).get_dtype()
        if stored not in _RAW_DTYPES:
            return f.get_tensor(name)
    with open(file, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(header_len))[name]
        start, end = info["data_offsets"]
        fh.seek(8 + header_len + start)
        data = fh.read(end - start)
    dtype = np.dtype(_RAW_DTYPES[stored])
    if len(data) != int(np.prod(info["shape"])) * dtype.itemsize:
        raise WeightError(f"{file}: tensor {name!r} ({stored} {info['shape']}) has "
                          f"{len(data)} bytes of data")
    return np.frombuffer(data, dtype).reshape(info["shape"])


def read_hf_tensors(path: str | os.PathLike, cfg: DsaConfig, layer: int, *,
                    fp8_block: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Read layer `layer`'s attention tensors (HF names, checkpoint dtypes), checked. fp8
    tensors come back as float32 with their `*_scale_inv` applied (`dequantize_fp8`;
    `fp8_block`: the checkpoint's block, default `cfg.weight_block`), except under
    `cfg.param_dtype="float8_e4m3fn"`: there they come back as stored, beside their scales,
    for `fold_weights` to keep (and check)."""
    path = os.fspath(path)
    files = checkpoint_files(path)
    prefix = _layer_prefix(files, layer)
    if prefix is None:
        raise WeightError(f"{path}: no attention tensors for layer {layer} "
                          f"(looked for '*layers.{layer}.self_attn.*')")
    # A layer with any indexer tensor is a "full" layer and needs all of them.
    has_indexer = any(name.startswith(prefix + "indexer.") for name in files)
    wanted = hf_shapes(cfg, has_indexer)
    tensors = {}
    for name in wanted:
        full = prefix + name
        if full not in files:
            raise WeightError(f"{path}: tensor {full!r} is missing "
                              f"(expected shape {wanted[name]})")
        tensors[name] = _read_tensor(files[full], full)
        if full + SCALE_SUFFIX in files:
            tensors[name + SCALE_SUFFIX] = _read_tensor(files[full + SCALE_SUFFIX],
                                                        full + SCALE_SUFFIX)
    where = f"{path} layer {layer}"
    if cfg.param_dtype == fp8.FP8:
        return tensors
    tensors = dequantize_fp8(tensors, block=tuple(cfg.weight_block if fp8_block is None
                                                  else fp8_block), where=where)
    check_hf_tensors(cfg, tensors, has_indexer, where=where)
    return tensors


def load_hf_layer(path: str | os.PathLike, cfg: DsaConfig, layer: int, tp_rank: int = 0, *,
                  fp8_block: tuple[int, int] | None = None) -> DsaWeights:
    """Layer `layer`'s DSA block from a safetensors file or a (sharded) checkpoint folder."""
    return fold_weights(cfg, read_hf_tensors(path, cfg, layer, fp8_block=fp8_block), tp_rank,
                        fp8_block=fp8_block)


# The GEMM weights an fp8 release stores as fp8 with block scales (not `weights_proj`).
FP8_RELEASE_TENSORS = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                       "kv_b_proj.weight", "o_proj.weight", "indexer.wq_b.weight",
                       "indexer.wk.weight", "indexer.index_kpool_compress_gate")


def quantize_hf_tensors(hf: Mapping[str, np.ndarray], block: tuple[int, int]
                        ) -> dict[str, np.ndarray]:
    """HF tensors -> the fine-grained fp8 checkpoint of them: each `FP8_RELEASE_TENSORS`
    weight as float8_e4m3fn values beside its fp32 `*_scale_inv` per `block` (amax / 448 a
    block, `fp8.quantize_blocks`), the rest as they are."""
    out = {}
    for name, value in hf.items():
        if name in FP8_RELEASE_TENSORS:
            q = fp8.quantize_blocks(np.asarray(value, np.float32), block)
            out[name], out[name + SCALE_SUFFIX] = np.asarray(q.values), np.asarray(q.scale)
        else:
            out[name] = value
    return out


def init_random_hf_tensors(cfg: DsaConfig, key: jax.Array, has_indexer: bool = True
                           ) -> dict[str, np.ndarray]:
    """Random fp32 HF tensors of one layer: never zeros, norms away from 1, a real gate.
    Under `param_dtype="float8_e4m3fn"`, their fp8 checkpoint (`quantize_hf_tensors`,
    `cfg.weight_block`): what `init_random_weights` folds, which the reference dequantizes."""
    shapes = hf_shapes(cfg, has_indexer)
    keys = jax.random.split(key, len(shapes))
    hf = {name: np.asarray(random_hf_value(name, jax.random.normal(k, shape)), np.float32)
          for k, (name, shape) in zip(keys, shapes.items(), strict=True)}
    return quantize_hf_tensors(hf, cfg.weight_block) if cfg.param_dtype == fp8.FP8 else hf


def random_hf_value(name: str, z):
    """The random-tensor recipe: HF tensor `name` from a standard normal draw `z` of its shape
    (any array type): norms 1 + 0.2 z, the LayerNorm bias 0.2 z, ape 0.5 z, `[out, in]` linear
    weights z / sqrt(in). Every random HF tensor (tests, the HF oracle, benchmarks) uses it."""
    if name.endswith("layernorm.weight") or name == "indexer.k_norm.weight":
        return 1.0 + 0.2 * z
    if name == "indexer.k_norm.bias":
        return 0.2 * z
    if name == "indexer.index_kpool_compress_ape":
        return 0.5 * z
    return z * z.shape[-1] ** -0.5


def init_random_weights(cfg: DsaConfig, key: jax.Array, has_indexer: bool = True,
                        tp_rank: int = 0) -> DsaWeights:
    """Random folded weights for demos and tests."""
    return fold_weights(cfg, init_random_hf_tensors(cfg, key, has_indexer), tp_rank)
