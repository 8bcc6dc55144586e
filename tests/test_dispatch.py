"""How the public calls dispatch (issue 15): one program per (config, layout) with both bound,
only the state fields a step changes donated and returned, bitwise equal to the program with
static config and the whole state donated; the host mirror's lockstep marks and the cached
table facts of the full check never let a bad step through."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import layer, mirror
from dsa_jax.mirror import HostNumbers
from dsa_jax.shapes import ODD, glm53_flash
from dsa_jax.step_checks import StepError, check_numbers, check_tables, tables_fit
from dsa_jax.testing import copy_tree, random_rows, random_state

CFG = ODD


def _bits(tree):
    return [None if a is None else np.asarray(a).tobytes() for a in jax.tree.leaves(tree)]


def jit_cache_size(fn) -> int | None:
    """Entries in a jitted function's cache (jax's own counter); None where jax has none."""
    size = getattr(fn, "_cache_size", None)
    return int(size()) if callable(size) else None


@pytest.mark.parametrize("kind, k, indexer", [("decode", 1, True), ("verify", 3, True),
                                              ("decode", 1, False), ("prefill", 5, True)])
def test_dispatch_step_equals_layout_step_bitwise(kind, k, indexer):
    cfg = CFG
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(3), has_indexer=indexer)
    state = dsa_jax.init_state(cfg, 2, has_indexer=indexer)
    pre = None if indexer else jnp.full((2, 7, cfg.sel_width), -1, jnp.int32)
    _, state, _ = dsa_jax.prefill(cfg, weights, state, random_rows(4, 2, 7, cfg.hidden_size),
                                  shared_sel=pre)
    shape = (2, cfg.hidden_size) if kind == "decode" else (2, k, cfg.hidden_size)
    x = random_rows(5, *shape)
    sel_shape = (2, cfg.sel_width) if kind == "decode" else (2, k, cfg.sel_width)
    # Ids at or before each row's position (7 tokens held): any of 0..6.
    shared = None if indexer else jnp.asarray(
        np.random.default_rng(6).integers(-1, 7, sel_shape), jnp.int32)
    layout, n_new = layer.prepare_step(cfg, weights, state, x, kind=kind, shared_sel=shared)
    n_dev = jnp.asarray(n_new)
    old = layer.layout_step(cfg, layout, weights, copy_tree(state), x, n_dev, shared)
    new = layer.dispatch_step(cfg, layout, weights, copy_tree(state), x, n_dev, shared)
    assert _bits(new) == _bits(old)
    assert np.asarray(new[1].lengths).tolist() == [7 + k, 7 + k]


@pytest.mark.gpu
def test_the_public_decode_and_its_programs_agree_at_glm53_flash_shapes():
    """Compiled (one GLM-5.3-Flash block, pallas, fp8 cache, one sequence past the selection's
    width): `dsa_jax.decode`, the program with the config static and the whole state donated
    (`layout_step`), the one with both bound and only the changing fields donated
    (`dispatch_step`) and `dispatch_step(out=)` (y and sel written into donated buffers) give
    the same y, sel and state, bit for bit."""
    cfg = glm53_flash(implementation="pallas", max_context=4096)
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(8))
    state = random_state(cfg, weights, 1, 3001, 4, dtype=jnp.bfloat16, kv_scale=1 / 64)
    x = random_rows(10, 1, cfg.hidden_size, dtype=jnp.bfloat16)  # [1, D]
    layout, n_new = layer.prepare_step(cfg, weights, state, x, kind="decode")
    n_dev = jnp.asarray(n_new)
    old = layer.layout_step(cfg, layout, weights, copy_tree(state), x, n_dev, None)
    new = layer.dispatch_step(cfg, layout, weights, copy_tree(state), x, n_dev, None)
    bufs = (jnp.zeros((1, cfg.hidden_size), jnp.float32), jnp.zeros((1, cfg.sel_width),
                                                                    jnp.int32))
    out = layer.dispatch_step(cfg, layout, weights, copy_tree(state), x, n_dev, None, out=bufs)
    public = dsa_jax.decode(cfg, weights, copy_tree(state), x)
    for got in (new, out, public):
        assert _bits(got) == _bits(old)
    assert np.isfinite(np.asarray(old[0])).all()


def test_only_the_changing_fields_are_donated_and_the_rest_shared():
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(7))
    state = random_state(CFG, weights, 1, 5, seed=8)
    _, new, _ = dsa_jax.decode(CFG, weights, state, random_rows(9, 1, CFG.hidden_size))
    assert new.kv_scale is state.kv_scale and new.block_tables is state.block_tables
    assert not state.kv_scale.is_deleted() and not state.block_tables.is_deleted()
    if jax.default_backend() == "cpu" and not state.latent.is_deleted():
        pytest.skip("this backend does not implement donation")
    assert all(getattr(state, f).is_deleted() for f in layer.MOVING_FIELDS)
    assert not any(getattr(new, f).is_deleted() for f in layer.MOVING_FIELDS)


def test_one_program_per_layout_for_equal_configs():
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(10))
    state = dsa_jax.init_state(CFG, 3)  # a batch no other test here runs: a new shape
    layout, _ = layer.prepare_step(CFG, weights, state, random_rows(1, 3, CFG.hidden_size),
                                   kind="decode")
    prog = layer.public_program(CFG, layout)
    sizes = []
    for i in range(3):  # an equal config built anew every call: no new program, no retrace
        cfg = CFG.replace(max_verify=CFG.max_verify)
        assert layer.public_program(cfg, layout) is prog
        _, state, _ = dsa_jax.decode(cfg, weights, state, random_rows(11 + i, 3, CFG.hidden_size))
        sizes.append(jit_cache_size(prog))
    # The first call may compile (unless another test in this process already did); the
    # others add nothing.
    assert sizes[0] is None or sizes[1] == sizes[2] == sizes[0]


def test_lockstep_marks_are_the_lengths_array_and_a_rewound_ring_is_checked():
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(12))
    state = dsa_jax.init_state(CFG, 1)
    _, state, _ = dsa_jax.prefill(CFG, weights, state, random_rows(13, 1, 8, CFG.hidden_size))
    for i in range(2):
        _, state, _ = dsa_jax.decode(CFG, weights, state, random_rows(14 + i, 1, CFG.hidden_size))
    known = mirror.known(state)
    assert known.index_lengths is known.lengths and known.lengths.tolist() == [10]
    assert np.asarray(state.index_lengths).tolist() == [10]
    state = dsa_jax.rewind(CFG, state, [9])  # the ring keeps its mark: no longer lockstep
    known = mirror.known(state)
    assert known.index_lengths is not known.lengths
    assert known.index_lengths.tolist() == [10] and known.lengths.tolist() == [9]
    _, state, _ = dsa_jax.decode(CFG, weights, state, random_rows(16, 1, CFG.hidden_size))
    assert np.asarray(state.lengths).tolist() == [10]


def test_arrays_that_outlive_the_host_caches_at_exit_print_nothing():
    """At interpreter exit a module's globals are set to None while objects they named may
    live on; the host caches keyed by arrays (the mirror's entries, the step checks' passed
    layers, table facts and vouched selections) then drop an entry as its array dies without
    an "Exception ignored" traceback on stderr (seen at the end of test runs). Simulated in a
    child process: after a prefill and a decode, each cache's global cleared while the cache
    lives, then every array dropped."""
    script = """
