"""Top-k pool indices under the selection's total order: score descending, then index ascending.

`pool_topk_xla` is `lax.top_k` (its documented tie rule is that order). The kernel finds the
same k indices without a sort: a radix select of the k-th largest score on the score bits,
a compaction of the selected pools in index order, then each selected pool's rank among the
k by direct comparison (or a bitonic sort of the k winners in registers, `rank="sort"`). XLA
sorts all P scores of a row; this counts over the row at most 16 times (2 bits per pass, the
row held in registers; fewer once a threshold has exactly k keys at or above it) and orders
only the k winners. `select="sample"` counts over the maxima of blocks of 4 keys instead (a
quarter of the row) and sorts the candidates at or above their k-th.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsa_jax.pallas.colaunch import Part
from dsa_jax.pallas.common import next_pow2, with_overrides
from dsa_jax.pallas.pool_topk_triton import TritonTopkTuning, pool_topk_triton

_INT_MIN = -(2 ** 31)
# sortable_key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32.
_NEG_INF_KEY = -2139095041

# The layer's pallas path runs this kernel for rows of at most this many pools (one chunk, held
# in registers) and lax.top_k for longer ones: on the H200 the kernel beat lax.top_k at
# P = 4096, and at P = 32768 (a 128K ceiling), where its passes stream the row from L2, it
# was slower (benchmarks/results/h200-topk.json).
KERNEL_MAX_P = 4096
BACKENDS = ("auto", "pallas", "triton")
RANKS = ("compare", "sort")
SELECTS = ("radix", "sample")
# backend "auto" runs the raw Triton kernel for at least this many rows: a prompt chunk, whose
# step is paced by its kernels (9000 rows: 793 vs 1024 us). Decode and verify steps (up to 512
# sequences of max_verify 4 rows) keep the Pallas kernel: at selection-b64 the Triton one's 6 us
# less of kernel time came with 37 us of wall over the kernels against 22 on the Pallas one
# (h200-bench-20261202-s16-call{2,1}.json, two hosts); a suspect is jax-triton's legacy custom
# call, which XLA may leave out of the step's command buffer.
AUTO_TRITON_MIN_ROWS = 2048


@dataclasses.dataclass(frozen=True)
class PoolTopkTuning:
    """Launch parameters of `pool_topk_pallas` (and `pool_topk_expand_pallas`).

    chunk: scores held in registers at once (a power of two; a longer row is walked in
    chunks). rank_block: winners ranked per step. radix_bits: score bits settled per counting
    pass (1, 2, 3 or 4: 32, 16, 11 or 8 passes over the row, each counting 2, 4, 8 or 16
    candidate thresholds; 3 runs a first pass of 2 bits; 2 measured fastest at 4 warps).
    rank_splits: programs per row: each runs the select and the compaction (the same work,
    repeated) and ranks its share of the k winners, so one row's ranking runs on several
    multiprocessors (None: `default_rank_splits` for rank "compare", one for "sort", whose
    programs would each sort all k: one was as fast or faster at 4, 64 and 256 rows on the
    H100, h100-select-levers-20261206-s28-call1.json). short_rows: first count the finite scores;
    a row with fewer than k of them has the -inf key as its k-th key and skips the radix
    passes, and a row with none (a padded row) writes pools 0..k-1 and skips the rest (9000
    prompt rows: 1082 vs 1124 us; 256 rows, 192 of them padded: 43.2 vs 43.0).
    fused_compare: a winner's rank counts the winners with key >= its key + [later in index
    order] (one compare per pair instead of the three of "greater, or equal and earlier");
    measured slower: 9000 prompt rows 1209 vs 1082 us (short_rows both).
    early_exit: stop the radix passes at the first threshold with exactly k keys at or above
      it (distinct scores: after 9-10 of the 16 two-bit passes for random rows); False runs
      every pass (the same indices either way).
    rank: how each program orders the k winners: "sort" (the default: the k winners sorted
      in registers by a bitonic network on (key descending, index ascending), log2(Kp)
      (log2(Kp) + 1) / 2 compare-exchange steps; each program of a row sorts all k and stores
      its share of the ranks) or "compare" (each winner's rank counted against all k,
      `rank_block` winners at a time). The same indices either way. Side by side on the
      H100 (k 512 of 4096, the fused selection): 64 rows 21.2 -> 13.3 us, 256 rows (192
      padded) 30.1 -> 17.6, 4 rows (3 padded) 11.0 -> 11.4.
    select: how the winners are found: "radix" (the radix select over the row, then the
      compaction of the k winners, ranked as `rank` says) or "sample" (the raw Triton
      kernel's method, in Pallas: the radix select over the maxima of blocks of 4 keys, a
      quarter of the row, gives a threshold with at least k keys at or above it; up to 2 Kp
      such candidates are compacted and sorted whole; more, or a row not held in registers
      in one chunk, or a row with fewer than k scores above -inf: the radix path; slower
      on the H100: 64 rows 33.0 vs 13.2 us with "radix" and "sort"). Needs
      `short_rows` (without it: "radix"). The same indices either way.
    num_warps: Triton's (8 measured slower than 4 for one row).
    backend: "pallas" (this file's kernel, the fields above), "triton" (the raw Triton kernel
    of `pool_topk_triton`, tuned by `triton`: compiled for a GPU only, needs the jax-triton
    package of the `gpu` extra; a missing package or interpret mode raises, nothing falls
    back), or "auto" (the default): "triton" when compiled for at least
    `AUTO_TRITON_MIN_ROWS` rows (a prompt chunk), else "pallas" (`runs_triton`; interpret
    mode, every decode and verify step). The same indices either way (both `==` lax.top_k).
    On the H200 a 9000-row prompt's top-k took 793 vs 1024 us in the layer (prefill-9000's
    largest piece after the attend and the GEMMs). The default since the sixteenth session:
    it makes the `gpu` extra's jax-triton a requirement of a compiled prompt of 2048+ rows
    (`docs/decisions.md`).
    H200 sweeps: benchmarks/results/h200-topk.json, h200-selection.json."""
    chunk: int = 4096
    rank_block: int = 32
    radix_bits: int = 2
    rank_splits: int | None = None
    short_rows: bool = True
    fused_compare: bool = False
    early_exit: bool = True
    rank: str = "sort"
    select: str = "radix"
    num_warps: int = 4
    backend: str = "auto"
    triton: TritonTopkTuning = TritonTopkTuning()

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"PoolTopkTuning: backend={self.backend!r} must be one of "
                             f"{BACKENDS}")
        if self.rank not in RANKS:
            raise ValueError(f"PoolTopkTuning: rank={self.rank!r} must be one of {RANKS}")
        if self.select not in SELECTS:
            raise ValueError(f"PoolTopkTuning: select={self.select!r} must be one of "
                             f"{SELECTS}")


def pool_topk_xla(scores: jax.Array, k: int) -> jax.Array:
    """The definition. scores [..., P] f32 (no NaN) -> [..., k] int32, best first."""
    return lax.top_k(scores, k)[1].astype(jnp.int32)


def sortable_key(x: jax.Array) -> jax.Array:
    """f32 -> int32 in the same total order as `lax.top_k` (signed compare): -inf lowest,
    -0.0 just below +0.0 (pool scores hold no -0.0)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


