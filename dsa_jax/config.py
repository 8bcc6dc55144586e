"""`DsaConfig`: the frozen, validated description of one DSA block and its serving geometry.

The model fields mirror the Hugging Face `glm5_next` text config (SPEC.md "Names"); the serving
fields fix every array shape at a ceiling (`max_context`, `max_verify`), so one compiled program
serves every context length. Being a frozen dataclass it is hashable and can be a static
argument of `jax.jit`. Imports nothing of ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from dsa_jax.errors import ConfigError

CACHE_DTYPES = ("float8_e4m3fn", "bfloat16", "float32")
INDEX_CACHE_DTYPES = ("bfloat16", "float32")
PARAM_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas-interpret")
GEMMS = ("auto", "xla", "pallas")
INDEXER_TYPES = ("full", "shared")
# HF `layer_types` entries of a DSA layer (the name changed between transformers releases).
DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention", "full_attention")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _is_int(value) -> bool:
    """A JSON integer: an int, not a bool (true / false are ints to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A JSON number: an int or float, not a bool or a string."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from a file, or ConfigError naming the file and what is wrong."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"{os.fspath(path)}: cannot read the config "
                          f"({e.strerror or e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{os.fspath(path)}: not valid JSON ({e})") from e
    _require(isinstance(data, dict), f"{os.fspath(path)}: expected a JSON object of config "
                                     f"fields, got {type(data).__name__}")
    return data


