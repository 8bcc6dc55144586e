"""The raw Triton kernel of `pool_topk_triton` (imports triton: load it only where the caller
asked for this kernel; `pool_topk_triton.py` does, lazily).

One program per row, the row held in registers. Scores become unsigned 32-bit keys in
`pool_topk.sortable_key`'s order (u = key ^ 0x80000000: -inf lowest, -0.0 just below +0.0).
The winners are the k largest composite keys `(u << 32) | (0xFFFFFFFF - index)`: score
descending, then index ascending (the tie rule of `lax.top_k`); the composite is unique per
index, so its descending sort is the answer.

The k-th largest u by `32 / DIGIT_BITS` histogram passes (`tl.histogram` over the digit of the
keys that share the prefix settled so far); the winners (u > kth, then the lowest-index ties
u == kth) compacted into a per-row scratch at their prefix-sum position; after a barrier the k
of them are loaded and sorted (`tl.sort` of the composite). Rows with fewer than k keys above
-inf skip the passes (the kth is -inf) and rows of only -inf (padding) store 0..k-1 directly.
A row whose keys above -inf all lie in the first quarter (half) of the lanes, as a prompt
row's candidate pools do, is selected over those lanes alone (`select_live`: QUARTER, HALF),
with the same winners.
"""

from __future__ import annotations

import triton
import triton.language as tl

# sortable u of -inf: ~0xFF800000
NEG_INF_U = tl.constexpr(0x007FFFFF)


