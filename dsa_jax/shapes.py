"""Named configurations that tests and benchmarks share: the one place shapes are listed.

The JSON configs ship inside the package (`dsa_jax/configs/*.json`) and are read through
`importlib.resources`, so an installed wheel finds them wherever it runs.
"""

from __future__ import annotations

import os
from importlib import resources

from dsa_jax.config import DsaConfig

# The shipped configs' folder: a plain directory in a checkout and in an installed wheel.
CONFIG_DIR = os.fspath(resources.files("dsa_jax") / "configs")

# Odd sizes on purpose: nothing here is a power of two except where a divisibility rule
# forces it, so padding and masking paths run.
ODD = DsaConfig(
    hidden_size=80, num_heads=3, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12,
    v_head_dim=20, index_n_heads=3, index_head_dim=12, index_topk=12, index_kpool=4,
    max_context=96, block_size=8, max_verify=4, cache_dtype="float32",
    index_cache_dtype="float32", param_dtype="float32", implementation="xla",
)


def shipped_configs() -> list[str]:
    """Names of the shipped configs ("glm5.3-flash", "tiny"), sorted."""
    folder = resources.files("dsa_jax") / "configs"
    return sorted(f.name[:-len(".json")] for f in folder.iterdir() if f.name.endswith(".json"))


def load_config(name_or_path: str | os.PathLike, **overrides) -> DsaConfig:
    """A shipped config by name (`shipped_configs()`: no ".json", no folder), or any JSON file
    of DsaConfig fields by path. `overrides` replace fields."""
    name = os.fspath(name_or_path)
    if name in shipped_configs():
        with resources.as_file(resources.files("dsa_jax") / "configs" / f"{name}.json") as path:
            return DsaConfig.from_json(path, **overrides)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"config {name!r}: no such file, and not a shipped config "
                                f"(those are {shipped_configs()})")
    return DsaConfig.from_json(name, **overrides)


def tiny(**overrides) -> DsaConfig:
    """dsa_jax/configs/tiny.json, the CPU demo block."""
    return load_config("tiny", **overrides)


def glm53_flash(**overrides) -> DsaConfig:
    """dsa_jax/configs/glm5.3-flash.json, the released model's attention block."""
    return load_config("glm5.3-flash", **overrides)
