"""Every exception type `dsa_jax` raises, under one base class: `except dsa_jax.DsaError`
catches them all. Each is also a subclass of the built-in type it has always been
(`ValueError` for bad input, `RuntimeError` for what cannot run here or now, `ImportError`
for a missing optional package), and each module that raises one still exports it by name
(`dsa_jax.layer.StepError`, `dsa_jax.engine.EngineError`, ...). docs/errors.md lists every
message."""

from __future__ import annotations


class DsaError(Exception):
    """The base of every error `dsa_jax` raises for an input, a setting or a limit."""


class ConfigError(DsaError, ValueError):
    """A configuration field is outside what the block supports."""


class WeightError(DsaError, ValueError):
    """A checkpoint tensor is missing or has the wrong shape or dtype."""


class StateError(DsaError, ValueError):
    """A state cannot be built as asked (sizes, scale, block tables); raised before any array
    is made."""


class StepError(DsaError, ValueError):
    """A step's inputs do not fit the state; raised before anything is written."""


class ShardingError(DsaError, ValueError):
    """A mesh, a config and the arrays placed on it do not fit together."""


class ImplementationError(DsaError, RuntimeError):
    """The requested implementation cannot run here."""


class KernelLimitError(DsaError, ValueError):
    """An array a kernel cannot address correctly; raised while tracing, before anything
    runs."""


class MissingDependencyError(DsaError, ImportError):
    """The raw Triton top-k was asked for and jax-triton or triton is not installed."""


class CheckpointError(DsaError, ValueError):
    """A checkpoint cannot be written or restored as asked (the message says why)."""


class ModelError(DsaError, ValueError):
    """Model weights or states that do not fit the model config."""


class SamplingError(DsaError, ValueError):
    """A sampling setting or stop token the loop cannot use."""


class ServeError(DsaError, ValueError):
    """A batch the loop cannot serve (refused before anything runs)."""


class EngineError(DsaError, ValueError):
    """A request the engine cannot serve (too long, bad speculation width, ...)."""


class OutOfBlocks(DsaError, RuntimeError):
    """The block pool cannot cover a request right now."""


class CliError(DsaError):
    """A bad command-line argument; the message names the argument and the reason."""


__all__ = ["CheckpointError", "CliError", "ConfigError", "DsaError", "EngineError",
           "ImplementationError", "KernelLimitError", "MissingDependencyError", "ModelError",
           "OutOfBlocks", "SamplingError", "ServeError", "ShardingError", "StateError",
           "StepError", "WeightError"]