@dataclasses.dataclass(frozen=True)
class DsaConfig:
    """One DSA block (SPEC.md symbols in brackets) plus the shapes its state is built at."""

    hidden_size: int  # D
    num_heads: int  # H, all heads of the model (before tensor parallelism)
    q_lora_rank: int  # R_q
    kv_lora_rank: int  # C, latent width
    qk_nope_head_dim: int  # Dn
    v_head_dim: int  # Dv
    index_n_heads: int  # Hi
    index_head_dim: int  # Di
    index_topk: int  # T, token budget of one selection
    index_kpool: int  # KP, tokens per pool
    always_select_tail: bool = True
    rms_norm_eps: float = 1e-5
    qk_rope_head_dim: int = 0  # must be 0: this block has no RoPE
    indexer_types: tuple[str, ...] = ("full",)  # per model layer: "full" or "shared"
    # Serving geometry: every state array is sized by these.
    max_context: int = 4096  # tokens per sequence, the compile ceiling
    block_size: int = 64  # tokens per block of the paged latent cache
    max_verify: int = 4  # rows per sequence in one decode / verify step
    cache_dtype: str = "float8_e4m3fn"  # latent cache storage
    index_cache_dtype: str = "bfloat16"  # indexer k and gate storage
    # Projection weights. "float8_e4m3fn": kept as an fp8 checkpoint stores them, values and
    # one fp32 scale per `weight_block` (`dsa_jax.fp8`), their GEMMs computing in bf16 on the
    # values * scale the load-time dequantization would give (the same bits).
    param_dtype: str = "bfloat16"
    weight_block: tuple[int, int] = (128, 128)  # fp8 weights' scale block [rows, cols]
    tp_degree: int = 1  # tensor-parallel degree: heads per rank = H / tp_degree
    # "xla", "pallas", "pallas-interpret" (the kernels in Pallas interpret mode, any backend:
    # tests and debugging), or "auto" (pallas on a GPU, xla elsewhere).
    implementation: str = "auto"
    # The decode and verify rows' GEMMs: "xla" (XLA's, whose bits for a row depend on how many
    # rows share the GEMM, so a decode runs every sequence's max_verify rows to match a
    # verify), "pallas" (`pallas/matmul.py`, a row's bits the same at any row count, so a
    # decode runs its one row) wherever the kernels run (`implementation`; bf16 weights), or
    # "auto": "pallas" for bf16 weights, "xla" for fp32 ones (`implementation.row_gemms`).
    # Anything but "xla" also runs a prompt's U_v product on that kernel, writing bf16, where
    # U_v and o_proj are bf16 (`projection.prompt_u_v_kernel`); "xla" keeps XLA's GEMM there.
    gemm: str = "auto"
    # A decode's or verify's pool top-k and q_b GEMM in one launch where both run as kernels
    # (`pallas/topk_matmul.py`, `step.shares_q_launch`): the same results as one after the
    # other (False), in less device time.
    colaunch: bool = True
    # Batch invariance: a sequence's outputs and selections are the same bits whichever other
    # sequences share its step. True runs XLA's GEMMs one sequence at a time
    # (`projection.per_sequence`) and plans every row's attend split as in a step of
    # `step.INVARIANT_PLAN_ROWS` rows instead of from the step's row count (which fills the
    # GPU for few rows, so a lone decode runs faster with False). The XLA row sums are fixed
    # trees whatever the flag (`numerics.tree_sum`).
    # `Engine` and `serve` default to True; `decode` / `decode_k` / `prefill` follow the
    # config (docs/decisions.md, "Batch invariance").
    batch_invariant: bool = False

    def __post_init__(self):
        if isinstance(self.indexer_types, list):
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        if isinstance(self.weight_block, list):  # a JSON config's
            object.__setattr__(self, "weight_block", tuple(self.weight_block))
        for name in (
            "hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "index_kpool",
            "max_context", "block_size", "max_verify", "tp_degree",
        ):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0,
                     f"{name} must be a positive integer, got {value!r}")
        _require(isinstance(self.always_select_tail, bool),
                 f"always_select_tail must be a bool (true or false), got "
                 f"{self.always_select_tail!r}")
        _require(_is_real(self.rms_norm_eps) and math.isfinite(self.rms_norm_eps)
                 and self.rms_norm_eps > 0,
                 f"rms_norm_eps must be a finite real number > 0, got {self.rms_norm_eps!r}")
        _require(_is_int(self.qk_rope_head_dim),
                 f"qk_rope_head_dim must be an integer (0), got {self.qk_rope_head_dim!r}")
        _require(isinstance(self.indexer_types, tuple)
                 and all(isinstance(k, str) for k in self.indexer_types),
                 f"indexer_types must be a list of 'full' / 'shared' (one per layer), got "
                 f"{self.indexer_types!r}")
        _require(self.qk_rope_head_dim == 0,
                 f"qk_rope_head_dim must be 0 (this block has no RoPE), "
                 f"got {self.qk_rope_head_dim}")
        _require(self.index_topk % self.index_kpool == 0,
                 f"index_topk ({self.index_topk}) must be a multiple of index_kpool "
                 f"({self.index_kpool}); remainder {self.index_topk % self.index_kpool}")
        _require(self.num_heads % self.tp_degree == 0,
                 f"num_heads ({self.num_heads}) must be divisible by tp_degree "
                 f"({self.tp_degree})")
        _require(self.max_context % self.block_size == 0,
                 f"max_context ({self.max_context}) must be a multiple of block_size "
                 f"({self.block_size})")
        _require(self.max_context % self.index_kpool == 0,
                 f"max_context ({self.max_context}) must be a multiple of index_kpool "
                 f"({self.index_kpool})")
        _require(self.cache_dtype in CACHE_DTYPES,
                 f"cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
        _require(self.index_cache_dtype in INDEX_CACHE_DTYPES,
                 f"index_cache_dtype must be one of {INDEX_CACHE_DTYPES}, "
                 f"got {self.index_cache_dtype!r}")
        _require(self.param_dtype in PARAM_DTYPES,
                 f"param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}")
        _require(isinstance(self.weight_block, tuple) and len(self.weight_block) == 2
                 and all(_is_int(v) and v > 0 for v in self.weight_block),
                 f"weight_block must be two positive integers [rows, cols], got "
                 f"{self.weight_block!r}")
        _require(self.implementation in IMPLEMENTATIONS,
                 f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}")
        _require(self.gemm in GEMMS, f"gemm must be one of {GEMMS}, got {self.gemm!r}")
        _require(isinstance(self.batch_invariant, bool),
                 f"batch_invariant must be a bool (true or false), got {self.batch_invariant!r}")
        _require(isinstance(self.colaunch, bool),
                 f"colaunch must be a bool (true or false), got {self.colaunch!r}")
        _require(self.gemm != "pallas" or self.param_dtype in ("bfloat16", "float8_e4m3fn"),
                 f"gemm='pallas' runs bf16 or fp8 weights (its MMA operands: bf16); param_dtype "
                 f"is {self.param_dtype!r}: use gemm='xla' for it")
        _require(len(self.indexer_types) >= 1, "indexer_types must name at least one layer")
        for i, kind in enumerate(self.indexer_types):
            _require(kind in INDEXER_TYPES,
                     f"indexer_types[{i}] must be one of {INDEXER_TYPES}, got {kind!r}")
        _require(self.indexer_types[0] == "full",
                 "indexer_types[0] must be 'full': a 'shared' layer reuses the selection of "
                 "an earlier full layer")

    # Derived sizes (SPEC.md "Derived").
    @property
    def local_heads(self) -> int:
        """Attention heads on one tensor-parallel rank."""
        return self.num_heads // self.tp_degree

    @property
    def select_k(self) -> int:
        """Pools in one full selection."""
        return self.index_topk // self.index_kpool

    @property
    def num_pools(self) -> int:
        """Pools in a sequence at the ceiling."""
        return self.max_context // self.index_kpool

    @property
    def tail_width(self) -> int:
        return self.index_kpool - 1 if self.always_select_tail else 0

    @property
    def sel_width(self) -> int:
        """W: slots of one selection row (`T + KP - 1` with the tail, `T` without)."""
        return self.index_topk + self.tail_width

    @property
    def blocks_per_seq(self) -> int:
        return self.max_context // self.block_size

    def replace(self, **changes: Any) -> DsaConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], **serving: Any
                       ) -> DsaConfig:
        """Build from a GLM-5.3 `config.json` (text config, or multimodal with `text_config`).

        `serving` takes the serving fields (`max_context`, `block_size`, `cache_dtype`,
        `tp_degree`, ...). Fields of the HF config that this block does not use are ignored.
        """
        if isinstance(path_or_dict, Mapping):
            hf = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            hf = _read_json(path)
        if "text_config" in hf:
            hf = dict(hf["text_config"])
        fields = {
            "hidden_size": "hidden_size",
            "num_heads": "num_attention_heads",
            "q_lora_rank": "q_lora_rank",
            "kv_lora_rank": "kv_lora_rank",
            "qk_nope_head_dim": "qk_nope_head_dim",
            "v_head_dim": "v_head_dim",
            "index_n_heads": "index_n_heads",
            "index_head_dim": "index_head_dim",
            "index_topk": "index_topk",
        }
        missing = [hf_name for hf_name in fields.values() if hf_name not in hf]
        _require(not missing, f"HF config lacks required fields {missing}")
        kwargs: dict[str, Any] = {ours: hf[theirs] for ours, theirs in fields.items()}
        # HF defaults for fields a config.json may omit.
        kwargs["index_kpool"] = hf.get("index_kpool", 16)
        tail = hf.get("index_kpool_always_select_tail", True)
        _require(isinstance(tail, bool), f"index_kpool_always_select_tail must be a bool "
                                         f"(true or false), got {tail!r}")
        kwargs["always_select_tail"] = tail
        kwargs["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-5)
        kwargs["qk_rope_head_dim"] = hf.get("qk_rope_head_dim", 0)
        indexer_types = hf.get("indexer_types")
        if indexer_types is not None:
            # Keep only the attention layers' entries when layer_types says which they are.
            layer_types = hf.get("layer_types")
            _require(isinstance(indexer_types, list), f"indexer_types must be a list, got "
                                                      f"{indexer_types!r}")
            if layer_types is not None and len(layer_types) == len(indexer_types):
                indexer_types = [kind for kind, lt in zip(indexer_types, layer_types, strict=True)
                                 if lt in DSA_LAYER_TYPES]
                _require(bool(indexer_types), f"layer_types {sorted(set(layer_types))} has no DSA "
                                              f"layer (one of {sorted(DSA_LAYER_TYPES)}): this "
                                              f"config has no block for dsa_jax")
            _require(bool(indexer_types), "indexer_types is empty: a DSA model has at least one "
                                          "layer")
            kwargs["indexer_types"] = tuple(indexer_types)
        block = (hf.get("quantization_config") or {}).get("weight_block_size")
        if block is not None:  # an fp8 release's blocks: what param_dtype='float8_e4m3fn' keeps
            kwargs["weight_block"] = tuple(block)
        _check_keys("serving fields", serving)
        kwargs.update(serving)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> DsaConfig:
        """Read one of `configs/*.json`: DsaConfig field names, every key checked."""
        data = _read_json(path)
        data = {k: v for k, v in data.items() if not k.startswith("_")}
        _check_keys(os.fspath(path), data)
        _check_keys("overrides", overrides)
        data.update(overrides)
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name not in data]
        _require(not required, f"{os.fspath(path)}: required config keys {required} are "
                               f"missing")
        return cls(**data)


def _check_keys(where: str, data: Mapping[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(DsaConfig)}
    unknown = sorted(set(data) - known)
    _require(not unknown, f"{where}: unknown config keys {unknown}; known keys are "
                          f"{sorted(known)}")