import gc, jax, dsa_jax
from dsa_jax import mirror, step_checks
from dsa_jax.shapes import ODD
from dsa_jax.testing import random_rows
cfg = ODD.replace(implementation="xla")
weights = dsa_jax.init_random_weights(cfg, jax.random.key(1))
state = dsa_jax.init_state(cfg, 1)
y, state, sel = dsa_jax.prefill(cfg, weights, state, random_rows(2, 1, 6, cfg.hidden_size))
y, state, sel = dsa_jax.decode(cfg, weights, state, random_rows(3, 1, cfg.hidden_size))
caches = {(m, n): getattr(m, n) for m, n in ((mirror, "_ENTRIES"), (step_checks, "_LAYER_OK"),
          (step_checks, "_TABLE_FACTS"), (step_checks, "_VOUCHED"))}
assert all(caches.values()), {n: len(c) for (_, n), c in caches.items()}
for m, n in caches:
    setattr(m, n, None)  # the global cleared, as teardown does, the cache alive
del y, state, sel, weights
gc.collect()
assert not any(caches.values()), {n: len(c) for (_, n), c in caches.items()}
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]


def _numbers(lengths, marks, tables, same=False):
    lengths = np.asarray(lengths, np.int32)
    marks = lengths if same else np.asarray(marks, np.int32)
    return HostNumbers(lengths, marks, tables)


def test_the_full_check_still_refuses_behind_and_out_of_ring_marks():
    tables = np.arange(2 * CFG.blocks_per_seq, dtype=np.int32).reshape(2, -1)
    one = np.ones((2,), np.int32)
    nb = tables.size
    with pytest.raises(StepError, match="sequence 1: indexer length 4 is behind"):
        check_numbers(CFG, _numbers([5, 6], [5, 4], tables), one, True, nb)
    far = 6 + 64  # a mark far ahead of a length inside a pool: the ring lost its rows
    with pytest.raises(StepError, match="sequence 0: at length 6"):
        check_numbers(CFG, _numbers([6, 6], [far, 6], tables), one, True, nb)
    # Lockstep (the same array): nothing to check there; the slack as before.
    slack = check_numbers(CFG, _numbers([6, 6], None, tables, same=True), one, True, nb)
    assert slack == CFG.block_size - 6


