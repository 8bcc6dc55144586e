"""Named configurations that tests and benchmarks share: the one place shapes are listed."""

from __future__ import annotations

import os

from dsa_jax.config import DsaConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "configs")

# Odd sizes on purpose: nothing here is a power of two except where a divisibility rule
# forces it, so padding and masking paths run.
ODD = DsaConfig(
    hidden_size=80, num_heads=3, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12,
    v_head_dim=20, index_n_heads=3, index_head_dim=12, index_topk=12, index_kpool=4,
    max_context=96, block_size=8, max_verify=4, cache_dtype="float32",
    index_cache_dtype="float32", param_dtype="float32", implementation="xla",
)


def tiny(**overrides) -> DsaConfig:
    """configs/tiny.json, the CPU demo block."""
    return DsaConfig.from_json(os.path.join(CONFIG_DIR, "tiny.json"), **overrides)


def glm53_flash(**overrides) -> DsaConfig:
    """configs/glm5.3-flash.json, the released model's attention block."""
    return DsaConfig.from_json(os.path.join(CONFIG_DIR, "glm5.3-flash.json"), **overrides)
