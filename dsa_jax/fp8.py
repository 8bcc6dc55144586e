"""Weights kept in their fine-grained fp8 form: `float8_e4m3fn` values with one fp32 scale per
block (Hugging Face "fine-grained fp8", as the GLM / DeepSeek FP8 releases store them).

A weight's value is `values * scale` blockwise, computed in fp32 and rounded to bf16: the
rounding the load-time dequantization (`weights.dequantize_fp8`, then the fold's cast to
bf16) applies, so a GEMM over `dequantize(w)` has the bits of a GEMM over the bf16 weight the
checkpoint loads to today. `Fp8Block` holds one such weight (its leading axes, e.g. heads,
carry their own scale rows); `StackedRows` holds the input GEMM's weight, whose stacked parts
may be fp8 or not (`indexer.weights_proj` is unquantized in the releases and scaled by a fold).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_jax.errors import WeightError

FP8 = "float8_e4m3fn"  # the stored dtype of an fp8 weight
COMPUTE_DTYPE = jnp.bfloat16  # what its GEMMs multiply: fp8 * scale, rounded
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # stored weights that need their scale
SCALE_SUFFIX = "_scale_inv"  # HF: `q_a_proj.weight` -> `q_a_proj.weight_scale_inv`


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight `[..., N, K]` in `block = (rows, cols)` blocks."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


@dataclasses.dataclass(frozen=True)
class Fp8Block:
    """A weight `[..., N, K]` stored as fp8 values and one fp32 scale per `block` of its last
    two axes: `values [..., N, K]` float8_e4m3fn, `scale [..., ceil(N/bn), ceil(K/bk)]` f32.
    `shape` is the weight's; `dtype` is what its GEMMs compute in (bf16)."""

    values: jax.Array
    scale: jax.Array
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self):
        return jnp.dtype(COMPUTE_DTYPE)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scale.nbytes)

    def dequantize(self) -> jax.Array:
        """The bf16 weight `[..., N, K]`: `values * scale` in fp32, rounded once."""
        return dequantize_blocks(self.values, self.scale, self.block)


jax.tree_util.register_dataclass(Fp8Block, data_fields=["values", "scale"],
                                 meta_fields=["block"])


