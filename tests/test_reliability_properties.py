"""Property tests: random small configs and random operation sequences against the fp32
reference (`dsa_jax.reference`) and SPEC.md's invariants, with NaN / Inf injected into some
sequences, whose garbage must never be visible in another sequence's output.

Operations: prefill chunks (ragged counts), decode, decode_k (checked bit for bit against as
many serial decodes), a rejected speculation (decode_k, then rewind to a random accepted
prefix), write_kv_row (a drafter's context row), every one with random active sequences.
Every clean sequence's every output row is compared with the reference run on that
sequence's own history; the whole sequence is then replayed with the poisoned values replaced
by clean ones, and every clean sequence's outputs must be the same bits.

CI-sized by default (a few examples, derandomized); `pytest --long` runs many more.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import dsa_jax
from dsa_jax import reference
from dsa_jax.config import DsaConfig
from dsa_jax.state import ring_mark_after
from dsa_jax.testing import copy_tree, random_hf_numpy

# fp32 everywhere; the reductions here are a few tens of terms (tests/test_paged_vs_reference.py
# derives 2e-5 for a few hundred).
FP32_RTOL = 2e-5
# Pool scores closer than this (relative to the row's largest) are a tie whose order fp32
# rounding may decide differently in the reference and the paged path.
TIE_RTOL = 1e-5
_REF = jax.jit(reference.forward, static_argnums=(0,))


def _settings(long_run: bool):
    """CI: 3 derandomized examples, no shrinking (a failure reports its example at once);
    --long: 40 random examples, shrunk."""
    phases = list(Phase) if long_run else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=40 if long_run else 3, derandomize=not long_run,
                    deadline=None, database=None, print_blob=True, phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def configs(draw) -> DsaConfig:
    """Small configs; draws shrink towards the richest case (tail on, several pools per
    selection, selections wider than the context so far: empty slots in most rows)."""
    kp = draw(st.sampled_from([4, 3, 2, 1]))
    bs = draw(st.sampled_from([4, 3, 8, 2]))
    unit = math.lcm(kp, bs)
    max_context = unit * draw(st.integers(max(1, -(-16 // unit)), max(1, 36 // unit)))
    return DsaConfig(
        hidden_size=draw(st.integers(6, 20)), num_heads=draw(st.integers(1, 3)),
        q_lora_rank=draw(st.integers(3, 10)), kv_lora_rank=draw(st.integers(3, 10)),
        qk_nope_head_dim=draw(st.integers(2, 6)), v_head_dim=draw(st.integers(2, 6)),
        index_n_heads=draw(st.integers(1, 3)), index_head_dim=draw(st.integers(2, 6)),
        index_topk=kp * (3 - draw(st.integers(0, 2))), index_kpool=kp,
        always_select_tail=not draw(st.booleans()), max_context=max_context, block_size=bs,
        max_verify=4 - draw(st.integers(0, 3)), cache_dtype="float32",
        index_cache_dtype="float32", param_dtype="float32", implementation="xla")


def draw_plan(data, cfg: DsaConfig, b: int, poisoned: set[int], rng) -> list[dict]:
    """Random operations that fit the capacity; each with its rows x and, for the poisoned
    sequences, where NaN / Inf goes (into every real row). Draws shrink towards the busy case
    (every sequence active, full counts), so even hypothesis's first examples do a lot."""
    lengths = np.zeros(b, np.int64)
    plan = []
    kinds = ["prefill"] + data.draw(st.lists(st.sampled_from(
        ["reject", "verify", "decode", "kv", "prefill"]), min_size=3, max_size=6), label="ops")
    for kind in kinds:
        room = cfg.max_context - lengths
        if kind == "prefill":
            rows = data.draw(st.sampled_from([5, 2]), label="S")
        elif kind in ("verify", "reject"):
            rows = cfg.max_verify - data.draw(st.integers(0, cfg.max_verify - 1), label="K")
        else:
            rows = 1
        if kind == "prefill":
            counts = np.asarray([min(rows, r) - data.draw(st.integers(0, int(min(rows, r))),
                                                          label="short") for r in room])
        else:
            counts = np.asarray([0 if r < rows or data.draw(st.booleans(), label="idle")
                                 else rows for r in room])
        keep = counts.copy()
        if kind == "reject":
            keep = np.asarray([data.draw(st.integers(0, int(n)), label="keep") for n in counts])
        x = rng.standard_normal((b, rows, cfg.hidden_size)).astype(np.float32)
        poison = []  # every real row of a poisoned sequence: garbage wherever it is stored
        for s in sorted(poisoned):
            column = data.draw(st.integers(0, cfg.hidden_size - 1), label="column")
            value = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="garbage")
            poison += [(s, r, column, value) for r in range(counts[s])]
        plan.append(dict(kind=kind, x=x, counts=counts, keep=keep, poison=poison))
        lengths += keep
    return plan


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes()


