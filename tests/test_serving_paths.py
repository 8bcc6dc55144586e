"""The serving paths: K-row verify, chunked prefill, ragged decode, rewind, drafter rows,
compile-once decode, and their errors.

Under `pytest -m gpu` (the H200 correctness run) decode_k == serial decodes is also checked
bit for bit at GLM-5.3-Flash per-rank shapes (TP 8 and TP 1), bf16 weights and an fp8 cache,
for "xla" and the compiled "pallas" kernels.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import StepError, layer
from dsa_jax.shapes import ODD, glm53_flash
from dsa_jax.testing import assert_trees_bitwise_equal, copy_tree, random_rows, random_state

CACHE_DTYPES = ["float32", "bfloat16", "float8_e4m3fn"]
# Trace events jax records (`jax.monitoring`), with the traced function's name.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


def _weights(cfg, seed=0):
    return dsa_jax.init_random_weights(cfg, jax.random.key(seed))


def _decode_k_equals_serial_decodes(cfg, weights, base, rows):
    """One decode_k of `rows [B, K, D]` from `base` == K decodes, bit for bit: outputs,
    selections and every leaf of the final state."""
    y_k, state_k, sel_k = dsa_jax.decode_k(cfg, weights, copy_tree(base), rows)
    state = copy_tree(base)
    for r in range(rows.shape[1]):
        y, state, sel = dsa_jax.decode(cfg, weights, state, rows[:, r])
        assert_trees_bitwise_equal((y_k[:, r], sel_k[:, r]), (y, sel))
    assert_trees_bitwise_equal(state_k, state)


@pytest.mark.parametrize("cache_dtype", [pytest.param(d, marks=pytest.mark.long)
                                         for d in CACHE_DTYPES[:2]] + CACHE_DTYPES[2:])
def test_decode_k_is_bit_identical_to_serial_decodes(cache_dtype):
    cfg = ODD.replace(cache_dtype=cache_dtype, index_cache_dtype="bfloat16")
    weights = _weights(cfg)
    # Prompt lengths straddle pool boundaries (KP = 4): 13 -> rows 13..16 cross 15|16.
    for prompt in (13, 14, 15, 16):
        base = random_state(cfg, weights, 2, prompt, prompt, kv_scale=0.1)
        for k in (1, 2, 3, 4):
            _decode_k_equals_serial_decodes(cfg, weights, base,
                                            random_rows(100 + k, 2, k, cfg.hidden_size))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("tp", [8, 1])
def test_decode_k_is_bit_identical_at_glm53_flash_per_rank_shapes(impl, tp):
    """One rank at TP 8 (8 heads: the Triton attend kernel) and TP 1 (64 heads: the Mosaic GPU
    one, fp8), bf16 weights, fp8 latents, a 1533-token prompt (rows 1533..1536 cross a pool
    boundary, KP = 4), K = 1..4."""
    cfg = glm53_flash(max_context=4096, tp_degree=tp, implementation=impl)
    weights = _weights(cfg)
    base = random_state(cfg, weights, 2, 1533, 1, kv_scale=1 / 64, dtype=jnp.bfloat16)
    for k in (1, 2, 3, 4):
        _decode_k_equals_serial_decodes(
            cfg, weights, base, random_rows(10 + k, 2, k, cfg.hidden_size, dtype=jnp.bfloat16))


@pytest.mark.long
def test_a_decode_runs_its_own_row_under_row_invariant_gemms_and_equals_decode_k():
    """`gemm="pallas"`: the GEMMs give a row the same bits at any row count, so a decode runs
    1 row per sequence (not max_verify) and K serial decodes still equal one K-row verify, bit
    for bit (the kernels in interpret mode; prompts straddle a pool boundary). Its outputs are
    XLA's GEMMs' within fp32 accumulation differences, its selections the same."""
    cfg = ODD.replace(implementation="pallas-interpret", gemm="pallas", param_dtype="bfloat16",
                      cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16")
    assert layer.decode_rows(cfg, "decode") == 1 and layer.decode_rows(cfg, "verify") == 4
    assert layer.decode_rows(cfg.replace(gemm="xla"), "decode") == 4
    weights = _weights(cfg, 4)
    for prompt in (13, 16):
        base = random_state(cfg, weights, 2, prompt, prompt, kv_scale=0.1)
        for k in (1, 3):
            _decode_k_equals_serial_decodes(cfg, weights, base,
                                            random_rows(100 + k, 2, k, cfg.hidden_size))
    x = random_rows(7, 2, 1, cfg.hidden_size)[:, 0]
    y, _, sel = dsa_jax.decode(cfg, weights, copy_tree(base), x)
    y_x, _, sel_x = dsa_jax.decode(cfg.replace(gemm="xla"), weights, copy_tree(base), x)
    assert_trees_bitwise_equal(sel, sel_x)
    chex.assert_trees_all_close(y, y_x, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 1])
def test_decode_k_is_bit_identical_with_row_invariant_gemms_at_glm53_flash_shapes(tp):
    """As the test above at one rank's GLM-5.3-Flash shapes, compiled: 20 sequences, so the
    decode's 20-row GEMMs (64-row tiles) meet the verify's 80-row ones (128-row tiles)."""
    cfg = glm53_flash(max_context=4096, tp_degree=tp, implementation="pallas", gemm="pallas")
    assert layer.decode_rows(cfg, "decode") == 1
    weights = _weights(cfg)
    base = random_state(cfg, weights, 20, 1533, 1, kv_scale=1 / 64, dtype=jnp.bfloat16)
    for k in (1, 2, 4):
        _decode_k_equals_serial_decodes(
            cfg, weights, base, random_rows(10 + k, 20, k, cfg.hidden_size, dtype=jnp.bfloat16))


@pytest.mark.gpu
def test_decode_k_bits_hold_after_another_configs_programs():
    """The order in which a 4-row verify at TP 1 differed from its serial decodes in y's last
    bits on the H200: a TP 8 model's decode_k and decodes first, then TP 1's, in one process
    (2026-12-01: 4 of 5 runs of TP 8 then TP 1 in one process over that session's variants,
    the code before it among them; TP 1 alone 3 of 3 equal; the test above, parametrized,
    passed or failed with what had run before it)."""
    for tp in (8, 1):
        cfg = glm53_flash(max_context=4096, tp_degree=tp, implementation="pallas")
        weights = _weights(cfg)
        base = random_state(cfg, weights, 2, 1533, 1, kv_scale=1 / 64, dtype=jnp.bfloat16)
        for k in (1, 2, 3, 4):
            _decode_k_equals_serial_decodes(
                cfg, weights, base, random_rows(10 + k, 2, k, cfg.hidden_size,
                                                dtype=jnp.bfloat16))


@pytest.mark.parametrize("index_dtype", ["float32", "bfloat16"])
def test_chunked_prefill_equals_one_prefill_and_per_row_selection(index_dtype):
    """A chunk's rows read the pools completed earlier in the same program; later chunks and
    decodes read them from the stored state. With a bf16 index cache the stored keys are
    rounded: a step must score with those, not with the fp32 sums it just rounded (XLA may
    drop an f32 -> bf16 -> f32 round trip inside one program)."""
    cfg = ODD.replace(index_cache_dtype=index_dtype)
    weights = _weights(cfg, 1)
    x = random_rows(2, 2, 61, cfg.hidden_size)
    y_one, state_one, sel_one = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2), x)
    state = dsa_jax.init_state(cfg, 2)
    ys, sels = [], []
    for lo, hi in ((0, 9), (9, 30), (30, 31), (31, 61)):
        y, state, sel = dsa_jax.prefill(cfg, weights, state, x[:, lo:hi])
        ys.append(y)
        sels.append(sel)
    # Batched selection of a chunk: the same sets in the same slots as one row at a time.
    assert_trees_bitwise_equal(jnp.concatenate(sels, 1), sel_one)
    chex.assert_trees_all_close(jnp.concatenate(ys, 1), y_one, rtol=1e-5, atol=1e-5)
    per_row = dsa_jax.init_state(cfg, 2)
    for t in range(61):
        _, per_row, sel_t = dsa_jax.decode(cfg, weights, per_row, x[:, t])
        assert_trees_bitwise_equal(sel_t, sel_one[:, t])
    assert_trees_bitwise_equal(state.lengths, state_one.lengths)


def test_ragged_prefill_and_decode_equal_each_sequence_alone():
    cfg = ODD
    weights = _weights(cfg, 3)
    lens = [7, 30, 19]
    x = random_rows(4, 3, 40, cfg.hidden_size)
    state = dsa_jax.init_state(cfg, 3)
    _, state, _ = dsa_jax.prefill(cfg, weights, state, x[:, :30], num_tokens=lens)
    assert np.asarray(state.lengths).tolist() == lens
    active = np.array([True, False, True])
    y, state, sel = dsa_jax.decode(cfg, weights, state, x[:, 35], active=active)
    assert np.asarray(state.lengths).tolist() == [8, 30, 20]
    assert (np.asarray(sel[1]) == -1).all() and (np.asarray(y[1]) == 0).all()
    for s in (0, 2):
        alone = dsa_jax.init_state(cfg, 1)
        _, alone, _ = dsa_jax.prefill(cfg, weights, alone, x[s:s + 1, :lens[s]])
        y_s, _, sel_s = dsa_jax.decode(cfg, weights, alone, x[s:s + 1, 35])
        assert_trees_bitwise_equal(sel[s], sel_s[0])  # no padding token enters the selection
        chex.assert_trees_all_close(y[s], y_s[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", ["float32", "float8_e4m3fn"])
def test_speculate_reject_rewind_continue_equals_never_speculating(cache_dtype):
    cfg = ODD.replace(cache_dtype=cache_dtype)
    weights = _weights(cfg, 5)
    x = random_rows(6, 2, 40, cfg.hidden_size)
    drafts = random_rows(7, 2, 3, cfg.hidden_size)
    _, base, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2, kv_scale=0.1),
                                 x[:, :14])
    plain = copy_tree(base)
    plain_y = []
    for t in range(14, 20):
        y, plain, _ = dsa_jax.decode(cfg, weights, plain, x[:, t])
        plain_y.append(y)
    # Verify [x14, wrong, wrong, wrong] (crossing the 15|16 pool boundary): only the first row
    # is accepted, the rest rewound, then decoding continues.
    rows = jnp.concatenate([x[:, 14:15], drafts], axis=1)
    y_k, spec, _ = dsa_jax.decode_k(cfg, weights, base, rows)
    assert_trees_bitwise_equal(y_k[:, 0], plain_y[0])
    spec = dsa_jax.rewind(cfg, spec, [15, 15])
    spec_y = [y_k[:, 0]]
    for t in range(15, 20):
        y, spec, _ = dsa_jax.decode(cfg, weights, spec, x[:, t])
        spec_y.append(y)
    for a, c in zip(spec_y, plain_y, strict=True):
        assert_trees_bitwise_equal(a, c)


def test_indexer_ahead_heals_and_write_kv_row_matches_decode_caches():
    cfg = ODD
    weights = _weights(cfg, 8)
    x = random_rows(9, 1, 30, cfg.hidden_size)
    _, state, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 1), x[:, :20])
    # Only the sequence length rewound (as a scheduler that owns lengths would): heals.
    ahead = state._replace(lengths=state.lengths - 3)
    y, healed, _ = dsa_jax.decode(cfg, weights, ahead, x[:, 17])
    # The indexer ring keeps its mark at 20: rows 18 and 19 still hold the rejected values,
    # which a later rewind must not take for the sequence's own (dsa_jax.state, the ring).
    assert np.asarray(healed.lengths).tolist() == [18]
    assert np.asarray(healed.index_lengths).tolist() == [20]
    _, ref, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 1), x[:, :17])
    y_ref, ref, _ = dsa_jax.decode(cfg, weights, ref, x[:, 17])
    chex.assert_trees_all_close(y, y_ref, rtol=1e-5, atol=1e-6)

    drafted = dsa_jax.write_kv_row(cfg, weights, copy_tree(ref), x[:, 18])
    _, decoded, _ = dsa_jax.decode(cfg, weights, copy_tree(ref), x[:, 18])
    assert np.asarray(drafted.lengths).tolist() == [19]
    names = ("latent", "index_k", "index_g", "pool_keys")
    chex.assert_trees_all_close({n: getattr(drafted, n) for n in names},
                                {n: getattr(decoded, n) for n in names}, rtol=1e-5, atol=1e-6)


def test_decode_compiles_once_across_context_lengths():
    """One trace serves every context length: lengths are data, shapes are the config's
    ceiling. Checked on `decode` / `decode_k` themselves (jax's trace events: nothing is
    traced again after the first call of each), and on the public step jitted as a server
    would run it, decodes and a verify through one trace (`chex.assert_max_traces`)."""
    cfg = ODD.replace(max_verify=3)  # a config no other test compiles
    weights = _weights(cfg, 10)
    xs = [random_rows(t, 2, cfg.hidden_size) for t in range(40)]
    verify = [random_rows(99 + i, 2, 3, cfg.hidden_size) for i in range(2)]
    state = dsa_jax.init_state(cfg, 2)
    traces = []

    def listener(event, duration, **kw):
        if event == TRACE_EVENT:
            traces.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        # Lengths 0..39, through tails, pool boundaries and the top-k cap; then two verifies.
        _, state, _ = dsa_jax.decode(cfg, weights, state, xs[0])
        first = len(traces)
        assert first, "the first decode of a new config traced nothing: no events heard"
        for x in xs[1:]:
            _, state, _ = dsa_jax.decode(cfg, weights, state, x)
        assert traces[first:] == [], traces[first:]
        _, state, _ = dsa_jax.decode_k(cfg, weights, state, verify[0])
        first = len(traces)
        _, state, _ = dsa_jax.decode_k(cfg, weights, state, verify[1])
        assert traces[first:] == [], traces[first:]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert np.asarray(state.lengths).tolist() == [46, 46]

    served = jax.jit(chex.assert_max_traces(layer.step, n=1), static_argnames=("cfg",),
                     donate_argnames=("state",))
    state = dsa_jax.init_state(cfg, 2)
    for kind, x in [("decode", x) for x in xs] + [("verify", x) for x in verify]:
        layout, n_new = layer.prepare_step(cfg, weights, state, x, kind=kind)
        rows, _ = layout.pad(x, None)
        _, state, _ = served(cfg, weights, state, rows, jnp.asarray(n_new))
    assert np.asarray(state.lengths).tolist() == [46, 46]


def test_state_is_donated_not_copied():
    cfg = ODD
    weights = _weights(cfg, 11)
    state = dsa_jax.init_state(cfg, 1)
    _, new, _ = dsa_jax.decode(cfg, weights, state, random_rows(1, 1, cfg.hidden_size))
    if jax.default_backend() == "cpu" and not state.latent.is_deleted():
        pytest.skip("this backend does not implement donation")
    assert state.latent.is_deleted() and not new.latent.is_deleted()


def test_serving_errors_name_value_and_limit_and_leave_state_usable():
    cfg = ODD
    weights = _weights(cfg, 12)
    _, state, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2),
                                  random_rows(1, 2, 10, cfg.hidden_size))
    with pytest.raises(StepError, match=r"a 5-row verify does not fit max_verify 4"):
        dsa_jax.decode_k(cfg, weights, state, random_rows(2, 2, 5, cfg.hidden_size))
    with pytest.raises(StepError, match=r"cannot rewind to length 11; it must be in \[0, 10\]"):
        dsa_jax.rewind(cfg, state, [9, 11])
    with pytest.raises(StepError, match=r"row counts \[3, 40\] must be 2 values in \[0, 5\]"):
        dsa_jax.prefill(cfg, weights, state, random_rows(3, 2, 5, cfg.hidden_size),
                        num_tokens=[3, 40])
    shared = dsa_jax.init_random_weights(cfg, jax.random.key(1), has_indexer=False)
    with pytest.raises(StepError, match=r"shared_sel has shape \(2, 2, 15\), expected "
                                        r"\(2, 3, 15\)"):
        dsa_jax.decode_k(cfg, shared, state, random_rows(4, 2, 3, cfg.hidden_size),
                         shared_sel=jnp.zeros((2, 2, cfg.sel_width), jnp.int32))
    y, state, _ = dsa_jax.decode_k(cfg, weights, state, random_rows(5, 2, 4, cfg.hidden_size))
    assert np.isfinite(np.asarray(y)).all()
    assert np.asarray(state.lengths).tolist() == [14, 14]


@pytest.mark.parametrize("context", [21, 61])
def test_attend_on_the_first_rows_keeps_every_bit_and_poisons_a_broken_promise(layer_kernel_impl,
                                                                                context):
    """`layer.step(..., attend_rows=1)` (what a decode runs: its padded rows skip the selection
    and the gather-attend) returns the bits of the step running every row, for the Pallas
    kernels, before and after the selection bites (past 4 * index_topk = 48 tokens); a
    sequence with more real rows than promised gets NaN in those rows' outputs and selects
    nothing there."""
    cfg = ODD.replace(implementation=layer_kernel_impl)
    weights = _weights(cfg, 3)
    base = random_state(cfg, weights, 3, context, 21)
    x = random_rows(5, 3, cfg.max_verify, cfg.hidden_size)  # [B, R, D]

    def run(n_new, rows):
        f = jax.jit(lambda w, s, x, n: layer.step(cfg, w, s, x, n, attend_rows=rows))
        return f(weights, copy_tree(base), x, jnp.asarray(n_new, jnp.int32))

    assert_trees_bitwise_equal(run([1, 1, 0], 1), run([1, 1, 0], None))
    cut = run([2, 1, 0], 1)
    y, sel = np.asarray(cut[0]), np.asarray(cut[2])  # [B, R, D], [B, R, W]
    assert np.isnan(y[0, 1]).all()
    assert np.isfinite(y[0, 0]).all() and np.isfinite(y[1:]).all()
    assert (sel[0, 1] == -1).all() and (np.asarray(run([2, 1, 0], None)[2])[0, 1] >= 0).any()
