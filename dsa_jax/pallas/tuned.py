"""The kernels' defaults per device class and shape class, in one table.

Three ops have two kernels each; `DEFAULTS` says which one the "auto" backend runs:
- the gather-attend (`sparse_attend`): "mosaic" (Pallas Mosaic GPU, FlashMLA's split) or
  "triton" (Pallas Triton, every cache dtype);
- the pool scores (`pool_scores`): "mosaic" (bulk key copies and wgmmas) or "triton";
- the pool top-k (`pool_topk`): "pallas" (Pallas Triton; it can also write the token slots and
  share a launch) or "triton" (the raw Triton kernel through jax-triton, the faster over a
  prompt's thousands of rows).

Device classes: "hopper" (sm_90, the H100 and H200 the kernels are tuned on; Mosaic GPU
kernels compile for it only), "gpu" (another NVIDIA GPU) and "interpret" (Pallas interpret
mode, any backend). Shape classes: "rows" and "many_rows" (a call of at least `MANY_ROWS`
rows, e.g. a prompt chunk's). A kernel runs only where it supports the shapes (the Mosaic
attend: an fp8 cache, C a multiple of 128 up to 512 and at least half of each 64-head tile
real heads; the Mosaic scores: its Hi, Di and key dtype); elsewhere the op's other kernel
runs. Every pair gives the same results within the op's documented bound (the top-k's: the
same indices), and the choice never depends on the batch.

The tile shapes are functions of the shape, kept beside their kernels: `matmul.default_tuning`
(the row-invariant GEMM), `pool_scores_mgpu.fit` and `pool_scores.chunk_split` (the pool
scores), `mgpu_plan.num_splits` (the attend's split count, at most `MgpuTuning.max_splits`),
`scaled_q_abs.tiles`, `latent_write.warps_for` and `index_write.warps_for`.
"""

from __future__ import annotations

import dataclasses

from dsa_jax.pallas.common import gpu_is_not_hopper

MANY_ROWS = 2048  # rows from which a call is of the "many_rows" class


@dataclasses.dataclass(frozen=True)
class Backends:
    """The kernel each op with two runs by default."""
    attend: str  # "mosaic" | "triton"
    scores: str  # "mosaic" | "triton"
    topk: str  # "pallas" | "triton"


DEFAULTS: dict[tuple[str, str], Backends] = {
    ("hopper", "rows"): Backends(attend="mosaic", scores="mosaic", topk="pallas"),
    ("hopper", "many_rows"): Backends(attend="mosaic", scores="mosaic", topk="triton"),
    ("gpu", "rows"): Backends(attend="triton", scores="triton", topk="pallas"),
    ("gpu", "many_rows"): Backends(attend="triton", scores="triton", topk="triton"),
    ("interpret", "rows"): Backends(attend="triton", scores="triton", topk="pallas"),
    ("interpret", "many_rows"): Backends(attend="triton", scores="triton", topk="pallas"),
}


def device_class(interpret: bool) -> str:
    """"interpret", "hopper" or "gpu" for a kernel compiled (or interpreted) in this process."""
    if interpret:
        return "interpret"
    return "gpu" if gpu_is_not_hopper() else "hopper"


def shape_class(rows: int) -> str:
    """"many_rows" from `MANY_ROWS` rows, "rows" below."""
    return "many_rows" if rows >= MANY_ROWS else "rows"


def backends(interpret: bool, rows: int = 1) -> Backends:
    """The table's row for this process's device and a call of `rows` rows."""
    return DEFAULTS[device_class(interpret), shape_class(rows)]
