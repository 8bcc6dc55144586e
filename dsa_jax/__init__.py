"""dsa_jax: DeepSeek-style sparse attention (the GLM-5.3 DSA block) in JAX and Pallas."""

from dsa_jax import reference
from dsa_jax.bitwise import BITWISE_OPTIONS, bitwise_jit
from dsa_jax.config import DsaConfig
from dsa_jax.errors import (
    CheckpointError,
    CliError,
    ConfigError,
    DsaError,
    EngineError,
    ImplementationError,
    KernelLimitError,
    MissingDependencyError,
    ModelError,
    OutOfBlocks,
    SamplingError,
    ServeError,
    ShardingError,
    StateError,
    StepError,
    WeightError,
)
from dsa_jax.layer import decode, decode_k, prefill, rewind, write_kv_row
from dsa_jax.serving_step import ServingStep, check_step, serving_step
from dsa_jax.shapes import load_config
from dsa_jax.state import DsaState, init_state
from dsa_jax.weights import (
    DsaWeights,
    fold_weights,
    init_random_hf_tensors,
    init_random_weights,
    load_hf_layer,
    read_hf_tensors,
)

__all__ = [
    "BITWISE_OPTIONS", "CheckpointError", "CliError", "ConfigError", "DsaConfig", "DsaError",
    "DsaState", "DsaWeights", "EngineError", "ImplementationError", "KernelLimitError",
    "MissingDependencyError", "ModelError", "OutOfBlocks", "SamplingError", "ServeError",
    "ServingStep", "ShardingError", "StateError", "StepError", "WeightError", "bitwise_jit",
    "check_step", "decode", "decode_k", "fold_weights", "init_random_hf_tensors",
    "init_random_weights", "init_state", "load_config", "load_hf_layer", "prefill",
    "read_hf_tensors", "reference", "rewind", "serving_step", "write_kv_row",
]
