"""Which backend runs the hot paths: chosen explicitly, never by the environment.

`cfg.implementation` is "xla" (the plain-jnp ops), "pallas" (the kernels in `dsa_jax/pallas`),
or "auto": pallas on a GPU backend when the kernels exist, xla elsewhere. Asking for "pallas"
where it cannot run raises; nothing falls back quietly.
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
    """"auto" / "xla" / "pallas" -> the backend that will run ("xla" or "pallas")."""
    on_gpu = jax.default_backend() == "gpu"
    if implementation == "auto":
        return "pallas" if on_gpu and pallas_kernels_present() else "xla"
    if implementation == "pallas" and not (on_gpu and pallas_kernels_present()):
        raise ImplementationError(
            f"implementation='pallas' needs a GPU backend and the Pallas kernels; this process "
            f"has backend {jax.default_backend()!r}. Use implementation='xla'.")
    return implementation
