"""Top-k pool indices under the selection's total order: score descending, then index ascending.

`pool_topk_xla` is `lax.top_k` (its documented tie rule is that order). The kernel finds the
same k indices without sorting the row: a radix select of the k-th largest score on the score
bits (`RADIX_BITS` per counting pass over the row held in registers, stopping at the first
threshold with exactly k keys at or above it), a compaction of the selected pools in index
order, then a bitonic sort of the k winners in registers (`sort_winners`). XLA sorts all P
scores of a row; this counts over the row at most 16 times and orders only the k winners.

Two kernels compute it, by a fixed rule (`PoolTopkTuning.backend`, `runs_triton`): this
file's Pallas kernel (decode and verify rows, interpret mode) and the raw Triton kernel of
`pool_topk_triton` (a compiled prompt's rows). Both return `lax.top_k`'s indices.
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

from dsa_jax.pallas import tuned
from dsa_jax.pallas.colaunch import Part
from dsa_jax.pallas.common import next_pow2, with_overrides
from dsa_jax.pallas.pool_topk_triton import pool_topk_triton

_INT_MIN = -(2 ** 31)
# sortable_key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32.
_NEG_INF_KEY = -2139095041

# The kernels hold a row in registers: the layer's pallas path runs them for rows of at most
# this many pools and lax.top_k for longer ones, where each counting pass would stream the row
# from L2 and lax.top_k is faster.
KERNEL_MAX_P = 4096
BACKENDS = ("auto", "pallas", "triton")
# backend "auto" runs the raw Triton kernel for at least this many rows: a prompt chunk, whose
# step is paced by its kernels. Decode and verify steps (up to 512 sequences of max_verify 4
# rows) keep the Pallas kernel: there the Triton one's shorter kernel time came with more wall
# time around the kernels (a suspect: jax-triton's legacy custom call, which XLA may leave out
# of the step's command buffer).
AUTO_TRITON_MIN_ROWS = tuned.MANY_ROWS  # "auto" runs the raw Triton kernel from these rows
# Score bits settled per counting pass: 16 passes, each counting 4 candidate thresholds at
# once (the fastest width measured at 4 warps).
RADIX_BITS = 2
NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class PoolTopkTuning:
    """Which kernel runs `pool_topk_pallas`.

    backend: "pallas" (this file's kernel), "triton" (the raw Triton kernel of
    `pool_topk_triton`: compiled for a GPU only, needs the jax-triton package of the `gpu`
    extra; a missing package or interpret mode raises, nothing falls back), or "auto" (the
    default): "triton" when compiled for at least `AUTO_TRITON_MIN_ROWS` rows (a prompt
    chunk), else "pallas" (interpret mode, every decode and verify step; `runs_triton`,
    `tuned.DEFAULTS`). The
    same indices either way (both `==` lax.top_k). "auto" makes the `gpu` extra's jax-triton a
    requirement of a compiled prompt of 2048+ rows (`docs/decisions.md`); "pallas" runs
    without it. `pool_topk_expand_pallas` and a co-launch (`topk_part`) run this file's
    kernel only: it writes the token slots."""
    backend: str = "auto"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"PoolTopkTuning: backend={self.backend!r} must be one of "
                             f"{BACKENDS}")


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
# One program per row, the row (padded with -inf to Pp, a power of two) held in registers.
# (0) Count the finite scores; none (a padded row): the answer is pools 0..k-1 (the index
# order), written directly; fewer than k: T is -inf's key, no radix passes. (1) Radix select:
# the k-th largest key T, built digit by digit from the top (at most 32 / RADIX_BITS counting
# passes, fewer where a threshold with exactly k keys at or above it turns up first).
# (2) Compaction, in index order: every key > T, then the first k - count(> T) keys == T
# (lowest indices: the tie rule), written to scratch at their exclusive prefix-sum position.
# (3) After a barrier (the scratch is global memory written by other threads of the program),
# the k winners are loaded whole and sorted on (key descending, index ascending), and stored.
# With an `Expansion`, each winner also writes its pool's KP token ids at slots rank*KP.. (when
# rank < the row's n_sel) and the program writes the slots after them (the tail, then -1):
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


def _topk_program(ids, *refs, k: int, barrier: bool, expand: Expansion | None):
    """Program ids (row,) (the kernel's, or a co-launch's: `colaunch.Part`); whole refs:
    s_ref [N, Pp] f32; o_ref [N, Kp] int32 out; ck_ref, ci_ref [N, Kp] int32 scratch (the
    row's winners' keys and indices). With `expand`: the rows' positions, either pv_ref [N]
    int32 (each row's position, -1 for a padded row) or pos_ref [N] int32 and valid_ref [N]
    bool (`positions` of them, read here: no pass before the kernel), and sel_ref [N, W]
    int32 out (masked stores)."""
    if expand is None:
        s_ref, o_ref, ck_ref, ci_ref = refs
    else:
        s_ref, *row_refs, o_ref, ck_ref, ci_ref, sel_ref = refs
    (row,) = ids
    kp = o_ref.shape[1]
    keys = sortable_key(s_ref[row])  # [Pp], loaded once
    lane = jnp.arange(keys.shape[0], dtype=jnp.int32)  # [Pp] pool index
    pv = _row_position(row_refs, row) if expand else None
    store_winners = _winner_store(pv, sel_ref, k, expand, row) if expand else None

    def count(pred):  # pred: [Pp] keys -> [..., Pp] bool -> [...] counts
        return jnp.sum(pred(keys).astype(jnp.int32), axis=-1)

    # Radix select, RADIX_BITS bits per pass: the candidates prefix | (d << shift) for every
    # digit d are counted at once; the largest d still leaving >= k keys extends the prefix.
    def settle(prefix, shift):
        # prefix/cand are bits in the unsigned order u = key ^ INT_MIN; thresholds and the max
        # are taken in signed keys, where that order holds. Digit 0 (cand = prefix) always
        # leaves >= k keys. -> (the new prefix, whether exactly k keys are >= it).
        digits = jnp.arange(1 << RADIX_BITS, dtype=jnp.int32)  # [D]
        cand = prefix | jnp.left_shift(digits, shift)  # [D]
        thr = cand ^ jnp.int32(_INT_MIN)  # [D] ascending (signed), so counts descend
        counts = count(lambda key: key[None, :] >= thr[:, None])  # [D]
        ok = counts >= k
        best = jnp.max(jnp.where(ok, thr, jnp.int32(_INT_MIN)))  # [] signed
        at_best = jnp.min(jnp.where(ok, counts, jnp.int32(2 ** 31 - 1)))  # [] its count
        return best ^ jnp.int32(_INT_MIN), (at_best == k) & (best != jnp.int32(_INT_MIN))

    def radix_select():
        """The k-th largest key T; or, where a pass finds a threshold t with exactly k keys
        >= t (distinct scores: after about log2(P) of the 32 bits), t - 1, and no further
        pass: the keys > t - 1 are then the k winners, as the keys >= T would be, so the
        compaction below selects the same pools with no tie to break."""
        def more(carry):
            i, _, exact = carry
            return (i < 32 // RADIX_BITS) & ~exact

        def radix_pass(carry):
            i, prefix, _ = carry
            prefix, exact = settle(prefix, 32 - RADIX_BITS - i * RADIX_BITS)
            return i + 1, prefix, exact

        _, prefix, exact = lax.while_loop(more, radix_pass,
                                          (jnp.int32(0), jnp.int32(0), jnp.bool_(False)))
        kth = prefix ^ jnp.int32(_INT_MIN)
        return jnp.where(exact, kth - 1, kth)

    def store_sorted(pools):
        """pools [Kp] best first: the first k stored (and their slots written)."""
        at = jnp.arange(kp, dtype=jnp.int32)  # [Kp] rank
        plt.store(o_ref.at[row, at], pools, mask=at < k)
        if store_winners is not None:
            store_winners(at, pools, at < k)

    def select_and_sort(kth):
        need_eq = k - count(lambda key: key > kth)  # ties at the k-th key to take (0 after
        # an early exit of the radix select)
        eq = (keys == kth).astype(jnp.int32)
        eq_before = jnp.cumsum(eq) - eq
        sel = ((keys > kth) | ((eq == 1) & (eq_before < need_eq))).astype(jnp.int32)
        pos = jnp.cumsum(sel) - sel  # [Pp] each winner's slot, in index order
        plt.store(ci_ref.at[row, pos], lane, mask=sel == 1)
        plt.store(ck_ref.at[row, pos], keys, mask=sel == 1)
        if barrier:  # interpret mode runs one thread and has no barrier primitive
            plt.debug_barrier()
        at = jnp.arange(kp, dtype=jnp.int32)  # [Kp] compacted position (= index order)
        win_keys = jnp.where(at < k, ck_ref[row], jnp.int32(_INT_MIN))  # [Kp]
        win_pools = jnp.where(at < k, ci_ref[row], jnp.int32(2 ** 31 - 1))  # [Kp]
        store_sorted(sort_winners(win_keys, win_pools)[1])

    if expand is not None:
        _store_tail(pv, sel_ref, k, expand, row)
    n_finite = count(lambda key: key > jnp.int32(_NEG_INF_KEY))

    @pl.when(n_finite == 0)
    def _():  # every score -inf: the order is the index order
        store_sorted(jnp.arange(kp, dtype=jnp.int32))

    @pl.when(n_finite > 0)
    def _():
        # Fewer finite scores than k: the k-th largest key is -inf's. (Computed from a value:
        # the Triton lowering cannot yield a literal from a branch.)
        neg_inf_key = n_finite - n_finite + jnp.int32(_NEG_INF_KEY)
        select_and_sort(lax.cond(n_finite < k, lambda: neg_inf_key, radix_select))


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


def _store_tail(pv, sel_ref, k: int, expand: Expansion, row, block: int = 256):
    """Slots from n_sel*KP on: the tail's tokens, then -1."""
    n_sel, tail_base, tail_count = _row_plan(pv, k, expand)
    start = n_sel * expand.kpool
    lane = jnp.arange(block, dtype=jnp.int32)  # [TB]

    def fill(b, carry):
        slot = b * block + lane  # [TB]
        tj = slot - start
        val = jnp.where(tj < tail_count, tail_base + tj, -1)
        plt.store(sel_ref.at[row, slot], val, mask=(tj >= 0) & (slot < expand.width))
        return carry

    lax.fori_loop(start // block, pl.cdiv(expand.width, block), fill, 0)


def pool_topk_pallas(scores: jax.Array, k: int, *, interpret: bool = False,
                     tuning: PoolTopkTuning = PoolTopkTuning(), **overrides) -> jax.Array:
    """`pool_topk_xla` as a kernel: the same indices, bit for bit.

    scores [..., P] f32 (no NaN), P <= KERNEL_MAX_P -> [..., k] int32, best first.
    `overrides`: fields of `tuning` by name (`backend="pallas"`); the backend that runs:
    `runs_triton`."""
    tuning = with_overrides(tuning, overrides)
    if runs_triton(tuning, math.prod(scores.shape[:-1]), interpret):
        _no_triton_interpret(interpret)
        return pool_topk_triton(scores, k)
    return _topk_call(scores, k, None, None, interpret)[0]


def runs_triton(tuning: PoolTopkTuning, rows: int, interpret: bool) -> bool:
    """Whether `tuning` runs the raw Triton kernel for `rows` rows (`PoolTopkTuning.backend`;
    in interpret mode "triton" is refused by the caller)."""
    if tuning.backend == "auto":
        return tuned.backends(interpret, rows).topk == "triton"
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
    return _topk_call(scores, k, expand, rows, interpret)[1]


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


def _topk_part(scores, k, expand, rows, interpret):
    """The kernel for `scores [..., P]` as a `colaunch.Part` (one program per row) and
    `finish(outs) -> (pools [..., k], slots [..., W] or None)`; rows: `_positions`' (with
    `expand`)."""
    *lead, p = scores.shape
    if not 1 <= k <= p:
        raise ValueError(f"pool_topk: k={k} must be in [1, P={p}]")
    if p > KERNEL_MAX_P:
        raise ValueError(f"pool_topk: rows of P={p} pools exceed the kernel's KERNEL_MAX_P="
                         f"{KERNEL_MAX_P} (the row is held in registers); use pool_topk_xla")
    n = math.prod(lead)
    pp = next_pow2(p)
    x = scores.reshape(n, p).astype(jnp.float32)
    if pp != p:  # -inf after every real index: never chosen before a real -inf (k <= P)
        x = jnp.pad(x, ((0, 0), (0, pp - p)), constant_values=-jnp.inf)
    kp = max(next_pow2(k), 2)  # the sort's lanes
    body = functools.partial(_topk_program, k=k, barrier=not interpret, expand=expand)
    out_shape = [jax.ShapeDtypeStruct((n, kp), jnp.int32),
                 jax.ShapeDtypeStruct((n, kp), jnp.int32),  # scratch: the winners' keys
                 jax.ShapeDtypeStruct((n, kp), jnp.int32)]  # scratch: their indices
    inputs = [x]
    if expand is not None:
        out_shape.append(jax.ShapeDtypeStruct((n, expand.width), jnp.int32))
        inputs.extend(rows)
    part = Part(body, (n,), tuple(inputs), tuple(out_shape))

    def finish(outs):
        pools = outs[0][:, :k].reshape(*lead, k)
        return pools, (outs[3].reshape(*lead, expand.width) if expand is not None else None)

    return part, finish


def _topk_call(scores, k, expand, rows, interpret):
    """-> (pools [..., k], slots [..., W] or None)."""
    part, finish = _topk_part(scores, k, expand, rows, interpret)
    outs = pl.pallas_call(
        lambda *refs: part.body((pl.program_id(0),), *refs),
        grid=part.grid,
        out_shape=part.out_shape,
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
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
    by the caller) as a `colaunch.Part` and `finish(outs)`, which turns the part's outputs
    into that function's result (the same indices, or slots), for a launch shared with other
    kernels (`pallas/colaunch.py`). This file's kernel only: the raw Triton one cannot share
    a Pallas launch."""
    if tuning.backend == "triton":
        raise ValueError("topk_part: backend='triton' cannot share a Pallas launch")
    rows = None if expand is None else _positions(scores, pos, valid, "topk_part", pv)
    part, finish = _topk_part(scores, k, expand, rows, interpret)
    return part, lambda outs: finish(outs)[0 if expand is None else 1]
