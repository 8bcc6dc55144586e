"""The dot products of the Mosaic GPU pool-scores kernel (`pool_scores_mgpu.py`): operand splits
into exact tf32 or bf16 parts and the wgmmas of one key tile against a row group's qi parts.
Both precisions stay inside `testing.TF32X3_ROUNDOFF` per product (see each function)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Keeps an fp32 word's sign, exponent and the 10 high significand bits: a tf32 value.
TF32_MASK = -(1 << 13)  # 0xFFFFE000 as int32
BF16_MASK = -(1 << 16)  # 0xFFFF0000: sign, exponent and 7 significand bits
F32_SWIZZLE = 32  # f32 elements in one 128-byte swizzle row


def trunc(x, mask: int = TF32_MASK):
    """x f32 with the bits outside `mask` cleared (toward zero)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return lax.bitcast_convert_type(bits & jnp.int32(mask), jnp.float32)


def split_tf32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x f32 -> (hi, lo), both exact tf32 values: hi = x truncated to 10 significand bits,
    lo = (x - hi) truncated the same way (x - hi is exact in fp32), so
    |x - hi - lo| <= 2^-10 |x - hi| <= 2^-20 |x|."""
    hi = trunc(x)
    return hi, trunc(x - hi)


def dots_tf32x3(k_ref, lo_ref, qbuf, *, nq: int, dp: int):
    """The tile's head dots [BP, nq] f32 as three tf32 products, hi x qhi + lo x qhi + hi x
    qlo: k_ref [BP, Dp] f32 (the raw keys, fed as hi: Hopper's tensor core ignores an fp32
    word's low 13 bits, so they multiply as their truncated hi parts without a write back;
    a rounding tensor core would fail the parity tests' bound), lo_ref [BP, Dp] f32 (lo parts
    written here), qbuf [2 nq, Dp] f32 (qi's hi parts, then lo parts). The products with qhi
    and qlo of the hi keys are one wgmma of N = 2 nq (the hi tile read from shared memory once
    for both), lo x qhi a second accumulator, the three summed in registers."""
    block_p = k_ref.shape[0]
    for c in range(dp // F32_SWIZZLE):  # one swizzle column at a time
        cols = pl.ds(c * F32_SWIZZLE, F32_SWIZZLE)
        k = k_ref.at[:, cols][...]  # [BP, 32] f32
        hi = trunc(k)
        lo_ref.at[:, cols][...] = trunc(k - hi)
    plgpu.commit_smem()  # lo visible to wgmma
    q_hi = plgpu.transpose_ref(qbuf.at[pl.ds(0, nq)], (1, 0))  # [Dp, nq]

    def dots(both_ref, lo_acc_ref):  # hi x [qhi | qlo] (N = 2 nq: hi read once), lo x qhi
        plgpu.wgmma(both_ref, k_ref, plgpu.transpose_ref(qbuf, (1, 0)))
        plgpu.wgmma(lo_acc_ref, lo_ref, q_hi)
        return both_ref[...], lo_acc_ref[...]

    both, lo_acc = pl.run_scoped(dots, plgpu.ACC((block_p, 2 * nq), jnp.float32),
                                 plgpu.ACC((block_p, nq), jnp.float32))
    return (both[:, :nq] + lo_acc) + both[:, nq:]  # [BP, nq]


def split_bf16(x):
    """x f32 -> (x1, x2, x3) bf16, x = x1 + x2 + x3 + e: x1 = x truncated to bf16's 8
    significand bits, x2 = (x - x1) likewise (the remainders are exact in fp32), x3 = the rest
    rounded: |x - x1| < 2^-7 |x|, |x2 + x3 - (x - x1)| < 2^-14 |x|, |e| <= 2^-23 |x|. The
    truncations are bit masks, so x1 and x2 are exact bf16 values before any conversion
    (XLA's excess-precision rewrites cannot change them)."""
    x1 = trunc(x, BF16_MASK)
    r = x - x1
    x2 = trunc(r, BF16_MASK)
    return (x1.astype(jnp.bfloat16), x2.astype(jnp.bfloat16),
            (r - x2).astype(jnp.bfloat16))


def split_bf16_into(q_ref, qbuf, wg, *, consumers: int):
    """qi's three bf16 parts written in shared memory by the consumers: q_ref [nq, Dp] f32 (a
    row group's qi as loaded) -> qbuf [3 nq, Dp] bf16 (q1, q2, q3 of `split_bf16`, the same
    bits as split in jnp). Consumer `wg` takes the 64-column blocks c = wg mod consumers, in
    64-row blocks (the wgmma register layout's rows); nq and Dp multiples of 64."""
    nq, dp = q_ref.shape
    for c in range(dp // 64):
        @pl.when(wg == c % consumers)
        def _(c=c):
            cols = pl.ds(c * 64, 64)
            for r in range(nq // 64):
                parts = split_bf16(q_ref.at[pl.ds(r * 64, 64), cols][...])  # 3 x [64, 64]
                for i, part in enumerate(parts):
                    qbuf.at[pl.ds(i * nq + r * 64, 64), cols][...] = part


def dots_bf16x3(k_ref, qbuf, *, block_p: int, nq: int):
    """The tile's head dots [BP, nq] f32 for bf16 keys (exact as stored): one wgmma of the key
    tile k_ref [BP, Dp] bf16 (shared memory) against qi's three bf16 parts side by side in N
    (qbuf [3 nq, Dp]: q1, q2, q3 of `split_bf16`), summed k q1 + (k q2 + k q3). Each product
    of two bf16 values is exact in fp32, and qi's parts leave |e| <= 2^-23 |q| (`split_bf16`),
    so a product is off by less than 2^-22 relative, inside `TF32X3_ROUNDOFF`."""
    def dots(acc_ref):
        plgpu.wgmma(acc_ref, k_ref, plgpu.transpose_ref(qbuf, (1, 0)))
        return acc_ref[...]

    acc = pl.run_scoped(dots, plgpu.ACC((block_p, 3 * nq), jnp.float32))  # [BP, 3 nq]
    return acc[:, :nq] + (acc[:, nq:2 * nq] + acc[:, 2 * nq:])  # [BP, nq]