def execute(cfg, weights, plan, b: int, poison: bool, tables: np.ndarray):
    """Run the plan; check lengths, padding rows and verify == serial decodes on the way.
    Returns per operation (y [B, R, D] or None, sel [B, R, W] or None, rows' x, counts)."""
    state = dsa_jax.init_state(cfg, b, num_blocks=int(tables.max()) + 1, block_tables=tables)
    lengths = np.zeros(b, np.int64)
    marks = np.zeros(b, np.int64)  # the indexer ring's mark (dsa_jax.state)
    out = []
    for op in plan:
        x = op["x"].copy()
        if poison:
            for s, r, c, v in op["poison"]:
                x[s, r, c] = v
        xj, counts = jnp.asarray(x), op["counts"]
        active = counts > 0
        y = sel = None
        if op["kind"] == "prefill":
            y, state, sel = dsa_jax.prefill(cfg, weights, state, xj, num_tokens=counts)
        elif op["kind"] == "decode":
            y, state, sel = dsa_jax.decode(cfg, weights, state, xj[:, 0], active=active)
            y, sel = y[:, None], sel[:, None]
        elif op["kind"] == "kv":
            state = dsa_jax.write_kv_row(cfg, weights, state, xj[:, 0], active=active)
        else:
            serial = copy_tree(state)
            y, state, sel = dsa_jax.decode_k(cfg, weights, state, xj, active=active)
            for r in range(x.shape[1]):  # K serial decodes give the very same bits
                ys, serial, ss = dsa_jax.decode(cfg, weights, serial, xj[:, r], active=active)
                assert _bits(ys) == _bits(y[:, r]) and _bits(ss) == _bits(sel[:, r]), r
            if op["kind"] == "reject":
                state = dsa_jax.rewind(cfg, state, lengths + op["keep"])
        # Every operation writes `counts` rows; a rewind keeps the ring's mark where they end.
        marks = ring_mark_after(cfg, lengths, marks, counts)
        lengths = lengths + op["keep"]
        assert np.asarray(state.lengths).tolist() == lengths.tolist()
        assert np.asarray(state.index_lengths).tolist() == marks.tolist()
        if y is not None:
            y, sel = np.asarray(y), np.asarray(sel)
            for s in range(b):  # padding rows: never written, never selected, output 0
                assert (y[s, counts[s]:] == 0).all() and (sel[s, counts[s]:] == -1).all()
        out.append((y, sel, x, counts, op["keep"]))
    return out


