"""Hugging Face oracle for the parity tests: a small random fp32 `Glm5NextTextAttention` stack.

Everything here talks to `transformers` (model type `glm5_next`, DSA layer type
"indexed_attention") and to safetensors. Of `dsa_jax` it takes only the random-tensor recipe
(`weights.random_hf_value`: how a standard normal draw becomes each tensor), so the oracle
cannot inherit a bug from the code it checks: names and shapes are HF's own modules', the
computation is HF's.

- `make_config` builds a small fp32 `Glm5NextTextConfig` whose layers are all attention (DSA)
  layers, with the given per-layer `indexer_types`; `config_for` builds it at a `DsaConfig`'s
  shapes (the one place a transformers config is made from ours).
- `make_attention_layers` builds one `Glm5NextTextAttention` per layer and overwrites EVERY
  parameter with random non-zero values (HF's own init leaves `ape` zero, the gate one and the
  norms one, which would hide whole terms of the block).
- `save_checkpoint` writes them as safetensors under `model.layers.{l}.self_attn.<name>`
  (one file, or a sharded folder with `model.safetensors.index.json`) plus `config.json`.
- `run_hf` runs the layers as Glm5NextTextModel would (same cache, same boolean indexer mask,
  `prev_topk_indices` threaded from a full layer to the shared layer after it): one prefill of
  the prompt, then one token at a time, every layer fed the same input `x`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import NamedTuple

import chex
import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import DynamicCache
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

from dsa_jax.weights import random_hf_value


def _dsa_layer_type() -> str:
    """HF's name for a DSA layer: "indexed_attention" in transformers 5.23,
    "deepseek_sparse_attention" in 5.17 (the GPU image). Asked of the installed config class."""
    for name in ("indexed_attention", "deepseek_sparse_attention"):
        try:
            Glm5NextTextConfig(num_hidden_layers=1, layer_types=[name], indexer_types=["full"],
                               mlp_layer_types=["dense"])
        except Exception:  # the config's validator names the types it accepts
            continue
        return name
    raise RuntimeError("this transformers' Glm5NextTextConfig accepts no DSA layer type")


LAYER_TYPE = _dsa_layer_type()
PREFIX = "model.layers.{layer}.self_attn."

# Every parameter name a full layer must have (HF names inside `self_attn`).
FULL_LAYER_PARAMS = frozenset({
    "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
    "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "indexer.wq_b.weight",
    "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
    "indexer.weights_proj.weight", "indexer.index_kpool_compress_gate",
    "indexer.index_kpool_compress_ape",
})
SHARED_LAYER_PARAMS = frozenset(n for n in FULL_LAYER_PARAMS if not n.startswith("indexer."))


def make_config(*, hidden_size: int = 80, num_heads: int = 3, q_lora_rank: int = 36,
                kv_lora_rank: int = 24, qk_nope_head_dim: int = 20, v_head_dim: int = 12,
                index_n_heads: int = 5, index_head_dim: int = 12, index_topk: int = 16,
                index_kpool: int = 4, always_select_tail: bool = True,
                indexer_types: Sequence[str] = ("full",), rms_norm_eps: float = 1e-5
                ) -> Glm5NextTextConfig:
    """A small fp32 text config whose every layer is an "indexed_attention" (DSA) layer."""
    n = len(indexer_types)
    config = Glm5NextTextConfig(
        vocab_size=64,
        hidden_size=hidden_size,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=n,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=0,
        v_head_dim=v_head_dim,
        index_n_heads=index_n_heads,
        index_head_dim=index_head_dim,
        index_topk=index_topk,
        index_kpool=index_kpool,
        index_kpool_always_select_tail=always_select_tail,
        layer_types=[LAYER_TYPE] * n,
        indexer_types=list(indexer_types),
        mlp_layer_types=["dense"] * n,
        rms_norm_eps=rms_norm_eps,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"
    assert config.layer_types == [LAYER_TYPE] * n, config.layer_types
    assert config.indexer_types == list(indexer_types), config.indexer_types
    return config


def config_for(cfg, indexer_types: Sequence[str] | None = None) -> Glm5NextTextConfig:
    """`make_config` at the model shapes of `cfg` (a `DsaConfig`: all heads, before tensor
    parallelism); `indexer_types` default to the config's."""
    return make_config(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        index_kpool=cfg.index_kpool, always_select_tail=cfg.always_select_tail,
        indexer_types=tuple(cfg.indexer_types if indexer_types is None else indexer_types),
        rms_norm_eps=cfg.rms_norm_eps)


def _randomize(attn: Glm5NextTextAttention, gen: torch.Generator) -> None:
    """Overwrite every parameter of `attn` with random non-zero fp32 values (the project's
    recipe, `random_hf_value`, over draws of this oracle's own torch generator)."""
    with torch.no_grad():
        for name, p in attn.named_parameters():
            z = torch.randn(tuple(p.shape), generator=gen, dtype=torch.float32)
            value = random_hf_value(name, z)
            # Never an exact zero anywhere (so no term can hide behind a zero weight).
            value = torch.where(value == 0, torch.full_like(value, 1e-3), value)
            p.copy_(value)


