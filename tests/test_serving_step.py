"""`dsa_jax.serving_step`: the step inside a user's own jit / scan is the eager call, bit for
bit (weights as arguments or closed over), checks on the device what a trace cannot check on
the host, and `jax.jit(dsa_jax.decode)` runs it with the same bits and poisons no cache.
examples/serving_loop.py (a sampling `lax.scan` loop == the eager calls) runs in
tests/test_wheel.py, from the installed wheel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import StepError
from dsa_jax.shapes import ODD
from dsa_jax.testing import assert_trees_bitwise_equal, copy_tree, random_rows


def _setup(impl, cache_dtype="float8_e4m3fn", seqs=3, length=21):
    cfg = ODD.replace(implementation=impl, cache_dtype=cache_dtype,
                      index_cache_dtype="bfloat16")
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(3))
    return cfg, weights, _ragged(cfg, weights, [length, length - 7, length + 5][:seqs])


def _ragged(cfg, weights, lengths):
    """A state of `len(lengths)` sequences prefilled to `lengths` random rows."""
    state = dsa_jax.init_state(cfg, len(lengths), kv_scale=1 / 32)
    x = random_rows(1, len(lengths), max(lengths), cfg.hidden_size)
    return dsa_jax.prefill(cfg, weights, state, x, num_tokens=np.array(lengths))[1]


def _eager(cfg, weights, state, xs, kind):
    """Eager calls: decode per row of `xs [B, T, D]`, or one decode_k / prefill."""
    if kind == "decode":
        ys, sels = [], []
        for t in range(xs.shape[1]):
            y, state, sel = dsa_jax.decode(cfg, weights, state, xs[:, t])
            ys.append(y), sels.append(sel)
        return jnp.stack(ys, 1), state, jnp.stack(sels, 1)
    call = dsa_jax.decode_k if kind == "verify" else dsa_jax.prefill
    return call(cfg, weights, state, xs)


@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
def test_the_serving_step_in_your_jit_is_the_eager_call_bit_for_bit(impl, kind):
    cfg, weights, base = _setup(impl)
    rows = 3
    xs = random_rows(7, base.num_seqs, rows, cfg.hidden_size)  # [B, 3, D]
    want = _eager(cfg, weights, copy_tree(base), xs, kind)
    step = dsa_jax.serving_step(cfg, kind, rows=1 if kind == "decode" else rows)

    def scanned(w, s):  # decode: a lax.scan over the rows
        def body(s, x):
            y, s, sel = step(w, s, x)
            return s, (y, sel)
        s, (ys, sels) = jax.lax.scan(body, s, jnp.swapaxes(xs, 0, 1))
        return jnp.swapaxes(ys, 0, 1), s, jnp.swapaxes(sels, 0, 1)

    one = scanned if kind == "decode" else (lambda w, s: step(w, s, xs))
    as_argument = jax.jit(one)(weights, copy_tree(base))
    closed_over = jax.jit(lambda s: one(weights, s))(copy_tree(base))
    with_options = step.jit(one, donate_argnums=1)(weights, copy_tree(base))
    for got in (as_argument, closed_over, with_options):
        assert_trees_bitwise_equal(got, want)


def test_jit_of_decode_runs_the_serving_step_and_poisons_no_cache():
    """The issue's reproduction: one sequence one token short of max_context, two jitted
    decodes (the second has no room: NaN rows, nothing written, its length kept), then an
    eager decode on a copy made before (it works: no traced value was cached)."""
    cfg, weights, _ = _setup("xla", seqs=2)
    state = _ragged(cfg, weights, [cfg.max_context - 1, 30])
    copy = copy_tree(state)
    xs = random_rows(8, 2, 2, cfg.hidden_size)
    want_y, want_state, want_sel = dsa_jax.decode(cfg, weights, copy_tree(state), xs[:, 0])
    jitted = jax.jit(lambda s, x: dsa_jax.decode(cfg, weights, s, x))
    y, s1, sel = jitted(state, xs[:, 0])
    assert_trees_bitwise_equal((y, s1, sel), (want_y, want_state, want_sel))
    y2, s2, sel2 = jitted(s1, xs[:, 1])
    assert np.asarray(s2.lengths).tolist() == [cfg.max_context, 32]  # no room: kept
    assert np.isnan(np.asarray(y2[0])).all() and (np.asarray(sel2[0]) == -1).all()
    assert np.isfinite(np.asarray(y2[1])).all()
    y3, _, _ = dsa_jax.decode(cfg, weights, copy, xs[:, 0])  # eager, after the traces
    assert_trees_bitwise_equal(y3, want_y)
    with pytest.raises(StepError, match="past max_context"):
        dsa_jax.check_step(cfg, weights, s2, xs[:, 1], kind="decode")


def test_an_unmapped_block_poisons_that_sequence_only():
    cfg, weights, base = _setup("xla")
    x = random_rows(9, base.num_seqs, cfg.hidden_size)  # [B, D]
    want_y, want_state, want_sel = dsa_jax.decode(cfg, weights, copy_tree(base), x)
    tables = np.asarray(base.block_tables).copy()
    s = 1
    tables[s, int(base.lengths[s]) // cfg.block_size] = -1  # the block its next row goes to
    broken = copy_tree(base)._replace(block_tables=jnp.asarray(tables))
    step = dsa_jax.serving_step(cfg, "decode")
    y, state, sel = jax.jit(step)(weights, broken, x)
    assert np.isnan(np.asarray(y[s])).all() and (np.asarray(sel[s]) == -1).all()
    assert int(state.lengths[s]) == int(base.lengths[s])
    others = [b for b in range(base.num_seqs) if b != s]
    assert_trees_bitwise_equal((y[others[0]], sel[others[0]]), (want_y[others[0]],
                                                              want_sel[others[0]]))
    with pytest.raises(StepError, match="block table entry"):
        dsa_jax.check_step(cfg, weights, broken, x)


def test_errors_name_the_value():
    cfg, weights, base = _setup("xla")
    step = dsa_jax.serving_step(cfg, "decode")
    x = random_rows(1, base.num_seqs, cfg.hidden_size)
    with pytest.raises(TypeError, match="cfg must be a DsaConfig, got DsaWeights"):
        dsa_jax.decode(weights, cfg, base, x)
    with pytest.raises(TypeError, match="the order is cfg, weights, state, x"):
        step(base, weights, x)
    with pytest.raises(StepError, match=r"takes x of shape \(3, 80\), got \(3, 1, 80\)"):
        step(weights, base, x[:, None])
    with pytest.raises(StepError, match="kind='verify' for 2 rows"):
        dsa_jax.serving_step(cfg, "decode", rows=2)
    with pytest.raises(StepError, match="does not fit max_verify 4"):
        dsa_jax.serving_step(cfg, "verify", rows=5)
    with pytest.raises(StepError, match="out= buffers"):
        jax.jit(lambda s: dsa_jax.decode(cfg, weights, s, x, out=(x, x)))(base)
    assert step.compiler_options == dict(dsa_jax.BITWISE_OPTIONS)


def test_x_as_a_python_list_is_the_array():
    cfg, weights, base = _setup("xla")
    x = random_rows(4, base.num_seqs, cfg.hidden_size)  # [B, D]
    want = dsa_jax.decode(cfg, weights, copy_tree(base), x)
    got = dsa_jax.decode(cfg, weights, copy_tree(base), np.asarray(x).tolist())
    assert_trees_bitwise_equal(got, want)


def test_a_shared_layers_serving_step_is_its_eager_decode():
    """A layer without an indexer: `shared_sel` passes through the serving step (and through
    `jax.jit(decode)`) as through the eager call, bit for bit."""
    cfg = ODD.replace(cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16")
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(6), has_indexer=False)
    lengths = [17, 9]
    state = dsa_jax.init_state(cfg, 2, kv_scale=1 / 32, has_indexer=False)
    x = random_rows(2, 2, max(lengths), cfg.hidden_size)
    prompt_sel = np.full((2, max(lengths), cfg.sel_width), -1, np.int32)
    base = dsa_jax.prefill(cfg, weights, state, x, num_tokens=np.array(lengths),
                           shared_sel=jnp.asarray(prompt_sel))[1]
    rng = np.random.default_rng(0)
    sel = np.full((2, cfg.sel_width), -1, np.int32)
    for s, n in enumerate(lengths):  # earlier tokens, distinct, in random order
        picks = rng.permutation(n + 1)[:cfg.sel_width]
        sel[s, :len(picks)] = picks
    sel = jnp.asarray(sel)
    xd = random_rows(3, 2, cfg.hidden_size)
    want = dsa_jax.decode(cfg, weights, copy_tree(base), xd, shared_sel=sel)
    step = dsa_jax.serving_step(cfg, "decode")
    got = jax.jit(lambda w, s, x, q: step(w, s, x, shared_sel=q))(weights, copy_tree(base),
                                                                   xd, sel)
    assert_trees_bitwise_equal(got, want)
    jitted = jax.jit(lambda s, x, q: dsa_jax.decode(cfg, weights, s, x, shared_sel=q))
    assert_trees_bitwise_equal(jitted(copy_tree(base), xd, sel), want)
