"""dsa_jax: DeepSeek-style sparse attention (the GLM-5.3 DSA block) in JAX and Pallas."""

from dsa_jax import reference
from dsa_jax.bitwise import BITWISE_OPTIONS, bitwise_jit
from dsa_jax.config import ConfigError, DsaConfig
from dsa_jax.implementation import ImplementationError
from dsa_jax.layer import StepError, decode, decode_k, prefill, rewind, write_kv_row
from dsa_jax.serving_step import ServingStep, check_step, serving_step
from dsa_jax.state import DsaState, init_state
from dsa_jax.weights import (
    DsaWeights,
    WeightError,
    fold_weights,
    init_random_hf_tensors,
    init_random_weights,
    load_hf_layer,
    read_hf_tensors,
)

__all__ = [
    "BITWISE_OPTIONS", "ConfigError", "DsaConfig", "DsaState", "DsaWeights",
    "ImplementationError", "ServingStep", "StepError", "WeightError", "bitwise_jit",
    "check_step", "decode", "decode_k", "fold_weights", "init_random_hf_tensors",
    "init_random_weights", "init_state", "load_hf_layer", "prefill", "read_hf_tensors",
    "reference", "rewind", "serving_step", "write_kv_row",
]