def _check_selection_row(cfg, row: np.ndarray, t: int) -> None:
    """SPEC.md's slot layout: real ids first, -1 after; distinct; at or before t; count."""
    real = row[row >= 0]
    assert (row[:len(real)] >= 0).all() and (row[len(real):] == -1).all()
    assert len(set(real.tolist())) == len(real) and (real <= t).all()
    n_sel = min(cfg.select_k, (t + 1) // cfg.index_kpool)
    tail = (t + 1) % cfg.index_kpool if cfg.always_select_tail else 0
    assert len(real) == n_sel * cfg.index_kpool + tail


def _tie(scores: np.ndarray, got: np.ndarray, want: np.ndarray, kp: int) -> bool:
    """The two selections differ only in pools whose reference scores tie within TIE_RTOL:
    other pools, or the same pools in another order (best first: near-tied pools may swap)."""
    a = {int(v) // kp for v in got[got >= 0]}
    b = {int(v) // kp for v in want[want >= 0]}
    diff = sorted(a ^ b)
    scale = max(float(np.max(np.abs(scores[np.isfinite(scores)]))), 1e-30)
    if not diff:
        if ((got < 0) != (want < 0)).any():
            return False
        swapped = [(int(g) // kp, int(w) // kp) for g, w in zip(got, want, strict=True)
                   if g != w]
        return len(swapped) > 0 and all(
            abs(float(scores[p]) - float(scores[q])) <= TIE_RTOL * scale for p, q in swapped)
    if not np.isfinite(scores[diff]).all():
        return False
    kth = min(float(scores[p]) for p in b) if b else 0.0
    return all(abs(float(scores[p]) - kth) <= TIE_RTOL * scale for p in diff)


def check_against_reference(cfg, hf, results, b: int, poisoned: set[int]) -> int:
    """Every clean sequence's output rows vs the reference on its own history. Returns the
    number of rows compared."""
    history = [np.zeros((0, cfg.hidden_size), np.float32) for _ in range(b)]
    compared = 0
    for y, sel, x, counts, keep in results:
        for s in range(b):
            new = x[s, :counts[s]]
            if y is not None and counts[s] and s not in poisoned:
                rows = np.concatenate([history[s], new])
                padded = np.zeros((cfg.max_context, cfg.hidden_size), np.float32)
                padded[:len(rows)] = rows
                ref = _REF(cfg, hf, jnp.asarray(padded))
                ref_y, ref_sel = np.asarray(ref.y), np.asarray(ref.sel)
                scores = np.asarray(ref.pool_scores)
                for r in range(counts[s]):
                    t = len(history[s]) + r
                    _check_selection_row(cfg, sel[s, r], t)
                    if not np.array_equal(sel[s, r], ref_sel[t]):
                        assert _tie(scores[t], sel[s, r], ref_sel[t], cfg.index_kpool), (
                            t, sel[s, r], ref_sel[t], scores[t])
                        continue
                    err = np.linalg.norm(y[s, r] - ref_y[t])
                    assert err <= FP32_RTOL * np.linalg.norm(ref_y[t]), (s, t, err)
                    compared += 1
            history[s] = np.concatenate([history[s], new[:keep[s]]])
    return compared


def test_random_operation_sequences_match_the_reference_and_never_leak(pytestconfig):
    long_run = pytestconfig.getoption("--long")

    @_settings(long_run)
    @given(cfg=configs(), data=st.data())
    def run(cfg, data):
        b = 3 - data.draw(st.integers(0, 1), label="fewer sequences")
        clean = {b - 1 - i for i in data.draw(st.lists(
            st.integers(0, b - 1), min_size=1, max_size=b, unique=True), label="clean")}
        poisoned = set(range(b)) - clean
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
        hf = random_hf_numpy(cfg, rng)
        weights = dsa_jax.fold_weights(cfg, hf)
        # An allocator's tables: blocks in allocation order (the engine's free list hands
        # out low blocks first) or shuffled, from a pool with spare blocks.
        pool = b * cfg.blocks_per_seq + int(rng.integers(0, 3))
        order = rng.permutation(pool) if data.draw(st.booleans(), label="shuffled") else \
            np.arange(pool)
        tables = order[:b * cfg.blocks_per_seq].reshape(b, -1).astype(np.int32)
        plan = draw_plan(data, cfg, b, poisoned, rng)
        dirty = execute(cfg, weights, plan, b, True, tables)
        check_against_reference(cfg, hf, dirty, b, poisoned)
        if any(op["poison"] for op in plan):
            clean = execute(cfg, weights, plan, b, False, tables)
            for (yd, sd, *_), (yc, sc, *_) in zip(dirty, clean, strict=True):
                for s in set(range(b)) - poisoned:
                    if yd is not None:
                        assert _bits(yd[s]) == _bits(yc[s]) and _bits(sd[s]) == _bits(sc[s])

    run()


def test_a_poisoned_sequence_is_really_poisoned():
    """The property above can fail: a NaN in a sequence reaches that sequence's own later
    outputs (so a leak into another sequence would be seen the same way)."""
    from dsa_jax.shapes import ODD

    weights = dsa_jax.init_random_weights(ODD, jax.random.key(0))
    x = np.array(jax.random.normal(jax.random.key(1), (2, 6, ODD.hidden_size)))
    x[0, 0, 3] = np.nan
    y, state, _ = dsa_jax.prefill(ODD, weights, dsa_jax.init_state(ODD, 2), jnp.asarray(x))
    assert np.isnan(np.asarray(y[0, 0])).all() and np.isfinite(np.asarray(y[1])).all()
