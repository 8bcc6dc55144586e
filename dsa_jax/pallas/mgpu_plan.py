"""The Mosaic GPU attend kernel's plan: its tuning, shared memory, shape support, split
count and the per-row q scaling into f16 (`sparse_attend_mgpu` runs the kernel)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsa_jax.pallas import mgpu_gather
from dsa_jax.pallas.common import check_register_budgets

HEADS_PER_CTA = 64  # the wgmma M of one warpgroup
SMEM_LIMIT = 227 * 1024  # shared memory one CTA may take on the H200


@dataclasses.dataclass(frozen=True)
class MgpuTuning:
    """Tile shape, producer and register split of the Mosaic GPU kernel, and how its inputs are
    made. The defaults are the fastest variant measured on the H200 (benchmarks/notes.md,
    h200-attend-run3/4.json; the prep: run6/7).

    block_w: slots per tile (wgmma N of the logits, K of P @ V); 64 as FlashMLA.
    stages: fp8 staging buffers the producers may fill ahead of the consumers.
    index_group: slot indices the producer reads before issuing their copies (one memory
      latency per group of rows).
    issue_warps: each of the producer's 4 warps issues a quarter of a tile's copies (else one
      thread issues them all).
    q_in_kernel: the consumers read q in fp32 and scale and convert it to f16 themselves (else
      jnp converts q before the call, one more pass over q).
    row_pad: bytes between staged rows beyond C (16: the rows one warp reads at once fall in
      different banks, where a C = 512-byte stride puts them in the same ones).
    consumer_regs / producer_regs: per-thread register budgets (setmaxnreg) of the two compute
      warpgroups and the producer, multiples of 8 with 2 * consumer + producer <= 3 * 168
      (the CTA's registers at launch: a consumer's setmaxnreg.inc beyond them waits forever).
    max_splits: most programs one row's slots are split over (partials cost a merge). 64
      (a 2051-slot row's 33 tiles one per split at up to 4 rows): on the H200 one decode
      row's attend took 12.3 us of kernels over 33 splits against 16.0 over 16
      (h200-attend-20261203-s19-call1.json).
    prep: how the kernel's inputs (scaled f16 q, padded slots, live extents) are made: "jnp"
      (~5 XLA passes, q read twice) or "triton" (`attend_prep.prep_pallas`: one launch, q read
      once; bitwise the same inputs, so the same result; with q_in_kernel it makes all but q).
    prep_heads / prep_warps: the "triton" prep's heads per load chunk and warps (64 / 16: a
      64-head row stays in registers, read once).
    prep_per_sm: the "triton" prep's programs per multiprocessor, each looping over rows
      (0: one program per row).
    prep_slots_apart: with scale_heads, the "triton" prep writes each row's slots and live
      extent from a program of its own (else its first head group's program does, after
      the slots' two dependent loads); the same inputs either way. On the H200 decode-b1's
      prep 1.76 vs 2.57 us, 64x1's 5.42 vs 5.86 (h200-attend-20261203-s21-call2.json).
    persistent: one CTA per multiprocessor, each looping over (row, split, head block) items
      with its pipeline running on across them (else one CTA per item). Measured slower
      (h200-attend-run6): an option, not the default.
    convert: who converts the e4m3 rows to f16: "consumer" (the producer bulk-copies rows into
      fp8 staging, `stages` deep, and each consumer converts its column half before its dots)
      or "producer" (`mgpu_gather`: the producer loads the rows into registers, converts them
      and writes f16 tiles, `stages` deep, in the staging's shared memory; the consumers only
      wait, multiply and run the softmax). index_group, issue_warps and row_pad apply to
      "consumer" only.
    gather_ahead: with convert="producer", the producer issues tile t + 1's loads before it
      converts and stores tile t (two tiles of rows in registers), so their latency overlaps
      the conversion and the wait for a free tile.
    full_logits: with convert="producer", each consumer computes the logits over all C (both
      Q halves against both tile halves: the QK work twice, no exchange of partial logits, no
      barrier between the consumers; the fp32 sum runs in another order than the exchange's,
      so the output is not bitwise the default's, within the same bound).
    pingpong: with full_logits, a schedule barrier alternates the consumers (as jax's
      attention_mgpu): one's softmax runs while the other's wgmmas hold the tensor cores.
    design: "exchange" (the fields above: a producer warpgroup and two consumers that each
      own half of C and exchange partial logits every tile) or "flashmla" (FlashMLA's split,
      `sparse_attend_mgpu._flashmla_kernel`: warpgroup 0 runs the logits over all C, the
      softmax and P @ V of half the columns; warpgroup 1 gathers and converts the next tile
      into a second f16 tile and runs P @ V of the other half; block_w 64, and none of the
      producer, staging, register-split, persistent or q_in_kernel fields apply).
    converters: with design="flashmla", the warpgroups that gather, convert and run P @ V of
      the second half of C: 1 (whole tiles, one ahead in registers, C/2 columns) or 2 (half of
      each tile's rows, two tiles ahead, C/4 columns each: twice the rows in flight, under the
      setmaxnreg budgets `flashmla_regs`).
    flashmla_regs: (warpgroup 0, each converter) register budgets with converters=2, multiples
      of 8 within the CTA's 3 * 168 at launch.
    stage_slots: with design="flashmla", the split's slot indices are bulk-copied into shared
      memory once (tiles * block_w * 4 bytes), so no per-tile global load of them sits in the
      gather's or the mask's path.
    direct_out: with one split per row and no padded block, the kernel writes the attend's
      result in the caller's dtype itself (its normalized partial is the result; rounded once,
      as the merge kernel would round it), so no merge pass reads it back (a prompt's rows:
      one split each). On in the library's default (`AttendTuning.mosaic`): on the
      H200 bitwise the merge's result and faster (h200-direct-out-20261202-s14-call1.json).
    scale_heads: heads of a row that share one q scale (16, 32 or 64, each group's heads
      scaled by the power of two that brings their own largest |q| into [2^13, 2^14); 0: one
      scale for the whole row). With groups the "triton" prep runs one program per (row,
      group), not one per row (a decode's 64-head row is 128 KiB of f32 that one program reads
      alone), and the kernel scales each logit row by its head's 2^-k. A group's q is rounded
      at its own scale (at least the row's): other last bits than 0, within the same bound.
      design="flashmla" only. 16 in the library's default (`AttendTuning.mosaic`):
      on the H200 within the bound on every check case, the prep faster at 16 than at 32
      (h200-attend-20261202-s14-call1.json). 0 here, the dataclass's own design being
      "exchange".
    bound_scales: where the caller gives q already scaled per (row, head) and in f16 (a
      prompt's rows: `projection.scaled_q_abs`, its scale from a bound known before the U_k
      GEMM, made by one Pallas kernel, `pallas/scaled_q_abs.py`: q read once, the f16 result
      and the scale written), the kernel takes it as it is: no f32 q_abs written and read
      back, no prep (the slots in jnp). q_abs's products rounded to f16 as `scale_heads`
      rounds them, except for values below f16's normal range (2^-27 of their bound). Needs
      scale_heads (the kernel's per-head logit scale). On in the library's default
      (`AttendTuning.mosaic`; the layer makes the scaled q only where the attend reads
      it: `sparse_attend.takes_scaled_q`): on the H200 prefill-9000's kernels 10.63 ms
      against 10.88 with the U_k GEMM and the prep, every GPU must-hold passing
      (h200-profile-20261202-s15-call2.json); with XLA's GEMM in its place (the fourteenth
      session) 10.83, within noise.
    half_partials: with design="flashmla" and more than one split, each split's normalized
      partial is written as f16 in the cache's units (the mean of stored e4m3 rows: |o| <= 448,
      in f16's range whatever the cache scale) and the merge applies the cache scale
      (`merge_splits_pallas(scale=)`): half the bytes written and read back, one more f16
      rounding of each partial (relative 2^-11, absolute 2^-25 times the cache scale below
      f16's normal range). One split (a prompt's rows, or `direct_out`) is not affected.
    """

    block_w: int = 64
    stages: int = 2
    index_group: int = 16
    issue_warps: bool = True
    q_in_kernel: bool = False
    row_pad: int = 16
    consumer_regs: int = 232
    producer_regs: int = 40
    max_splits: int = 64
    prep: str = "triton"
    prep_heads: int = 64
    prep_warps: int = 16
    prep_per_sm: int = 0
    prep_slots_apart: bool = True
    persistent: bool = False
    convert: str = "consumer"
    gather_ahead: bool = False
    full_logits: bool = False
    pingpong: bool = False
    design: str = "exchange"
    converters: int = 1
    flashmla_regs: tuple[int, int] = (216, 144)
    stage_slots: bool = True
    direct_out: bool = False
    scale_heads: int = 0
    bound_scales: bool = False
    half_partials: bool = False

    def __post_init__(self):
        if self.design not in ("exchange", "flashmla"):
            raise ValueError(f"design={self.design!r} must be 'exchange' or 'flashmla'")
        if self.converters not in (1, 2):
            raise ValueError(f"converters={self.converters} must be 1 or 2")
        if self.design != "flashmla" and (self.converters != 1 or not self.stage_slots):
            raise ValueError(f"converters={self.converters}, stage_slots={self.stage_slots}: "
                             f"fields of design='flashmla' (design={self.design!r})")
        if self.scale_heads not in (0, 16, 32, HEADS_PER_CTA):
            raise ValueError(f"scale_heads={self.scale_heads} must be 0, 16, 32 or "
                             f"{HEADS_PER_CTA} (heads per q scale)")
        if self.scale_heads and (self.design != "flashmla" or self.prep_per_sm):
            raise ValueError(f"scale_heads={self.scale_heads} needs design='flashmla' and a "
                             f"prep of one program per (row, head group) (prep_per_sm=0)")
        if self.half_partials and (self.design != "flashmla" or self.converters != 1):
            raise ValueError("half_partials=True needs design='flashmla' with converters=1 "
                             "(each warpgroup stages its half of the partial in its Q half)")
        if self.bound_scales and not self.scale_heads:
            raise ValueError("bound_scales=True needs scale_heads (the kernel's per-head "
                             "logit scale)")
        if self.converters == 2:
            check_register_budgets(2, self.flashmla_regs[1], self.flashmla_regs[0])
        if self.design == "flashmla":
            off = {k: getattr(self, k) for k in ("persistent", "q_in_kernel", "full_logits",
                                                  "pingpong", "gather_ahead")
                   if getattr(self, k)}
            if off or self.convert != "consumer" or self.block_w != 64:
                raise ValueError(f"design='flashmla' runs 64-slot tiles with its own "
                                 f"gather; got block_w={self.block_w}, "
                                 f"convert={self.convert!r}, {off or ''}")
        if self.convert not in ("consumer", "producer"):
            raise ValueError(f"convert={self.convert!r} must be 'consumer' or 'producer'")
        if self.gather_ahead and self.convert != "producer":
            raise ValueError("gather_ahead=True needs convert='producer'")
        if self.full_logits and self.convert != "producer":
            raise ValueError("full_logits=True needs convert='producer' (both tile halves)")
        if self.full_logits and (self.persistent or self.q_in_kernel):
            # Each group reads both Q halves: a group rewriting its half for the next item
            # (persistent) or from registers (q_in_kernel) would race the other's reads.
            raise ValueError("full_logits=True needs persistent=False and q_in_kernel=False")
        if self.pingpong and not self.full_logits:
            raise ValueError("pingpong=True needs full_logits=True (independent consumers)")
        if self.prep not in ("jnp", "triton"):
            raise ValueError(f"prep={self.prep!r} must be 'jnp' or 'triton'")
        if self.prep_heads < 1 or self.prep_heads & (self.prep_heads - 1):
            raise ValueError(f"prep_heads={self.prep_heads} must be a power of two")
        if self.prep_per_sm < 0:
            raise ValueError(f"prep_per_sm={self.prep_per_sm} must be >= 0")
        if self.block_w not in (64, 128):
            raise ValueError(f"block_w={self.block_w} must be 64 or 128 (the conversion works "
                             f"on 64-row tiles)")
        if self.stages < 1:
            raise ValueError(f"stages={self.stages} must be >= 1")
        if self.row_pad % 16 or self.row_pad < 0:
            raise ValueError(f"row_pad={self.row_pad} must be a multiple of 16 (bulk copies)")
        if self.index_group < 1:
            raise ValueError(f"index_group={self.index_group} must be >= 1")
        # h200-attend-run9: 216 / 80 hung, the consumers' increase never granted.
        check_register_budgets(2, self.consumer_regs, self.producer_regs)


def smem_bytes(c: int, t: MgpuTuning) -> int:
    """Shared memory the kernel allocates (the H200 gives a CTA at most 227 KiB)."""
    half = c // 2
    if t.design == "flashmla":  # Q, two f16 tiles, P, the row statistics
        return (2 * HEADS_PER_CTA * half * 2 + 2 * 2 * t.block_w * half * 2
                + HEADS_PER_CTA * t.block_w * 2 + 2 * HEADS_PER_CTA * 4)
    tiles16 = t.stages if t.convert == "producer" else 1  # f16 tiles
    staged = 0 if t.convert == "producer" else t.stages * t.block_w * (c + t.row_pad)
    return (2 * HEADS_PER_CTA * half * 2  # Q halves, f16
            + staged  # fp8 staging
            + tiles16 * 2 * t.block_w * half * 2  # f16 tile halves
            + (0 if t.full_logits else 2 * HEADS_PER_CTA * t.block_w * 4))  # partial logits


def supports(cache_dtype, c: int, t: MgpuTuning = MgpuTuning()) -> str | None:
    """None if the kernel runs these shapes, else why not."""
    if jnp.dtype(cache_dtype) != jnp.float8_e4m3fn:
        return f"cache dtype {jnp.dtype(cache_dtype).name} (the kernel stages fp8 e4m3 rows)"
    if c % 128 or c // 2 > 256:
        return f"C={c} (needs a multiple of 128 with C/2 <= 256)"
    if ((t.convert == "producer" or t.design == "flashmla")
            and (why := mgpu_gather.check_shapes(t.block_w, c))):
        return why
    if t.design == "flashmla" and (c // 2 // t.converters) % 64:
        return f"C={c} with {t.converters} converters (each P @ V needs a multiple of 64 columns)"
    if smem_bytes(c, t) > SMEM_LIMIT:
        return f"shared memory {smem_bytes(c, t)} B > 227 KiB"
    return None


def num_splits(programs_per_split: int, tiles: int, sm_count: int, max_splits: int) -> int:
    """Splits per row and head block: enough CTAs (one per multiprocessor: the kernel takes
    most of its shared memory) to fill the GPU once, at most max_splits and tiles; then the
    fewest splits that keep each one's tiles at that count (no split left with padding only:
    a 33-tile row over 16 splits would run 48 tiles, over 11 it runs 33 in the same time)."""
    fit = sm_count // max(1, programs_per_split)
    most = max(1, min(max_splits, tiles, fit))
    per = -(-tiles // most)  # tiles per split
    return -(-tiles // per)


def row_scales(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [N, H, C] f32 -> (2^k_n, 2^-k_n) [N] f32 each: the power of two that brings each
    row's largest |q| into [2^13, 2^14) (see `scale_rows_f16`)."""
    amax = jnp.max(jnp.abs(q), axis=(1, 2))  # [N]
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))  # amax = f * 2^e, f in [0.5, 1)
    k = jnp.clip(14 - e, -126, 126).astype(jnp.int32)  # [N]
    one = jnp.ones_like(amax)
    return jnp.ldexp(one, k), jnp.ldexp(one, -k)


def head_scales(q: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """q [N, Hp, C] f32 (Hp a multiple of group) -> (2^k, 2^-k) [N, Hp] f32 each: `row_scales`
    of each group of `group` heads, given to each of its heads (`MgpuTuning.scale_heads`)."""
    n, hp, c = q.shape
    up, down = row_scales(q.reshape(n * (hp // group), group, c))  # [N * G] each
    return (jnp.repeat(up.reshape(n, hp // group), group, axis=1),
            jnp.repeat(down.reshape(n, hp // group), group, axis=1))


def scale_rows_f16(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [N, H, C] f32 -> (q * 2^k_n as f16 [N, H, C], 2^-k_n [N] f32).

    The kernel's dots take f16 operands (Hopper converts e4m3 to f16, not to bf16, in one
    instruction; e4m3 values are exact in f16, which also rounds q and p 4x finer than bf16).
    f16 has a narrow range, so every row is scaled by a power of two that brings its largest
    |q| into [2^13, 2^14): exact, and undone in the logit scale."""
    up, down = row_scales(q)
    return (q * up[:, None, None]).astype(jnp.float16), down