# ---------------------------------------------------------------------------------------------
# Pallas (Triton) kernel.
#
# `rank_splits` programs per row (grid (row, split)); each runs (0)-(2) on the whole row and
# ranks its share of the winners in (3). (0) With `short_rows`: count the finite scores; none
# (a padded row): the answer is pools 0..k-1 (the index order), written directly; fewer than k:
# T is -inf's key, no radix passes. (1) Radix select: the k-th largest key T, built digit by
# digit from the top (at most 32 / radix_bits counting passes over the row, fewer where a
# threshold with exactly k keys at or above it turns up first; a row of up to `chunk` scores
# stays in registers).
# (2) Compaction, in index order: every key > T, then the first k - count(> T) keys == T
# (lowest indices: the tie rule), written to scratch at their exclusive prefix-sum position.
# (3) After a barrier (the scratch is global memory written by other threads of the program),
# each selected pool's rank = how many of the k beat it (greater key, or equal key at a lower
# index); it is stored at out[rank]. Ranks are a permutation of [0, k): every slot is written.
# With rank="sort" the k winners are loaded whole and sorted instead (`sort_winners`), each
# program storing its share of the ranks. With select="sample", (1)-(2) run on the block maxima:
# their k-th T_s has at least k keys >= it; those candidates (at most 2 Kp, else (1)-(3)) are
# compacted, sorted whole and the first k stored.
# With an `Expansion`, each winner also writes its pool's KP token ids at slots rank*KP.. (when
# rank < the row's n_sel) and the programs share the slots after them (the tail, then -1):
# `select.expand_selection` without a pass of its own.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Expansion:
    """The selection's token slots written by the top-k kernel (`select.expand_selection`):
    kpool tokens per pool, width slots per row, the visible tail after the pools or not."""
    kpool: int
    width: int
    tail: bool