@triton.jit
def radix_kth(u, valid, K: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """u [PP] uint32 keys, valid [PP] -> (kth [] uint32, the K-th largest valid key; need []
    int32, how many keys == kth belong to the top K)."""
    NB: tl.constexpr = 1 << DIGIT_BITS
    bins = tl.arange(0, NB)  # [NB]
    need = K + 0 * tl.program_id(0)  # [] keys still to take at or below the prefix
    prefix = (0 * tl.program_id(0)).to(tl.uint32)  # [] the settled high bits of the kth
    match = valid  # [PP] keys whose high bits equal the prefix
    for p in tl.static_range(32 // DIGIT_BITS):
        shift = 32 - DIGIT_BITS * (p + 1)  # constexpr: p and DIGIT_BITS are
        digit = ((u >> shift) & (NB - 1)).to(tl.int32)  # [PP]
        hist = tl.histogram(digit, NB, mask=match)  # [NB]
        # keys of the prefix with digit >= d: the largest d still holding `need` wins
        ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [NB]
        d = tl.max(tl.where(ge >= need, bins, 0), axis=0)  # []
        need = need - tl.sum(tl.where(bins > d, hist, 0), axis=0)
        prefix = prefix | (d.to(tl.uint32) << shift)
        match = match & (digit == d)
    return prefix, need


@triton.jit
def store_winners(u, valid, offs, kth, need, out_ptr, cu_ptr, ci_ptr, row, K: tl.constexpr,
                  KP: tl.constexpr):
    """The keys > kth and the first `need` keys == kth (index order), compacted into the
    row's scratch (KP slots per row), sorted on the composite key, their indices stored at
    out_ptr's row."""
    lane = tl.arange(0, KP)  # [KP]
    gt = valid & (u > kth)
    eq = (valid & (u == kth)).to(tl.int32)  # [PP]
    win = gt | ((eq == 1) & (tl.cumsum(eq, axis=0) - eq < need))
    wi = win.to(tl.int32)
    pos = tl.cumsum(wi, axis=0) - wi  # [PP] slot of each winner, in index order
    base = row * KP
    tl.store(cu_ptr + base + pos, u.to(tl.int32, bitcast=True), mask=win)
    tl.store(ci_ptr + base + pos, offs, mask=win)
    tl.debug_barrier()  # the slots were written by other threads of this program
    wu = tl.load(cu_ptr + base + lane, mask=lane < K, other=0).to(tl.uint32, bitcast=True)
    inv = (~tl.load(ci_ptr + base + lane, mask=lane < K, other=0)).to(tl.uint32, bitcast=True)
    comp = (wu.to(tl.uint64) << 32) | inv.to(tl.uint64)  # [KP]
    top = tl.sort(tl.where(lane < K, comp, 0), descending=True)  # [KP]
    idx = ~(top.to(tl.uint32).to(tl.int32, bitcast=True))  # [KP] low word -> index
    tl.store(out_ptr + row * K + lane, idx, mask=lane < K)


@triton.jit
def select_rest(u, valid, offs, out_ptr, cu_ptr, ci_ptr, row, K: tl.constexpr,
                KP: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """The radix select and the winners' sort on a row whose kth is above -inf."""
    kth, need = radix_kth(u, valid, K, DIGIT_BITS)
    store_winners(u, valid, offs, kth, need, out_ptr, cu_ptr, ci_ptr, row, K, KP)


@triton.jit
def sortable_u(x):
    """f32 scores -> uint32 keys in `pool_topk.sortable_key`'s order, unsigned."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed sortable key
    return (key ^ (-2147483648)).to(tl.uint32, bitcast=True)  # the same order, unsigned


@triton.jit
def select_prefix(s_ptr, out_ptr, cu_ptr, ci_ptr, row, P: tl.constexpr, L: tl.constexpr,
                  K: tl.constexpr, KP: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """`select_rest` over the row's first L lanes only, for a row whose keys above -inf all
    lie there (and are at least K): the keys past L are -inf, below the kth, so the winners
    and their order are the whole row's."""
    offs = tl.arange(0, L)  # [L]
    valid = offs < P
    u = sortable_u(tl.load(s_ptr + row * P + offs, mask=valid, other=0.0))  # [L]
    select_rest(u, valid, offs, out_ptr, cu_ptr, ci_ptr, row, K, KP, DIGIT_BITS)


@triton.jit
def select_live(u, valid, offs, s_ptr, out_ptr, cu_ptr, ci_ptr, row, P: tl.constexpr,
                K: tl.constexpr, KP: tl.constexpr, DIGIT_BITS: tl.constexpr,
                QUARTER: tl.constexpr, HALF: tl.constexpr):
    """A row whose kth is above -inf: where its keys above -inf all lie in the first QUARTER
    (or HALF) lanes (a prompt row's candidates are a prefix of the pools), the select runs
    over those lanes only (`select_prefix`); else over all PP. A zero QUARTER or HALF: no such
    branch."""
    if (QUARTER > 0) or (HALF > 0):
        last = tl.max(tl.where(valid & (u > NEG_INF_U), offs, -1), axis=0)  # [] last live
        if QUARTER > 0:
            if last < QUARTER:
                select_prefix(s_ptr, out_ptr, cu_ptr, ci_ptr, row, P, QUARTER, K, KP,
                              DIGIT_BITS)
            elif HALF > 0:
                if last < HALF:
                    select_prefix(s_ptr, out_ptr, cu_ptr, ci_ptr, row, P, HALF, K, KP,
                                  DIGIT_BITS)
                else:
                    select_rest(u, valid, offs, out_ptr, cu_ptr, ci_ptr, row, K, KP,
                                DIGIT_BITS)
            else:
                select_rest(u, valid, offs, out_ptr, cu_ptr, ci_ptr, row, K, KP, DIGIT_BITS)
        else:
            if last < HALF:
                select_prefix(s_ptr, out_ptr, cu_ptr, ci_ptr, row, P, HALF, K, KP, DIGIT_BITS)
            else:
                select_rest(u, valid, offs, out_ptr, cu_ptr, ci_ptr, row, K, KP, DIGIT_BITS)
    else:
        select_rest(u, valid, offs, out_ptr, cu_ptr, ci_ptr, row, K, KP, DIGIT_BITS)


@triton.jit
def pool_topk_kernel(s_ptr, out_ptr, cu_ptr, ci_ptr, P: tl.constexpr, PP: tl.constexpr,
                     K: tl.constexpr, KP: tl.constexpr, DIGIT_BITS: tl.constexpr,
                     QUARTER: tl.constexpr = 0, HALF: tl.constexpr = 0):
    """s_ptr [N, P] f32 in; out_ptr [N, K] int32 out; cu_ptr, ci_ptr [N, KP] int32 scratch
    (the winners' keys and indices). PP = next_pow2(P), KP = next_pow2(K) <= PP. A row of only
    -inf stores 0..K-1 at once; a row with fewer than K keys above -inf takes -inf as its kth
    without the radix passes; QUARTER / HALF (0: off): a row whose keys above -inf all lie in
    the first QUARTER (HALF) lanes is selected over those lanes alone (`select_live`)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, PP)  # [PP] pool index
    valid = offs < P  # [PP]: lanes past P are never counted nor chosen
    x = tl.load(s_ptr + row * P + offs, mask=valid, other=0.0)  # [PP] f32
    u = sortable_u(x)  # [PP]
    n_gt = tl.sum((valid & (u > NEG_INF_U)).to(tl.int32), axis=0)  # [] above -inf
    n_ge = tl.sum((valid & (u >= NEG_INF_U)).to(tl.int32), axis=0)  # [] at or above
    if (n_gt == 0) & (n_ge == P):  # every score -inf: the index order
        lane = tl.arange(0, KP)  # [KP]
        tl.store(out_ptr + row * K + lane, lane, mask=lane < K)
    elif (n_gt < K) & (n_ge >= K):  # the kth is -inf
        kth = (n_gt * 0 + NEG_INF_U).to(tl.uint32)
        store_winners(u, valid, offs, kth, K - n_gt, out_ptr, cu_ptr, ci_ptr, row, K, KP)
    else:
        select_live(u, valid, offs, s_ptr, out_ptr, cu_ptr, ci_ptr, row, P, K, KP, DIGIT_BITS,
                    QUARTER, HALF)
