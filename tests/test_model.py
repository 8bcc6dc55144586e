"""The scanned model (`dsa_jax.model.forward`) equals the unrolled stack of `layer.step`s, bit
for bit; its plan, its stacked state and its program size."""

import jax
import jax.numpy as jnp
import loop_checks
import numpy as np
import pytest

from dsa_jax import model as M
from dsa_jax.checkpoint import expected_weights
from dsa_jax.shapes import ODD
from dsa_jax.state import ring_rows
from dsa_jax.testing import assert_trees_bitwise_equal as assert_bitwise

CFG = ODD.replace(cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16")
REGULAR = ("full", "shared", "full", "shared")
IRREGULAR = ("full", "shared", "shared", "full")  # groups of 3 and 1: two scan segments
SCANNED = jax.jit(M.forward, static_argnums=0, donate_argnums=2)
UNROLLED = jax.jit(M.forward_unrolled, static_argnums=0, donate_argnums=2)


def test_layer_plan_groups_a_full_layer_with_its_shared_layers():
    Seg = M.Segment
    assert M.layer_plan(("full",)) == (Seg(1, 1, 0, 0),)
    assert M.layer_plan(("full", "shared") * 3) == (Seg(2, 3, 0, 0),)
    assert M.layer_plan(("full", "shared", "shared", "full", "full", "shared")) == (
        Seg(3, 1, 0, 0), Seg(1, 1, 3, 1), Seg(2, 1, 4, 2))


def _tables(b, nb, mb, seed):
    rng = np.random.default_rng(seed)
    # One shuffled pool split between the sequences: no physical block mapped twice.
    return rng.permutation(nb)[:b * mb].reshape(b, mb).astype(np.int32)


@pytest.mark.parametrize("pattern", [pytest.param(REGULAR, marks=pytest.mark.long), IRREGULAR])
def test_scanned_equals_unrolled_bitwise(pattern):
    mcfg = M.ModelConfig(CFG.replace(indexer_types=pattern), vocab_size=37)
    weights = M.init_model(mcfg, jax.random.key(1))
    stacked = M.stack_weights(mcfg, weights)
    b, nb, r = 2, 30, CFG.max_verify
    ms = M.init_model_state(mcfg, b, nb, _tables(b, nb, CFG.blocks_per_seq, 2))
    states = tuple(M.unfold_state(mcfg, ms))
    rng = np.random.default_rng(3)
    # A ragged prompt chunk, decode-shaped steps (ragged, one sequence idle), then rows that
    # run past max_context (96): dropped in both, never written into another layer's rows.
    steps = [(2 * r, [8, 5]), (2 * r, [3, 8]), (r, [1, r]), (r, [r - 1, 0])]
    steps += [(2 * r, [8, 8])] * 11
    for rows, n_new in steps:
        tokens = jnp.asarray(rng.integers(0, 37, (b, rows)), jnp.int32)
        n = jnp.asarray(n_new, jnp.int32)
        logits, ms, sel = SCANNED(mcfg, stacked, ms, tokens, n)
        want_logits, states, want_sel = UNROLLED(mcfg, weights, states, tokens, n)
        assert_bitwise((logits, sel), (want_logits, want_sel))
        assert_bitwise(M.unfold_state(mcfg, ms), list(states))
    assert np.asarray(ms.lengths).tolist() == [103, 105]  # past 96: the rows were dropped
    assert not np.isnan(np.asarray(logits)).any()


def _primitives(jaxpr) -> list[str]:
    """Every equation's primitive (a pallas_call as "pallas_call:NAME/ARGS", its body not
    entered), nested jaxprs (scans, conds) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            name = eqn.params.get("name") or eqn.params["name_and_src_info"].name  # jax 0.10/0.11
            out.append(f"pallas_call:{name}/{len(eqn.invars)}")
            continue
        out.append(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _primitives(inner)
    return out


def test_the_scanned_model_on_the_row_invariant_gemms(layer_kernel_impl):
    """Under the row-invariant GEMMs (`gemm="pallas"`, bf16 weights) the scan's GEMMs read each
    layer's weights in place in the stacks (`projection.LayerOf`: no copy of a layer's weights
    per token) and the LM head runs the kernel too: scanned == unrolled bit for bit, and a
    row's logits, caches and selection have the same bits in a forward of 1 or 4 rows per
    sequence (`step_rows`: the serving loop runs only the rows it fills)."""
    cfg = CFG.replace(gemm="pallas", param_dtype="bfloat16", implementation=layer_kernel_impl)
    mcfg = M.ModelConfig(cfg.replace(indexer_types=IRREGULAR), vocab_size=37)
    weights = M.init_model(mcfg, jax.random.key(1))
    stacked = M.stack_weights(mcfg, weights)
    b, nb = 2, 30
    ms = M.init_model_state(mcfg, b, nb, _tables(b, nb, CFG.blocks_per_seq, 2))
    states = tuple(M.unfold_state(mcfg, ms))
    assert M.step_rows(cfg, 1) == 1 and M.step_rows(cfg.replace(gemm="xla"), 1) == 4
    jaxpr = jax.make_jaxpr(lambda w, s, t, n: M.forward(mcfg, w, s, t, n))(
        stacked, ms, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32))
    ops = _primitives(jaxpr.jaxpr)
    # Traced once per scan body: 6 GEMMs of a full layer, 5 of a shared one (no indexer
    # query), each on its stack and layer index (3 operands); segments (full, shared, shared)
    # and (full); the LM head on its one weight. No XLA dot is left. A full layer's q_b GEMM
    # shares the top-k's launch (`step.shares_q_launch`: its scores, the rows' positions and
    # validity (read by the kernel: no pass before it), then the
    # GEMM's index, rows and stack), with cfg.colaunch off it runs alone.
    assert ops.count("pallas_call:matmul/3") == (5 + 5) + 5 and "dot_general" not in ops
    assert ops.count("pallas_call:topk_matmul/6") == 2 and "pallas_call:pool_topk/1" not in ops
    off = M.ModelConfig(mcfg.dsa.replace(colaunch=False), vocab_size=37)
    ops_off = _primitives(jax.make_jaxpr(lambda w, s, t, n: M.forward(off, w, s, t, n))(
        stacked, ms, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32)).jaxpr)
    assert ops_off.count("pallas_call:matmul/3") == (6 + 5) + 6
    assert "pallas_call:topk_matmul/6" not in ops_off
    assert ops.count("pallas_call:matmul/2") == 1
    # The pre-block and q_a RMSNorms read their stacked weights in place too (2 per body);
    # the final norm has its one weight.
    assert ops.count("pallas_call:rms_norm/3") == 2 * 3
    assert ops.count("pallas_call:rms_norm/2") == 1
    # And the writes: the latent write's norm in each body, the indexer write's LayerNorm
    # and ape in each full layer's (one more operand each: the index).
    assert ops.count("pallas_call:latent_write/6") == 3
    assert ops.count("pallas_call:index_write_rows/8") == 2
    assert ops.count("pallas_call:index_write_pool_keys/8") == 2
    rng = np.random.default_rng(3)
    # A ragged prompt chunk (XLA's GEMMs), decode-shaped steps of 1 and 4 rows.
    for rows, n_new in [(30, [30, 26]), (1, [1, 1]), (1, [1, 0]), (4, [2, 4])]:
        tokens = jnp.asarray(rng.integers(0, 37, (b, rows)), jnp.int32)
        n = jnp.asarray(n_new, jnp.int32)
        if rows == 1:  # the same row in a 4-row forward (3 padded rows) from the same state
            wide = SCANNED(mcfg, stacked, jax.tree.map(jnp.copy, ms),
                           jnp.pad(tokens, ((0, 0), (0, 3))), n)
        logits, ms, sel = SCANNED(mcfg, stacked, ms, tokens, n)
        want_logits, states, want_sel = UNROLLED(mcfg, weights, states, tokens, n)
        assert_bitwise((logits, sel), (want_logits, want_sel))
        assert_bitwise(M.unfold_state(mcfg, ms), list(states))
        if rows == 1:
            assert_bitwise((wide[0][:, :1], wide[2][:, :1]), (logits, sel))
            assert_bitwise(wide[1], ms)
    assert not np.isnan(np.asarray(logits)).any()
    with pytest.raises(M.ModelError, match="fills 1..max_verify=4 rows"):
        M.step_rows(cfg, 5)


def test_attend_rows_keeps_every_bit_and_poisons_a_broken_promise(layer_kernel_impl):
    """`forward(attend_rows=1)` (the plain decode loop's): decode-shaped rows, the first one
    real, give the same logits, selection and caches as attending every row, in the scanned
    and the unrolled form; a real row past the promise gets NaN logits, never a silent
    value."""
    mcfg = M.ModelConfig(CFG.replace(indexer_types=IRREGULAR, implementation=layer_kernel_impl),
                         vocab_size=37)
    weights = M.init_model(mcfg, jax.random.key(2))
    stacked = M.stack_weights(mcfg, weights)
    b, nb, r = 3, 40, CFG.max_verify
    ms = M.init_model_state(mcfg, b, nb, _tables(b, nb, CFG.blocks_per_seq, 4))
    rng = np.random.default_rng(5)
    fwd = jax.jit(M.forward, static_argnums=0, static_argnames="attend_rows")
    unrolled = jax.jit(M.forward_unrolled, static_argnums=0, static_argnames="attend_rows")
    # A ragged prompt (selection bites past 4 * index_topk tokens), then decode-shaped rows.
    for rows, n_new in [(48, [48, 37, 44]), (r, [1, 1, 0]), (r, [1, 0, 1])]:
        tokens = jnp.asarray(rng.integers(0, 37, (b, rows)), jnp.int32)
        n = jnp.asarray(n_new, jnp.int32)
        if rows == r:
            states = tuple(M.unfold_state(mcfg, ms))
            cut = fwd(mcfg, stacked, ms, tokens, n, attend_rows=1)
            cut_unrolled = unrolled(mcfg, weights, states, tokens, n, attend_rows=1)
            assert_bitwise(cut_unrolled[0], cut[0])
        logits, ms, sel = fwd(mcfg, stacked, ms, tokens, n)
        if rows == r:
            assert_bitwise((cut[0], cut[2]), (logits, sel))
            assert_bitwise(cut[1], ms)
            assert not np.isnan(np.asarray(logits)[:, 0]).any()
    broken = fwd(mcfg, stacked, ms, tokens, jnp.asarray([2, 1, 1], jnp.int32), attend_rows=1)
    got = np.asarray(broken[0])
    assert np.isnan(got[0, 1]).all() and not np.isnan(got[:, 0]).any()


def test_fold_unfold_round_trip_and_refusals():
    mcfg = M.ModelConfig(CFG.replace(indexer_types=IRREGULAR), vocab_size=37)
    ms = M.init_model_state(mcfg, 2, 24, _tables(2, 24, CFG.blocks_per_seq, 4))
    k = jax.random.split(jax.random.key(5), 3)
    ms = ms._replace(latent=jax.random.normal(k[0], ms.latent.shape).astype(ms.latent.dtype),
                     index_k=jax.random.normal(k[1], ms.index_k.shape).astype(ms.index_k.dtype),
                     pool_keys=jax.random.normal(k[2], ms.pool_keys.shape).astype(
                         ms.pool_keys.dtype),
                     lengths=jnp.asarray([7, 11], jnp.int32))
    states = M.unfold_state(mcfg, ms)
    rows = ring_rows(CFG)  # the indexer ring (dsa_jax.state): 16 rows, not max_context 96
    assert [st.index_k.shape[1] for st in states] == [rows, 0, 0, rows]
    assert_bitwise(M.fold_states(mcfg, states), ms)
    with pytest.raises(M.ModelError, match="3 layer states for a 4-layer model"):
        M.fold_states(mcfg, states[:3])
    odd = list(states)
    odd[2] = odd[2]._replace(lengths=jnp.asarray([7, 12], jnp.int32))
    with pytest.raises(M.ModelError, match="layer 2's lengths or block tables differ"):
        M.fold_states(mcfg, odd)
    behind = list(states)
    behind[3] = behind[3]._replace(index_lengths=jnp.asarray([7, 10], jnp.int32))
    with pytest.raises(M.ModelError, match=r"layer 3: indexer lengths \[ 7 10\] are behind"):
        M.fold_states(mcfg, behind)
    # A ring mark further ahead than max_verify - 1 rows cannot be folded (the model state
    # keeps no mark); within that it can.
    ahead = list(states)
    ahead[3] = ahead[3]._replace(index_lengths=jnp.asarray([10, 11], jnp.int32))
    assert_bitwise(M.fold_states(mcfg, ahead), ms)
    ahead[3] = ahead[3]._replace(index_lengths=jnp.asarray([11, 11], jnp.int32))
    with pytest.raises(M.ModelError, match=r"layer 3: indexer ring marks \[11 11\] are more "
                                           r"than 3 rows \(max_verify - 1\) ahead"):
        M.fold_states(mcfg, ahead)


def _program_lines(depth: int) -> int:
    cfg = CFG.replace(indexer_types=("full", "shared") * depth)
    mcfg = M.ModelConfig(cfg, vocab_size=37)
    d, v = cfg.hidden_size, mcfg.vocab_size
    spec = jax.ShapeDtypeStruct
    layers = tuple(expected_weights(cfg, kind == "full") for kind in cfg.indexer_types)
    per_layer = M.ModelWeights(spec((v, d), jnp.float32), spec((2 * depth, d), jnp.float32),
                               layers, spec((d,), jnp.float32), spec((v, d), jnp.float32))
    w = jax.eval_shape(lambda a: M.stack_weights(mcfg, a), per_layer)
    ms = jax.eval_shape(lambda: M.init_model_state(mcfg, 1, 12))
    tokens = jax.ShapeDtypeStruct((1, CFG.max_verify), jnp.int32)
    n_new = jax.ShapeDtypeStruct((1,), jnp.int32)
    text = jax.jit(M.forward, static_argnums=0).lower(mcfg, w, ms, tokens, n_new).as_text()
    return len(text.splitlines())


def test_program_does_not_grow_with_depth():
    assert _program_lines(2) == _program_lines(8)


def test_hidden_rows_equal_between_the_two_forms():
    """`hidden=True`: every layer's input rows [L, B, R, D], equal bit for bit in both forms;
    layer 0's are the embeddings."""
    mcfg = M.ModelConfig(CFG.replace(indexer_types=IRREGULAR), vocab_size=37)
    weights = M.init_model(mcfg, jax.random.key(5))
    b, nb, r = 2, 30, CFG.max_verify
    ms = M.init_model_state(mcfg, b, nb, _tables(b, nb, CFG.blocks_per_seq, 6))
    states = tuple(M.unfold_state(mcfg, ms))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 37, (b, r)), jnp.int32)
    n = jnp.asarray([r, 2], jnp.int32)
    # Both jitted, as the checks run them (eager op-by-op execution fuses differently).
    got = jax.jit(M.forward, static_argnums=0, static_argnames="hidden")(
        mcfg, M.stack_weights(mcfg, weights), ms, tokens, n, hidden=True)
    want = jax.jit(M.forward_unrolled, static_argnums=0, static_argnames="hidden")(
        mcfg, weights, states, tokens, n, hidden=True)
    assert got[3].shape == (4, b, r, CFG.hidden_size)
    assert_bitwise(got[3], want[3])
    assert_bitwise(got[3][0], weights.embed[tokens])
    assert not (np.asarray(got[3][1]) == np.asarray(got[3][0])).all()