@dataclasses.dataclass(frozen=True)
class StackedRows:
    """A weight `[sum(N_i), K]` stored as row parts, each an `Fp8Block` or a bf16 array
    `[N_i, K]`: the input GEMM's stacked weight where its parts are not all fp8 (or not all
    aligned to the block grid). `shape` and `dtype` are the whole weight's."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape  # [..., N_0, K]: a stack of layers adds leading axes
        return (*first[:-2], sum(p.shape[-2] for p in self.parts), first[-1])

    @property
    def ndim(self) -> int:
        return len(self.parts[0].shape)

    @property
    def dtype(self):
        return jnp.dtype(COMPUTE_DTYPE)

    @property
    def nbytes(self) -> int:
        return int(sum(p.nbytes for p in self.parts))

    def dequantize(self) -> jax.Array:
        """The bf16 weight: every part dequantized, stacked."""
        return jnp.concatenate([dense(p) for p in self.parts], axis=-2)


jax.tree_util.register_dataclass(StackedRows, data_fields=["parts"], meta_fields=[])


def dequantize_blocks(values: jax.Array, scale: jax.Array, block: tuple[int, int]
                      ) -> jax.Array:
    """`values [..., N, K]` (fp8) times `scale [..., ceil(N/bn), ceil(K/bk)]` blockwise, in
    fp32, rounded to bf16 `[..., N, K]`."""
    n, k = values.shape[-2:]
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block[0], axis=-2), block[1],
                      axis=-1)[..., :n, :k]  # [..., N, K]
    # The bf16 rounding as an op XLA keeps: a convert pair f32 -> bf16 -> f32 before an f32
    # dot may be dropped by its simplifier, which would multiply the unrounded products.
    w = lax.reduce_precision(values.astype(jnp.float32) * full, exponent_bits=8,
                             mantissa_bits=7)
    return w.astype(COMPUTE_DTYPE)


def dense(w):
    """A weight as a plain array: an `Fp8Block` or `StackedRows` dequantized, else itself."""
    return w.dequantize() if isinstance(w, (Fp8Block, StackedRows)) else w


def is_fp8(w) -> bool:
    return isinstance(w, (Fp8Block, StackedRows))


def quantize_blocks(w: np.ndarray, block: tuple[int, int]) -> Fp8Block:
    """A float weight `[..., N, K]` -> the `Fp8Block` an fp8 release would store for it: per
    block scale = amax / 448 (1 where the block is zero), values = fp8(w / scale) (e4m3's
    round to nearest even, saturating at 448). For tests and random checkpoints."""
    w = np.asarray(w, np.float32)
    *lead, n, k = w.shape
    gn, gk = grid(w.shape, block)[-2:]
    pad = np.zeros((*lead, gn * block[0], gk * block[1]), np.float32)
    pad[..., :n, :k] = w
    blocks = pad.reshape(*lead, gn, block[0], gk, block[1])
    amax = np.abs(blocks).max(axis=(-3, -1))  # [..., gn, gk]
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)[..., :n, :k]
    values = np.clip(w / full, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return Fp8Block(jnp.asarray(values), jnp.asarray(scale), tuple(block))


def compute_weights(cfg, weights):
    """`weights` (a `DsaWeights`) as the step multiplies them. On 'xla' every fp8 field is
    dequantized to bf16 (`dense`), the other fields as they are: the GEMMs then see the bf16
    weights the load-time dequantization gives, so their results are those bits. Runs inside
    the traced step (the weights stay fp8 in memory). Where the kernels run ('pallas',
    'pallas-interpret') the weights pass as they are: the row-invariant GEMM kernels
    dequantize each tile themselves (the same bits), and the XLA GEMMs of a prompt's rows
    dequantize in their definitions."""
    if not any(is_fp8(f) for f in weights):
        return weights
    from dsa_jax.implementation import resolve

    if resolve(cfg.implementation) != "xla":  # the kernels read the blocks
        return weights
    return type(weights)(*[dense(f) for f in weights])


# The load-time folds on fp8 blocks (`weights.fold_weights` under fp8 weights)


def scale_grid(name: str, w: np.ndarray, scale: np.ndarray, block: tuple[int, int],
               where: str) -> np.ndarray:
    """The checked fp32 scale grid `[ceil(out / bn), ceil(in / bk)]` of the fp8 weight `w
    [out, in]` (a one-element scale broadcast to it); `WeightError` naming the tensor for a
    non-floating or non-finite scale or a grid that does not fit the weight and `block`."""
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise WeightError(f"{where}: scale of {name!r} has dtype {scale.dtype.name}, expected "
                          f"a floating dtype")
    s = scale.astype(np.float32)
    if not np.isfinite(s).all():
        raise WeightError(f"{where}: scale of {name!r} holds {int((~np.isfinite(s)).sum())} "
                          f"non-finite value(s) (NaN or inf): the checkpoint is damaged")
    b0, b1 = block
    if w.ndim != 2 or (s.size != 1 and s.ndim != 2):
        raise WeightError(f"{where}: scale of {name!r} has shape {list(s.shape)} for a weight "
                          f"of shape {list(w.shape)}; expected one scale or a 2-D block grid")
    grid = (-(-w.shape[0] // b0), -(-w.shape[1] // b1))
    if s.size == 1:
        return np.full(grid, s.reshape(()), np.float32)
    if s.shape != grid:
        raise WeightError(f"{where}: scale of {name!r} has shape {list(s.shape)}, but a "
                          f"{list(w.shape)} weight in [{b0}, {b1}] blocks needs {list(grid)} "
                          f"(set DsaConfig.weight_block, or fp8_block, to the checkpoint's "
                          f"weight_block_size)")
    return s


def kept(hf, name: str, block: tuple[int, int], where: str):
    """An HF GEMM weight as the fp8 path keeps it: an `Fp8Block` where it is stored fp8 (its
    scale checked), else fp32 values."""
    w = hf[name]
    stored = jnp.dtype(w.dtype).name
    if stored not in FP8_DTYPES:
        return np.asarray(w, np.float32)
    if stored != FP8:
        raise WeightError(f"{where}: tensor {name!r} is {stored}; weights kept as fp8 are "
                          f"{FP8}: load it with param_dtype='bfloat16' (dequantized)")
    if name + SCALE_SUFFIX not in hf:
        raise WeightError(f"{where}: tensor {name!r} is {stored} without its scale "
                          f"{name + SCALE_SUFFIX!r}")
    w = np.asarray(w)
    scales = scale_grid(name, w, np.asarray(hf[name + SCALE_SUFFIX]), block, where)
    return Fp8Block(jnp.asarray(w), jnp.asarray(scales), block)


def cut(w, axis: int, start: int, stop: int, name: str, where: str):
    """`w` (`Fp8Block` or fp32 values) cut to `[start, stop)` along axis -2 (rows) or -1
    (columns); an `Fp8Block` only at block boundaries (its scales are per block)."""
    index = [slice(None)] * w.ndim
    index[axis] = slice(start, stop)
    if not isinstance(w, Fp8Block):
        return w[tuple(index)]
    b = w.block[axis]
    if start % b or (stop % b and stop != w.shape[axis]):
        raise WeightError(f"{where}: {name!r} is cut at [{start}, {stop}) along an axis of fp8 "
                          f"blocks of {b}: a cut must fall on a block boundary (this head "
                          f"count per rank splits its blocks; use param_dtype='bfloat16')")
    grid_index = list(index)
    grid_index[axis] = slice(start // b, -(-stop // b))
    return Fp8Block(w.values[tuple(index)], w.scale[tuple(grid_index)], w.block)


def split_heads(w, heads: int, name: str, where: str):
    """`w [H*P, K]` -> `[H, P, K]` (each head's rows; an `Fp8Block` where P is whole blocks)."""
    if not isinstance(w, Fp8Block):
        return w.reshape(heads, -1, w.shape[-1])
    per = w.shape[0] // heads
    if per % w.block[0]:
        raise WeightError(f"{where}: {name!r} has {per} rows per head, not a whole number of "
                          f"fp8 blocks of {w.block[0]}: its heads cannot keep their scales")
    return Fp8Block(w.values.reshape(heads, per, -1),
                        w.scale.reshape(heads, per // w.block[0], -1), w.block)


def compute(w):
    """A kept weight as the step reads it: an `Fp8Block` as it is, fp32 values as bf16."""
    return w if isinstance(w, Fp8Block) else jnp.asarray(w, COMPUTE_DTYPE)


def stack_rows(parts: list):
    """The input GEMM's row parts -> one `Fp8Block` where all are fp8 blocks of whole block
    rows, else `StackedRows` (neighbouring such fp8 parts merged)."""
    merged: list = []
    for p in parts:
        prev = merged[-1] if merged else None
        if (isinstance(p, Fp8Block) and isinstance(prev, Fp8Block)
                and prev.shape[0] % prev.block[0] == 0):
            merged[-1] = Fp8Block(jnp.concatenate([prev.values, p.values]),
                                      jnp.concatenate([prev.scale, p.scale]), p.block)
        else:
            merged.append(p)
    merged = [compute(p) for p in merged]
    return merged[0] if len(merged) == 1 else StackedRows(tuple(merged))


# A weight field in a checkpoint (`dsa_jax.checkpoint`, format 6): its arrays as a nested dict
# and its layout as JSON, from which the restore builds the arrays' targets and the field.


def stored_arrays(w):
    """A weight field's arrays as a checkpoint stores them: an array as it is, an `Fp8Block`
    as `{"values", "scale"}`, `StackedRows` as `{"0": part, "1": part, ...}`."""
    if isinstance(w, Fp8Block):
        return {"values": w.values, "scale": w.scale}
    if isinstance(w, StackedRows):
        return {str(i): stored_arrays(p) for i, p in enumerate(w.parts)}
    return w


def layout(w) -> dict:
    """A weight field's layout (JSON): `{"array": [dtype, shape]}`, `{"fp8": {"block",
    "values", "scale"}}` or `{"rows": [part layouts]}`."""
    def spec(a):
        return [jnp.dtype(a.dtype).name, [int(d) for d in a.shape]]
    if isinstance(w, Fp8Block):
        return {"fp8": {"block": list(w.block), "values": spec(w.values),
                        "scale": spec(w.scale)}}
    if isinstance(w, StackedRows):
        return {"rows": [layout(p) for p in w.parts]}
    return {"array": spec(w)}


def layout_targets(lay: dict, make):
    """The nested dict of `make(dtype, shape)` that `stored_arrays` gives for `lay`."""
    if "fp8" in lay:
        return {k: make(*lay["fp8"][k]) for k in ("values", "scale")}
    if "rows" in lay:
        return {str(i): layout_targets(p, make) for i, p in enumerate(lay["rows"])}
    return make(*lay["array"])


def from_stored(arrays, lay: dict):
    """The weight field of `layout` `lay` from its stored arrays (`stored_arrays`'s form)."""
    if "fp8" in lay:
        return Fp8Block(arrays["values"], arrays["scale"], tuple(lay["fp8"]["block"]))
    if "rows" in lay:
        return StackedRows(tuple(from_stored(arrays[str(i)], p)
                                 for i, p in enumerate(lay["rows"])))
    return arrays


def layout_problem(lay: dict, block: tuple[int, int]) -> str | None:
    """What is wrong with a stored fp8 layout for `block` (None: nothing): fp8 values in
    another dtype or block, or a scale grid that does not fit its values."""
    if "rows" in lay:
        return next((p for p in (layout_problem(q, block) for q in lay["rows"]) if p), None)
    if "fp8" not in lay:
        return None
    f = lay["fp8"]
    (vd, vs), (sd, ss) = f["values"], f["scale"]
    if vd != FP8 or sd != "float32":
        return f"fp8 values {vd} with {sd} scales (expected {FP8} with float32)"
    if tuple(f["block"]) != tuple(block):
        return f"fp8 blocks of {tuple(f['block'])}, the config's weight_block is {tuple(block)}"
    if tuple(ss) != grid(tuple(vs), tuple(block)):
        return f"a scale grid {ss} for values {vs} in blocks of {tuple(block)}"
    return None
