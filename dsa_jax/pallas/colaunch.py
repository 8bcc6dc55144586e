"""Independent Pallas Triton kernels in one launch: programs `[0, n_0)` run the first part's
program, `[n_0, n_0 + n_1)` the second's, and so on, each on its own operands.

Why: a decode step of one sequence is a chain of short kernels, and its device time is their
sum. A latency-bound kernel (the top-k of one row: a few programs, mostly waiting on its own
reductions) placed in the launch of a bandwidth-bound one (a weight GEMM: every
multiprocessor streaming) runs on multiprocessors the GEMM barely needs, so the launch takes
about as long as the GEMM alone. The parts must not depend on each other: no program of one
reads what another part writes.

Each part's program is its kernel's own body, given its program ids and its refs (whole
arrays, no BlockSpecs): the same code as the part's standalone kernel, so the same results
(bit for bit: the same operations in the same order; tested on the GPU with `==`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

__all__ = ["Part", "colaunch", "unravel"]


@dataclasses.dataclass(frozen=True)
class Part:
    """One kernel of a co-launch.

    body: `body(ids, *refs)`, refs = the part's inputs then its outputs (whole arrays), ids
      the program's index in `grid` (a tuple of scalars, as `pl.program_id` of each axis).
    grid: the part's programs (its standalone kernel's grid).
    inputs: its operands; out_shape: its results.
    aliases: `{input index: output index}` within the part: that output is written in the
      input's buffer (`pallas_call`'s `input_output_aliases`; the part reads the input
      before it writes the output)."""
    body: Callable[..., None]
    grid: tuple[int, ...]
    inputs: tuple[jax.Array, ...]
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    aliases: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


def unravel(pid: jax.Array, grid: Sequence[int]) -> tuple[jax.Array, ...]:
    """A linear program index `[]` int32 -> its ids in `grid`, the last axis fastest."""
    ids = []
    for n in reversed(grid[1:]):
        ids.append(pid % n)
        pid = pid // n
    return (pid, *reversed(ids))


def colaunch(parts: Sequence[Part], *, num_warps: int, num_stages: int,
             interpret: bool = False, name: str = "colaunch") -> list[tuple[jax.Array, ...]]:
    """Run `parts` in one Pallas Triton launch -> each part's outputs, in order.

    The launch takes one `num_warps` and `num_stages` (Triton's, for every part: give the
    parts' own where they agree). A part's programs come in the order given: the first part
    is issued first (put a long-latency part there, so that it starts with the launch)."""
    if not parts:
        raise ValueError("colaunch: no parts")
    for p in parts:
        if not p.grid or any(n < 1 for n in p.grid):
            raise ValueError(f"colaunch: a part's grid {p.grid} must have at least one "
                             f"program on every axis")
    n_in = [len(p.inputs) for p in parts]
    n_out = [len(p.out_shape) for p in parts]
    total_in = sum(n_in)

    def kernel(*refs):
        pid = pl.program_id(0)
        first, ri, ro = 0, 0, total_in
        for p, a, b in zip(parts, n_in, n_out, strict=True):
            part_refs = refs[ri:ri + a] + refs[ro:ro + b]

            @pl.when((pid >= first) & (pid < first + p.programs))
            def _(p=p, part_refs=part_refs, first=first):
                p.body(unravel(pid - first, p.grid), *part_refs)

            first, ri, ro = first + p.programs, ri + a, ro + b

    out_shape = [s for p in parts for s in p.out_shape]
    aliases, ri, ro = {}, 0, 0
    for p, a, b in zip(parts, n_in, n_out, strict=True):
        for i, o in p.aliases.items():
            if not (0 <= i < a and 0 <= o < b):
                raise ValueError(f"colaunch: a part's alias {i} -> {o} is outside its {a} "
                                 f"inputs and {b} outputs")
            aliases[ri + i] = ro + o
        ri, ro = ri + a, ro + b
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(sum(p.programs for p in parts),),
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*[x for p in parts for x in p.inputs])
    result, at = [], 0
    for b in n_out:
        result.append(tuple(outs[at:at + b]))
        at += b
    return result
