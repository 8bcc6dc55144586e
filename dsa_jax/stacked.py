"""One layer's weight inside the stacked weights of the model's scan (`dsa_jax.model`).

A Pallas kernel's operand is a whole buffer: a layer's slice of a stacked weight would be a
copy of it per layer and token. So the scan hands the ops a `LayerOf` (the stack, the layer's
index and the scan's own slice), the kernels read the stack in place at the index, and XLA
reads the slice (which its GEMMs and fusions read in place), whichever the op runs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from dsa_jax.config import DsaConfig
from dsa_jax.implementation import resolve

__all__ = ["LayerOf", "operand"]


class LayerOf(NamedTuple):
    """One layer's weight inside a stack of them, as the model's scan holds it: a Pallas
    kernel (the row-invariant GEMM, the RMSNorm, the cache writes) reads `stack [G, ...]` in
    place at `index` (a Pallas operand is a whole buffer, so the slice would be a copy of the
    layer's weight per token), XLA reads `layer` (the scan's slice: XLA's GEMMs read it in
    place). Whichever one an op does not use is dead code in the compiled program. `shape`
    and `dtype` are the layer's."""
    stack: jax.Array  # [G, ...] every layer's weight
    index: jax.Array  # [] int32: this layer's, in [0, G)
    layer: jax.Array  # [...] = stack[index]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layer.shape

    @property
    def dtype(self):
        return self.layer.dtype


def operand(cfg: DsaConfig, w) -> tuple[jax.Array, jax.Array | None]:
    """`(array, index)` for an op taking the weight `w` (an array or a `LayerOf`): the stack
    and the layer's index where the kernels run, the scan's slice (index None) under "xla"
    (the programs XLA compiled before: its ops read the slice in place), `w` itself otherwise."""
    if not isinstance(w, LayerOf):
        return w, None
    if resolve(cfg.implementation) == "xla":
        return w.layer, None
    return w.stack, w.index