def test_rms_norm_is_an_island():
    """The norm's input and output are fusion barriers (projection.rms_norm says why): without
    them XLA fused it differently in the scanned and the unrolled programs on the H200."""
    from dsa_jax.projection import rms_norm
    v, w = jnp.ones((3, 8)), jnp.ones((8,))
    eqns = jax.make_jaxpr(lambda v, w: rms_norm(v, w, 1e-5))(v, w).jaxpr.eqns
    assert eqns[0].primitive.name == "optimization_barrier"
    assert eqns[-1].primitive.name == "optimization_barrier"
    rng = np.random.default_rng(0)
    v = jnp.asarray(rng.standard_normal((5, 33)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((33,)), jnp.float32)
    want = w * v / jnp.sqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(rms_norm(v, w, 1e-5), want, rtol=4 * 2.0 ** -23 * 33, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [True, False])
def test_scanned_equals_unrolled_bitwise_at_glm_shapes(in_place):
    """The must-hold of issue 15 on the GPU: 8 GLM-5.3-Flash layers (full, shared) x 4, 1K
    context, 2 sequences, prompt, verify and decode rows: logits, selection and every cache
    `==`, under the options of the default `Program` (weights read in place) and without."""
    from dsa_jax.shapes import glm53_flash
    cfg = glm53_flash(implementation="pallas", max_context=1024,
                      indexer_types=("full", "shared") * 4)
    assert loop_checks.scan_equals_unrolled(cfg, 256, in_place=in_place)


@pytest.mark.gpu
def test_new_rows_land_in_their_place_in_a_4_gib_stacked_pool():
    """The `loop-b64-l8` model (8 GLM-5.3-Flash layers, 64 sequences x 16K, fp8): its stacked
    latent pool is exactly 2**32 bytes, past where 32-bit element offsets wrap. One decode
    forward of the scanned model (the stacked pool) and of the unrolled stack (per-layer pools
    of 512 MiB) near the end of every context: in every layer, each sequence's new latent row
    is the same row in both (at most a few bits apart, never half a row: a row written to the
    wrong place would be)."""
    from dsa_jax.shapes import glm53_flash
    cfg = glm53_flash(implementation="pallas", indexer_types=("full", "shared") * 4)
    got = loop_checks.written_rows(cfg, 256, 64)
    assert got["pool_bytes"] == 2 ** 32
    assert got["rows_far_apart_per_layer"] == [0] * 8


def test_new_rows_land_in_their_place_on_the_tiny_model():
    """The check above on the CPU (tiny config, 2 sequences, a small pool)."""
    from dsa_jax.shapes import tiny
    cfg = tiny(implementation="xla", max_context=64, indexer_types=("full", "shared"))
    got = loop_checks.written_rows(cfg, 64, 2)
    assert got["rows_far_apart_per_layer"] == [0, 0] and got["pool_bytes"] > 0