def test_cached_table_facts_never_pass_a_bad_read():
    bs, mb = CFG.block_size, CFG.blocks_per_seq
    nb = 2 * mb
    tables = np.arange(nb, dtype=np.int32).reshape(2, mb)
    tables[1, 2:] = -1  # sequence 1 maps two blocks
    tables.setflags(write=False)
    lengths = np.array([bs, 2 * bs - 1], np.int32)
    one = np.ones((2,), np.int32)
    assert tables_fit(tables, -(-(lengths + one) // bs), nb)
    assert not tables_fit(tables, -(-(lengths + 2) // bs), nb)  # reads block 2 of seq 1
    with pytest.raises(StepError, match="sequence 1: block table entry 2 is -1"):
        check_numbers(CFG, _numbers(lengths, lengths, tables), one + 1, True, nb)
    twice = np.array(tables)
    twice[1, 1] = twice[0, 0]  # two sequences share a block
    twice.setflags(write=False)
    assert not tables_fit(twice, np.array([1, 2]), nb)
    with pytest.raises(StepError, match="mapped twice"):
        check_tables(CFG, twice, np.array([0, bs]), np.array([1, 1]), nb)
    # A writeable table is never cached: changing it changes the answer.
    live = np.array(np.arange(nb, dtype=np.int32).reshape(2, mb))
    assert tables_fit(live, np.array([mb, mb]), nb)
    live[0, mb - 1] = -1
    assert not tables_fit(live, np.array([mb, mb]), nb)


def _plain_and_out(kind, k):
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(20))
    state = random_state(CFG, weights, 2, 6, seed=21)
    call = dsa_jax.decode if kind == "decode" else dsa_jax.decode_k
    lead = (2,) if kind == "decode" else (2, k)
    xs = [random_rows(22 + i, *lead, CFG.hidden_size) for i in range(3)]
    plain, st = [], copy_tree(state)
    for x in xs:
        y, st, sel = call(CFG, weights, st, x)
        plain.append((y, sel))
    outs, st = [], copy_tree(state)
    buf = (jnp.full(lead + (CFG.hidden_size,), 7.0, jnp.float32),
           jnp.full(lead + (CFG.sel_width,), 7, jnp.int32))
    for x in xs:  # the previous results passed back once read: the loop the option is for
        outs.append((np.asarray(buf[0]), np.asarray(buf[1])))
        y, st, sel = call(CFG, weights, st, x, out=buf)
        buf = (y, sel)
    outs = outs[1:] + [(np.asarray(buf[0]), np.asarray(buf[1]))]
    return plain, outs


@pytest.mark.parametrize("kind, k", [("decode", 1), ("verify", 3)])
def test_out_buffers_give_the_same_bits(kind, k):
    plain, outs = _plain_and_out(kind, k)
    assert _bits(outs) == _bits([(np.asarray(y), np.asarray(s)) for y, s in plain])


def test_out_buffers_are_donated():
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(30))
    state = random_state(CFG, weights, 1, 4, seed=31)
    buf = (jnp.zeros((1, CFG.hidden_size)), jnp.zeros((1, CFG.sel_width), jnp.int32))
    y, _, sel = dsa_jax.decode(CFG, weights, state, random_rows(32, 1, CFG.hidden_size),
                               out=buf)
    if jax.default_backend() == "cpu" and not buf[0].is_deleted():
        pytest.skip("this backend does not implement donation")
    assert buf[0].is_deleted() and buf[1].is_deleted()
    assert not y.is_deleted() and not sel.is_deleted()


def test_bad_out_is_refused_before_anything_is_donated():
    weights = dsa_jax.init_random_weights(CFG, jax.random.key(40))
    state = random_state(CFG, weights, 2, 4, seed=41)
    x = random_rows(42, 2, CFG.hidden_size)
    y_ok = jnp.zeros((2, CFG.hidden_size))
    sel_ok = jnp.zeros((2, CFG.sel_width), jnp.int32)
    dead = jnp.zeros((2, CFG.sel_width), jnp.int32)
    dead.delete()
    cases = [
        ((y_ok,), "out must be a pair \\(y, sel\\) of arrays, got tuple of 1"),
        ((y_ok[:1], sel_ok), f"out y is float32\\[1, {CFG.hidden_size}\\], expected "
                             f"float32\\[2, {CFG.hidden_size}\\]"),
        ((y_ok, sel_ok.astype(jnp.float32)), f"out sel is float32\\[2, {CFG.sel_width}\\], "
                                             f"expected int32\\[2, {CFG.sel_width}\\]"),
        ((np.zeros((2, CFG.hidden_size), np.float32), sel_ok), "must be a concrete jax.Array"),
        ((y_ok, dead), "out sel was donated to a step"),
        ((x, sel_ok), "two arrays of their own"),  # x is an input: it cannot be donated
    ]
    for out, message in cases:
        with pytest.raises(StepError, match=message):
            dsa_jax.decode(CFG, weights, state, x, out=out)
        assert not state.latent.is_deleted() and not y_ok.is_deleted()

    def traced(y_buf):
        return dsa_jax.decode(CFG, weights, state, x, out=(y_buf, sel_ok))[0]

    with pytest.raises(StepError, match="concrete jax.Array"):
        jax.jit(traced)(y_ok)