def make_attention_layers(config: Glm5NextTextConfig, seed: int) -> list[Glm5NextTextAttention]:
    """One random fp32 `Glm5NextTextAttention` per layer of `config`, all parameters drawn."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for layer in range(config.num_hidden_layers):
        attn = Glm5NextTextAttention(config, layer).to(torch.float32).eval()
        names = {n for n, _ in attn.named_parameters()}
        expected = SHARED_LAYER_PARAMS if config.indexer_types[layer] == "shared" \
            else FULL_LAYER_PARAMS
        assert names == expected, f"layer {layer}: HF parameters {sorted(names ^ expected)} differ"
        _randomize(attn, gen)
        for n, p in attn.named_parameters():
            assert p.dtype == torch.float32 and bool((p != 0).all()), n
        layers.append(attn)
    return layers


def layer_tensors(attn: Glm5NextTextAttention) -> dict[str, np.ndarray]:
    """HF names inside `self_attn` -> fp32 numpy arrays."""
    return {n: p.detach().cpu().numpy().copy() for n, p in attn.named_parameters()}


def checkpoint_tensors(layers: Sequence[Glm5NextTextAttention]) -> dict[str, np.ndarray]:
    """Full checkpoint names (`model.layers.{l}.self_attn.<name>`) -> arrays."""
    out = {}
    for layer, attn in enumerate(layers):
        for name, value in layer_tensors(attn).items():
            out[PREFIX.format(layer=layer) + name] = value
    return out


def write_config(config: Glm5NextTextConfig, folder: str) -> str:
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        json.dump(config.to_dict(), f, indent=1)
    return path


def save_checkpoint(config: Glm5NextTextConfig, layers: Sequence[Glm5NextTextAttention],
                    folder: str, *, shards: int = 1,
                    tensors: dict[str, np.ndarray] | None = None) -> str:
    """Write `config.json` and the layers' tensors under `folder`; returns the weights path.

    `shards == 1`: one `model.safetensors` (its path is returned). `shards > 1`: that many
    `model-0000i-of-0000n.safetensors` files and `model.safetensors.index.json` (the folder is
    returned). `tensors` overrides what is written (for corrupt-checkpoint tests).
    """
    os.makedirs(folder, exist_ok=True)
    write_config(config, folder)
    tensors = checkpoint_tensors(layers) if tensors is None else tensors
    if shards == 1:
        path = os.path.join(folder, "model.safetensors")
        save_file(tensors, path)
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        assert part, "more shards than tensors"
        save_file(part, os.path.join(folder, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(sum(v.nbytes for v in tensors.values()))},
                   "weight_map": weight_map}, f, indent=1)
    return folder


class HfRun(NamedTuple):
    y: list[np.ndarray]  # per layer: [B, N, D] fp32 outputs of every row
    sel: list[np.ndarray | None]  # per layer: [B, N, W] int32 indexer output (None: shared)


@torch.no_grad()
def run_hf(config: Glm5NextTextConfig, layers: Sequence[Glm5NextTextAttention],
           x: np.ndarray, prompt_len: int) -> HfRun:
    """Prefill `x[:, :prompt_len]`, then decode `x[:, t]` one token at a time, through HF.

    Every layer receives the same input `x` (the attention block alone, no decoder around it);
    a full layer's returned top-k (set when the next layer is shared, `next_skip_topk`) is
    passed to the next layer as `prev_topk_indices`, as `Glm5NextTextModel` does. The indexers'
    selections are captured with forward hooks.
    """
    chex.assert_shape(x, (None, None, config.hidden_size))
    if not 1 <= prompt_len <= x.shape[1]:
        raise ValueError(f"prompt_len {prompt_len} must be in [1, {x.shape[1]}] (rows of x)")
    x_t = torch.from_numpy(np.array(x, np.float32))  # a writable copy
    b, n, _ = x_t.shape
    cache = DynamicCache(config=config)
    captured: dict[int, list[torch.Tensor]] = {i: [] for i, a in enumerate(layers)
                                               if a.indexer is not None}
    hooks = [a.indexer.register_forward_hook(
        lambda mod, args, out, i=i: captured[i].append(out.clone()))
        for i, a in enumerate(layers) if a.indexer is not None]
    ys: list[list[torch.Tensor]] = [[] for _ in layers]
    try:
        steps = [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, n)]
        for start, stop in steps:
            chunk = x_t[:, start:stop]
            mask = torch.ones(b, stop - start, dtype=torch.bool)
            prev = None
            for i, attn in enumerate(layers):
                out, _, topk = attn(chunk, attention_mask=mask, past_key_values=cache,
                                    prev_topk_indices=prev)
                ys[i].append(out)
                prev = topk
            assert cache.get_seq_length() == stop
    finally:
        for h in hooks:
            h.remove()
    y = [torch.cat(parts, dim=1).numpy() for parts in ys]
    sel = [torch.cat(captured[i], dim=1).numpy() if i in captured else None
           for i in range(len(layers))]
    return HfRun(y=y, sel=sel)


def selection_sets(sel: np.ndarray) -> list[list[frozenset[int]]]:
    """`[B, N, W]` -1-padded indices -> per sequence, per row, the set of selected tokens."""
    sel = np.asarray(sel)
    return [[frozenset(int(v) for v in row if v >= 0) for row in seq] for seq in sel]


def boundary_gaps(scores: np.ndarray, select_k: int) -> np.ndarray:
    """Per row of `scores [S, P]` (-inf = not a candidate): the relative gap between the last
    selected and the first unselected candidate, (s[k-1] - s[k]) / max|s|; +inf where every
    candidate is selected (no boundary). HF leaves ties unordered, so sets are comparable only
    on draws whose gaps are clearly positive."""
    gaps = np.full(scores.shape[0], np.inf)
    for t, row in enumerate(np.asarray(scores, np.float64)):
        cand = np.sort(row[np.isfinite(row)])[::-1]
        if len(cand) <= select_k:
            continue
        scale = np.max(np.abs(cand))
        gaps[t] = (cand[select_k - 1] - cand[select_k]) / scale if scale > 0 else 0.0
    return gaps
