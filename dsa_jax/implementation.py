"""Which backend runs the hot paths: chosen explicitly, never by the environment.

`cfg.implementation` is "xla" (the plain-jnp ops), "pallas" (the kernels in `dsa_jax/pallas`,
compiled for the GPU), "pallas-interpret" (the same kernels in Pallas interpret mode, on any
backend: slow, for tests and debugging), or "auto": pallas on a GPU backend, xla elsewhere.
Asking for "pallas" where it cannot run raises; nothing falls back quietly.
"""

from __future__ import annotations

import jax

from dsa_jax.pallas import pool_scores as pool_scores_op
from dsa_jax.pallas import sparse_attend as sparse_attend_op


class ImplementationError(RuntimeError):
    """The requested implementation cannot run here."""


def pallas_kernels_present() -> bool:
    return (hasattr(sparse_attend_op, "sparse_attend_pallas")
            and hasattr(pool_scores_op, "pool_scores_pallas"))


def resolve(implementation: str) -> str:
    """The configured name -> the one that runs: "xla", "pallas" or "pallas-interpret"."""
    on_gpu = jax.default_backend() == "gpu"
    if implementation == "auto":
        return "pallas" if on_gpu and pallas_kernels_present() else "xla"
    if implementation.startswith("pallas") and not pallas_kernels_present():
        raise ImplementationError(
            f"implementation={implementation!r}: the Pallas kernels are not built into this "
            f"version of dsa_jax. Use implementation='xla'.")
    if implementation == "pallas" and not on_gpu:
        raise ImplementationError(
            f"implementation='pallas' compiles the kernels for a GPU; this process has backend "
            f"{jax.default_backend()!r}. Use implementation='xla' (or 'pallas-interpret' to run "
            f"the kernels slowly in interpret mode).")
    return implementation