def expand_xla(pools: jax.Array, pos: jax.Array, valid: jax.Array, expand: Expansion
               ) -> jax.Array:
    """The definition of the kernel's slots (`select.expand_selection`): pools [..., k] best
    first, pos [...] the row's position t, valid [...] -> slots [..., W] int32. Slots
    `[0, n_sel*KP)` hold the pools' tokens in selection order, `n_sel = min(k, (t+1)//KP)`;
    the tail's `(t+1) % KP` tokens follow (with `expand.tail`); the rest -1; a row not
    valid is all -1."""
    kp, width = expand.kpool, expand.width
    *lead, k = pools.shape
    slot = jnp.arange(width)  # [W]
    n_sel = jnp.minimum(k, (pos + 1) // kp)[..., None]
    # The pools' tokens as a broadcast (slot s < k*KP holds pool s // KP's token s % KP), not
    # a gather by rank: XLA writes the broadcast at the copy rate. Slots past k*KP are never
    # below n_sel*KP.
    tokens = (pools[..., :, None] * kp + jnp.arange(kp)).reshape(*lead, k * kp)  # [..., k*KP]
    from_pool = (tokens[..., :width] if k * kp >= width else
                 jnp.pad(tokens, [(0, 0)] * len(lead) + [(0, width - k * kp)]))  # [..., W]
    tail_j = slot - n_sel * kp
    tail_count = ((pos + 1) % kp)[..., None] if expand.tail else 0
    from_tail = ((pos + 1) // kp * kp)[..., None] + tail_j
    sel = jnp.where(slot < n_sel * kp, from_pool,
                    jnp.where((tail_j >= 0) & (tail_j < tail_count), from_tail, -1))
    return jnp.where(valid[..., None], sel, -1).astype(jnp.int32)


def _topk_program(ids, *refs, k: int, chunk: int, chunks: int, rank_block: int,
                  radix_bits: int, splits: int, short_rows: bool, fused_compare: bool,
                  early_exit: bool, rank_by: str, sampled: bool, barrier: bool,
                  expand: Expansion | None):
    """Program ids (row, split) (the kernel's, or a co-launch's: `colaunch.Part`); whole refs:
    s_ref [N, Pp] f32; o_ref [N, Kp] int32 out (a row's shared by its `splits` programs: each
    writes the slots of its winners); ck_ref, ci_ref [N, S, Kp] int32 scratch (a program's
    own row; [N, S, 2 Kp] with `sampled`, the sample's candidates). With `expand`: the rows'
    positions, either pv_ref [N] int32 (each row's position, -1 for a padded row) or pos_ref
    [N] int32 and valid_ref [N] bool (`positions` of them, read here: no pass before the
    kernel), and sel_ref [N, W] int32 out (masked stores)."""
    if expand is None:
        s_ref, o_ref, ck_ref, ci_ref = refs
    else:
        s_ref, *row_refs, o_ref, ck_ref, ci_ref, sel_ref = refs
    row, split = ids
    lane = jnp.arange(chunk, dtype=jnp.int32)  # [chunk]
    pv = _row_position(row_refs, row) if expand else None
    store_winners = _winner_store(pv, sel_ref, k, expand, row) if expand else None

    if chunks == 1:
        row_keys = sortable_key(s_ref[row])  # [chunk], loaded once

        def keys_of(j):
            del j
            return row_keys
    else:
        def keys_of(j):
            return sortable_key(s_ref[row, pl.ds(j * chunk, chunk)])  # [chunk]

    def count(pred, shape=()):  # pred: [chunk] keys -> shape + [chunk] bool -> counts
        def body(j, acc):
            return acc + jnp.sum(pred(keys_of(j)).astype(jnp.int32), axis=-1)
        return lax.fori_loop(0, chunks, body, jnp.zeros(shape, jnp.int32))

    # Radix select, `radix_bits` bits per pass: the candidates prefix | (d << shift) for every
    # digit d are counted at once; the largest d still leaving >= k keys extends the prefix.
    # Where radix_bits does not divide 32 (3), a first pass settles the remaining top bits.
    def settle(prefix, shift, bits, count=count):
        # prefix/cand are bits in the unsigned order u = key ^ INT_MIN; thresholds and the max
        # are taken in signed keys, where that order holds. Digit 0 (cand = prefix) always
        # leaves >= k keys. -> (the new prefix, whether exactly k keys are >= it).
        digits = jnp.arange(1 << bits, dtype=jnp.int32)  # [D]
        cand = prefix | jnp.left_shift(digits, shift)  # [D]
        thr = cand ^ jnp.int32(_INT_MIN)  # [D] ascending (signed), so counts descend
        counts = count(lambda key: key[None, :] >= thr[:, None], digits.shape)  # [D]
        ok = counts >= k
        best = jnp.max(jnp.where(ok, thr, jnp.int32(_INT_MIN)))  # [] signed
        at_best = jnp.min(jnp.where(ok, counts, jnp.int32(2 ** 31 - 1)))  # [] its count
        return best ^ jnp.int32(_INT_MIN), (at_best == k) & (best != jnp.int32(_INT_MIN))

    top = 32 % radix_bits  # bits of the first pass where radix_bits does not divide 32

    def radix_select(count=count):
        """The k-th largest key T of the keys `count` counts over (the row's, or the sample's);
        or, where a pass finds a threshold t with exactly k keys >= t (distinct scores: after
        about log2(P) of the 32 bits), t - 1, and no further pass: the keys > t - 1 are then
        the k winners, as the keys >= T would be, so the compaction below selects the same
        pools with no tie to break."""
        prefix, exact = (settle(jnp.int32(0), 32 - top, top, count) if top
                         else (jnp.int32(0), jnp.bool_(False)))

        def more(carry):
            i, _, exact = carry
            return (i < 32 // radix_bits) & ~(exact & early_exit)

        def radix_pass(carry):
            i, prefix, _ = carry
            prefix, exact = settle(prefix, 32 - top - radix_bits - i * radix_bits, radix_bits,
                                   count)
            return i + 1, prefix, exact

        _, prefix, exact = lax.while_loop(more, radix_pass, (jnp.int32(0), prefix, exact))
        kth = prefix ^ jnp.int32(_INT_MIN)
        return jnp.where(exact & early_exit, kth - 1, kth)

    blocks = pl.cdiv(k, rank_block)
    per_split = pl.cdiv(blocks, splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, blocks)  # this program ranks winner blocks [lo, hi)
    sub = jnp.arange(rank_block, dtype=jnp.int32)  # [RB]

    def store_sorted(pools):
        """pools [n] (n >= k) best first: this program's share of the first k ranks."""
        at = jnp.arange(pools.shape[0], dtype=jnp.int32)  # [n] rank
        share = pl.cdiv(o_ref.shape[1], splits)
        mine = (at >= split * share) & (at < split * share + share) & (at < k)  # [n]
        plt.store(o_ref.at[row, at], pools, mask=mine)
        if store_winners is not None:
            store_winners(at, pools, mine)

    def select_and_rank(kth):
        need_eq = k - count(lambda key: key > kth)  # ties at the k-th key to take (0 after
        # an early exit of the radix select)

        def compact(j, carry):
            n_sel, n_eq = carry
            key = keys_of(j)
            eq = (key == kth).astype(jnp.int32)
            eq_before = n_eq + jnp.cumsum(eq) - eq
            sel = ((key > kth) | ((eq == 1) & (eq_before < need_eq))).astype(jnp.int32)
            pos = n_sel + jnp.cumsum(sel) - sel
            plt.store(ci_ref.at[row, split, pos], j * chunk + lane, mask=sel == 1)
            plt.store(ck_ref.at[row, split, pos], key, mask=sel == 1)
            return n_sel + jnp.sum(sel), n_eq + jnp.sum(eq)

        lax.fori_loop(0, chunks, compact, (jnp.int32(0), jnp.int32(0)))
        if barrier:  # interpret mode runs one thread and has no barrier primitive
            plt.debug_barrier()

        kp = o_ref.shape[1]
        at = jnp.arange(kp, dtype=jnp.int32)  # [Kp] compacted position (= index order)
        all_keys = jnp.where(at < k, ck_ref[row, split, pl.ds(0, kp)],
                             jnp.int32(_INT_MIN))  # [Kp]

        def rank(b, carry):  # returns its carry: a dynamic-bound loop cannot yield a literal
            mine = b * rank_block + sub  # [RB]
            key = ck_ref[row, split, pl.ds(b * rank_block, rank_block)]  # [RB]
            if fused_compare:
                # key_j > key_i for j at or after i, key_j >= key_i before it: one compare
                # against key_i + [j >= i] (no overflow: keys <= +inf's 0x7F800000; the
                # padding's INT_MIN key beats nothing).
                later = (at[None, :] >= mine[:, None]).astype(jnp.int32)  # [RB, Kp]
                beats = all_keys[None, :] >= key[:, None] + later  # [RB, Kp]
            else:
                beats = ((all_keys[None, :] > key[:, None])
                         | ((all_keys[None, :] == key[:, None])
                            & (at[None, :] < mine[:, None])))
                beats = beats & (at < k)[None, :]  # [RB, Kp]
            r = jnp.sum(beats.astype(jnp.int32), axis=1)  # [RB]
            pools = ci_ref[row, split, pl.ds(b * rank_block, rank_block)]  # [RB]
            plt.store(o_ref.at[row, r], pools, mask=mine < k)
            if store_winners is not None:
                store_winners(r, pools, mine < k)
            return carry

        if rank_by == "sort":
            pools_in = jnp.where(at < k, ci_ref[row, split, pl.ds(0, kp)],
                                 jnp.int32(2 ** 31 - 1))  # [Kp]
            store_sorted(sort_winners(all_keys, pools_in)[1])
            return
        lax.fori_loop(lo, hi, rank, 0)

    def sample_then_sort():
        """`select="sample"` (the row in registers, n_finite >= k): T_s, the k-th largest of
        the maxima of blocks of 4 keys (`radix_select` over them), has at least k keys >= it,
        so the k winners are among those candidates; where they fit the scratch they are
        compacted in index order and sorted whole, the first k stored (else the radix
        select over the row)."""
        slots = ck_ref.shape[2]
        sample = jnp.max(row_keys.reshape(chunk // 4, 4), axis=1)  # [chunk/4] block maxima
        t = radix_select(lambda pred, shape=(): jnp.sum(pred(sample).astype(jnp.int32),
                                                        axis=-1))
        cand = (row_keys >= t).astype(jnp.int32)  # [chunk]
        n_c = jnp.sum(cand)

        @pl.when(n_c <= slots)
        def _():
            pos = jnp.cumsum(cand) - cand  # [chunk] slot of each candidate, in index order
            plt.store(ci_ref.at[row, split, pos], lane, mask=cand == 1)
            plt.store(ck_ref.at[row, split, pos], row_keys, mask=cand == 1)
            if barrier:
                plt.debug_barrier()
            at = jnp.arange(slots, dtype=jnp.int32)  # [SLOTS]
            keys = jnp.where(at < n_c, ck_ref[row, split], jnp.int32(_INT_MIN))  # [SLOTS]
            pools_in = jnp.where(at < n_c, ci_ref[row, split], jnp.int32(2 ** 31 - 1))
            store_sorted(sort_winners(keys, pools_in)[1])

        @pl.when(n_c > slots)
        def _():
            select_and_rank(radix_select())

    if expand is not None:
        _store_tail(pv, sel_ref, k, expand, row, split, splits)
    if not short_rows:
        select_and_rank(radix_select())
        return

    n_finite = count(lambda key: key > jnp.int32(_NEG_INF_KEY))

    @pl.when(n_finite == 0)
    def _():  # every score -inf: the order is the index order
        def fill(b, carry):
            mine = b * rank_block + sub  # [RB]
            plt.store(o_ref.at[row, mine], mine, mask=mine < k)
            if store_winners is not None:
                store_winners(mine, mine, mine < k)
            return carry

        lax.fori_loop(lo, hi, fill, 0)

    @pl.when(n_finite > 0)
    def _():
        # Fewer finite scores than k: the k-th largest key is -inf's. (Computed from a value:
        # the Triton lowering cannot yield a literal from a branch.)
        neg_inf_key = n_finite - n_finite + jnp.int32(_NEG_INF_KEY)
        if not sampled:
            select_and_rank(lax.cond(n_finite < k, lambda: neg_inf_key, radix_select))
            return

        @pl.when(n_finite < k)
        def _():
            select_and_rank(neg_inf_key)

        @pl.when(n_finite >= k)
        def _():
            sample_then_sort()


def sort_winners(key: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """key, idx [n] int32 (n a power of two) -> both reordered by key descending, then idx
    ascending (the selection's total order): a bitonic network over the [2] * log2(n)
    hypercube (the shape Triton's own sort works on), each compare-exchange reading its
    partner as the pair's sum minus itself (int32 sums wrap: exact)."""
    n = key.shape[0]
    bits = n.bit_length() - 1
    shape = (2,) * bits
    e = jnp.arange(n, dtype=jnp.int32).reshape(shape)  # [2]*bits flat position
    key, idx = key.reshape(shape), idx.reshape(shape)  # [2]*bits
    for s in range(1, bits + 1):  # merge runs of 2^s
        for b in range(s - 1, -1, -1):  # partners 2^b apart
            axis = bits - 1 - b
            pk = jnp.sum(key, axis=axis, keepdims=True) - key  # [2]*bits partner's key
            pi = jnp.sum(idx, axis=axis, keepdims=True) - idx
            first = (pk > key) | ((pk == key) & (pi < idx))  # the partner goes first
            right = (lax.shift_right_logical(e, b) & 1) == 1  # the pair's later slot
            if s < bits:  # runs with bit s set are ordered the other way
                right = right != ((lax.shift_right_logical(e, s) & 1) == 1)
            take = first != right
            key, idx = jnp.where(take, pk, key), jnp.where(take, pi, idx)
    return key.reshape(n), idx.reshape(n)


def _row_position(row_refs, row):
    """Row `row`'s position, -1 where padded: pv_ref's, or `positions` of pos_ref, valid_ref."""
    if len(row_refs) == 1:
        return row_refs[0][row]
    pos_ref, valid_ref = row_refs
    return jnp.where(valid_ref[row], pos_ref[row], -1)


def _row_plan(pv, k: int, expand: Expansion):
    """A row's (n_sel, first tail token, tail tokens) at position `pv` ([] int32, -1: a padded
    row, which selects nothing and has no tail): `select.expand_selection`'s terms."""
    seen = pv + 1  # tokens visible to the row
    live = pv >= 0
    n_sel = jnp.where(live, jnp.minimum(k, seen // expand.kpool), 0)
    tail_count = jnp.where(live, seen % expand.kpool, 0) if expand.tail else n_sel * 0
    return n_sel, seen // expand.kpool * expand.kpool, tail_count


def _winner_store(pv, sel_ref, k: int, expand: Expansion, row):
    """-> store(rank [RB], pool [RB], ok [RB]): pool's KP tokens into slots rank*KP.. of row
    `row` (at position pv) for the winners ranked below n_sel."""
    kpool = expand.kpool
    j = jnp.arange(next_pow2(kpool), dtype=jnp.int32)  # [KPp] token within the pool
    n_sel, _, _ = _row_plan(pv, k, expand)

    def store(rank, pool, ok):
        slots = rank[:, None] * kpool + j[None, :]  # [RB, KPp]
        mask = (ok & (rank < n_sel))[:, None] & (j < kpool)[None, :]
        plt.store(sel_ref.at[row, slots], pool[:, None] * kpool + j[None, :], mask=mask)

    return store


def _store_tail(pv, sel_ref, k: int, expand: Expansion, row, split, splits: int,
                block: int = 256):
    """Slots from n_sel*KP on: the tail's tokens, then -1; the row's programs share them."""
    n_sel, tail_base, tail_count = _row_plan(pv, k, expand)
    start = n_sel * expand.kpool
    first, blocks = start // block, pl.cdiv(expand.width, block)
    per = (blocks - first + splits - 1) // splits
    lo = first + split * per
    lane = jnp.arange(block, dtype=jnp.int32)  # [TB]

    def fill(b, carry):
        slot = b * block + lane  # [TB]
        tj = slot - start
        val = jnp.where(tj < tail_count, tail_base + tj, -1)
        plt.store(sel_ref.at[row, slot], val, mask=(tj >= 0) & (slot < expand.width))
        return carry

    lax.fori_loop(lo, jnp.minimum(lo + per, blocks), fill, 0)


# Rows above this run one program each (a prompt: the select's work is not repeated).
SPLIT_MAX_ROWS = 1024
MAX_RANK_SPLITS = 16


def default_rank_splits(rows: int) -> int:
    """Programs per row where the tuning names none: enough for ~128 programs, at least 2 and
    at most `MAX_RANK_SPLITS` up to `SPLIT_MAX_ROWS` rows, 1 beyond. On the H200 (k 512 of
    4096, benchmarks/results/h200-selection.json): 4 rows 30.0 us at 1 split, 17.2 at 4, 15.1
    at 8, 14.1 at 16; 64 rows 31.0 at 1, 23.1 at 2, 25.2 at 4, 41.7 at 8; 256 rows (a
    padded decode of 64) 43.0 at 1, 33.3 at 2, 33.6 at 4."""
    if rows > SPLIT_MAX_ROWS:
        return 1
    return max(2, min(MAX_RANK_SPLITS, next_pow2(-(-128 // rows))))


def pool_topk_pallas(scores: jax.Array, k: int, *, interpret: bool = False,
                     tuning: PoolTopkTuning = PoolTopkTuning(), **overrides) -> jax.Array:
    """`pool_topk_xla` as a Pallas kernel: the same indices, bit for bit.

    scores [..., P] f32 (no NaN) -> [..., k] int32, best first. `overrides`: fields of
    `tuning` by name (`radix_bits=4`). `tuning.backend="triton"` runs `pool_topk_triton`.
    """
    tuning = with_overrides(tuning, overrides)
    if runs_triton(tuning, math.prod(scores.shape[:-1]), interpret):
        _no_triton_interpret(interpret)
        return pool_topk_triton(scores, k, tuning=tuning.triton)
    return _topk_call(scores, k, None, None, interpret, tuning)[0]


def runs_triton(tuning: PoolTopkTuning, rows: int, interpret: bool) -> bool:
    """Whether `tuning` runs the raw Triton kernel for `rows` rows (`PoolTopkTuning.backend`;
    in interpret mode "triton" is refused by the caller)."""
    if tuning.backend == "auto":
        return not interpret and rows >= AUTO_TRITON_MIN_ROWS
    return tuning.backend == "triton"


def _no_triton_interpret(interpret: bool) -> None:
    if interpret:
        raise ValueError("pool_topk: backend='triton' (the raw Triton kernel) has no Pallas "
                         "interpret mode; use backend='pallas' with implementation "
                         "'pallas-interpret'")


def pool_topk_expand_pallas(scores: jax.Array, k: int, pos: jax.Array, valid: jax.Array,
                            expand: Expansion, *, interpret: bool = False,
                            tuning: PoolTopkTuning = PoolTopkTuning(), **overrides
                            ) -> jax.Array:
    """`select.expand_selection` of `pool_topk_pallas` in one kernel: the token slots, bit
    for bit. scores [..., P] f32, pos and valid [...] -> [..., W] int32."""
    rows = _positions(scores, pos, valid, "pool_topk_expand")
    tuning = with_overrides(tuning, overrides)
    if tuning.backend == "triton":  # "auto" runs this file's kernel: it writes the slots
        raise ValueError(f"pool_topk_expand: backend={tuning.backend!r} writes no token slots; "
                         f"only backend='pallas' does (select.select_slots expands the other)")
    return _topk_call(scores, k, expand, rows, interpret, tuning)[1]


def _positions(scores: jax.Array, pos: jax.Array | None, valid: jax.Array | None,
               what: str, pv: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """The rows' positions as the expanding kernel reads them: `(pos [N] int32, valid [N]
    bool)`, flattened (free), `positions` of which the kernel takes itself (no pass before
    it); pos and valid must have scores' leading shape. pv: `positions(pos, valid)` computed
    by the caller (`pallas/row_meta.py`): checked for its shape, passed as `(pv,)`."""
    n = math.prod(scores.shape[:-1])
    if pv is not None:
        if pv.shape != (n,) or pv.dtype != jnp.int32:
            raise ValueError(f"{what}: pv must be int32 of shape ({n},) for scores "
                             f"{scores.shape}; got {pv.dtype} {pv.shape}")
        return (pv,)
    if (pos is None or valid is None or scores.shape[:-1] != pos.shape
            or pos.shape != valid.shape):
        raise ValueError(f"{what}: scores {scores.shape} need pos and valid of shape "
                         f"{scores.shape[:-1]}; got {getattr(pos, 'shape', None)} and "
                         f"{getattr(valid, 'shape', None)}")
    return pos.reshape(n).astype(jnp.int32), valid.reshape(n).astype(jnp.bool_)


def positions(pos: jax.Array, valid: jax.Array) -> jax.Array:
    """The expanding kernel's row positions: `pos` where `valid`, else -1 (int32, pos's
    shape)."""
    return jnp.where(valid, pos, -1).astype(jnp.int32)


def _topk_part(scores, k, expand, rows, interpret, tuning):
    """The kernel for `scores [..., P]` as a `colaunch.Part` (grid (rows, rank splits)) and
    `finish(outs) -> (pools [..., k], slots [..., W] or None)`; rows: `_positions`' (with
    `expand`)."""
    radix_bits = tuning.radix_bits
    *lead, p = scores.shape
    if not 1 <= k <= p:
        raise ValueError(f"pool_topk: k={k} must be in [1, P={p}]")
    if radix_bits not in (1, 2, 3, 4):
        raise ValueError(f"pool_topk: radix_bits={radix_bits} must be 1, 2, 3 or 4")
    n = 1
    for d in lead:
        n *= d
    chunk = min(next_pow2(tuning.chunk), next_pow2(p))
    pp = pl.cdiv(p, chunk) * chunk
    x = scores.reshape(n, p).astype(jnp.float32)
    if pp != p:  # -inf after every real index: never chosen before a real -inf (k <= P)
        x = jnp.pad(x, ((0, 0), (0, pp - p)), constant_values=-jnp.inf)
    rank_block = min(next_pow2(tuning.rank_block), next_pow2(k))
    kp = max(next_pow2(k), rank_block, 2 if tuning.rank == "sort" else 1)
    # "sample" where the row is held in registers and its block maxima number at least k
    # (else the radix select alone: the same indices)
    sampled = (tuning.select == "sample" and tuning.short_rows and pp == chunk
               and chunk // 4 >= k)
    slots = 2 * kp if sampled else kp  # the scratch: the sample's candidates, or the winners
    splits = tuning.rank_splits or (1 if tuning.rank == "sort" else default_rank_splits(n))
    splits = max(1, min(splits, pl.cdiv(k, rank_block)))
    body = functools.partial(_topk_program, k=k, chunk=chunk, chunks=pp // chunk,
                             rank_block=rank_block, radix_bits=radix_bits, splits=splits,
                             short_rows=tuning.short_rows,
                             fused_compare=tuning.fused_compare,
                             early_exit=tuning.early_exit, rank_by=tuning.rank,
                             sampled=sampled, barrier=not interpret,
                             expand=expand)
    out_shape = [jax.ShapeDtypeStruct((n, kp), jnp.int32),
                 jax.ShapeDtypeStruct((n, splits, slots), jnp.int32),  # scratch
                 jax.ShapeDtypeStruct((n, splits, slots), jnp.int32)]  # scratch
    inputs = [x]
    if expand is not None:
        out_shape.append(jax.ShapeDtypeStruct((n, expand.width), jnp.int32))
        inputs.extend(rows)
    part = Part(body, (n, splits), tuple(inputs), tuple(out_shape))

    def finish(outs):
        pools = outs[0][:, :k].reshape(*lead, k)
        return pools, (outs[3].reshape(*lead, expand.width) if expand is not None else None)

    return part, finish


def _topk_call(scores, k, expand, rows, interpret, tuning):
    """-> (pools [..., k], slots [..., W] or None)."""
    part, finish = _topk_part(scores, k, expand, rows, interpret, tuning)
    outs = pl.pallas_call(
        lambda *refs: part.body((pl.program_id(0), pl.program_id(1)), *refs),
        grid=part.grid,
        out_shape=part.out_shape,
        compiler_params=plt.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
        interpret=interpret,
        name="pool_topk",
    )(*part.inputs)
    return finish(outs)


def topk_part(scores: jax.Array, k: int, *, interpret: bool = False,
              tuning: PoolTopkTuning = PoolTopkTuning(), expand: Expansion | None = None,
              pos: jax.Array | None = None, valid: jax.Array | None = None,
              pv: jax.Array | None = None):
    """`pool_topk_pallas(scores, k)`'s kernel (with `expand`: `pool_topk_expand_pallas`'s,
    pos and valid [...] as it takes them, or pv: `positions(pos, valid)` flattened, computed
    by the caller) as a `colaunch.Part` and `finish(outs)`, which
    turns the part's outputs into that function's result (the same indices, or slots), for
    a launch shared with other kernels (`pallas/colaunch.py`). This file's kernel only (the
    raw Triton one cannot share a Pallas launch), rows of at most `chunk` pools: a row
    held in registers."""
    if tuning.backend == "triton":
        raise ValueError("topk_part: backend='triton' cannot share a Pallas launch")
    if scores.shape[-1] > tuning.chunk:
        raise ValueError(f"topk_part: rows of {scores.shape[-1]} pools; at most the chunk's "
                         f"{tuning.chunk}")
    rows = None if expand is None else _positions(scores, pos, valid, "topk_part", pv)
    part, finish = _topk_part(scores, k, expand, rows, interpret, tuning)
    return part, lambda outs: finish(outs)[0 if expand is None else 1]
