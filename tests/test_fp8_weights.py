"""fp8 weights kept as fp8 (`param_dtype="float8_e4m3fn"`, `dsa_jax.fp8`): the folds keep the
checkpoint's blocks, the step's GEMMs see exactly the bf16 weights the load-time
dequantization gives (so every output is `==` to the bf16 path's), the bytes are the
checkpoint's, and a bad fp8 checkpoint or an unsupported path is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import dsa_jax
from dsa_jax import fp8
from dsa_jax import testing as T
from dsa_jax.errors import ConfigError, WeightError
from dsa_jax.shapes import ODD, tiny
from dsa_jax.weights import FP8_RELEASE_TENSORS, quantize_hf_tensors

PALLAS = pytest.param("pallas", marks=pytest.mark.gpu)

# The tiny block in 32 x 32 blocks; with 32 x 40 blocks the column grid has a ragged edge;
# the odd block in 4 x 8 blocks (its 12 + 20 rows a head split on a block boundary).
TINY8 = tiny(param_dtype="float8_e4m3fn", weight_block=(32, 32), implementation="xla")
CASES = [pytest.param(TINY8, id="tiny"),
         pytest.param(TINY8.replace(weight_block=(32, 40)), id="tiny-ragged"),
         pytest.param(ODD.replace(param_dtype="float8_e4m3fn", weight_block=(4, 8)), id="odd")]


def _pair(cfg, key=0, tp_rank=0):
    """The fp8 checkpoint of a random layer folded twice: kept fp8, and dequantized at load
    (the bf16 path of today)."""
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(key))
    return hf, (dsa_jax.fold_weights(cfg, hf, tp_rank),
                dsa_jax.fold_weights(cfg.replace(param_dtype="bfloat16"), hf, tp_rank))


@pytest.mark.parametrize("cfg", CASES)
def test_the_folds_keep_fp8_blocks_and_give_the_load_time_weights(cfg):
    hf, (w8, w16) = _pair(cfg)
    assert all(hf[n].dtype == jnp.float8_e4m3fn for n in FP8_RELEASE_TENSORS)
    for name in ("q_proj", "qi_proj", "u_k", "u_v", "o_proj"):
        assert isinstance(getattr(w8, name), fp8.Fp8Block), name
    assert isinstance(w8.x_proj, fp8.StackedRows)  # weights_proj rides along unquantized
    for name, a, b in zip(w8._fields, w8, w16, strict=True):
        if b is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.asarray(fp8.dense(a), np.float32),
                                      np.asarray(b, np.float32), err_msg=name)
    # the checkpoint's bytes: fp8 values and their scales, not 2 bytes a weight
    gemms = ("x_proj", "q_proj", "qi_proj", "u_k", "u_v", "o_proj")
    kept = sum(getattr(w8, n).nbytes for n in gemms)
    loaded = sum(getattr(w16, n).nbytes for n in gemms)
    assert kept < 0.6 * loaded, (kept, loaded)


def test_tensor_parallel_ranks_cut_whole_blocks():
    cfg = TINY8.replace(tp_degree=2)
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(1))
    full = dsa_jax.fold_weights(cfg.replace(tp_degree=1), hf)
    ranks = [dsa_jax.fold_weights(cfg, hf, r) for r in range(2)]
    for name, axis in (("q_proj", 0), ("u_k", 0), ("u_v", 0), ("o_proj", 1)):
        np.testing.assert_array_equal(
            np.concatenate([np.asarray(fp8.dense(getattr(w, name)), np.float32)
                            for w in ranks], axis),
            np.asarray(fp8.dense(getattr(full, name)), np.float32), err_msg=name)
    with pytest.raises(WeightError, match="q_b_proj.weight.*block boundary"):
        dsa_jax.fold_weights(cfg.replace(weight_block=(48, 32)), quantize_hf_tensors(
            dsa_jax.init_random_hf_tensors(cfg.replace(param_dtype="float32"),
                                           jax.random.key(1)), (48, 32)), 1)


def _serve(cfg, w, x):
    """Prefill, two decodes (one sequence inactive), a 3-row verify, a rewind, a context row
    and a decode: every `y` and `sel`."""
    state = dsa_jax.init_state(cfg, num_seqs=2, kv_scale=0.5)
    out = []
    y, state, sel = dsa_jax.prefill(cfg, w, state, x[:, :70], num_tokens=[70, 41])
    out += [y, sel]
    for t in range(2):
        y, state, sel = dsa_jax.decode(cfg, w, state, x[:, 70 + t], active=[True, t == 0])
        out += [y, sel]
    y, state, sel = dsa_jax.decode_k(cfg, w, state, x[:, 72:75])
    out += [y, sel]
    state = dsa_jax.rewind(cfg, state, state.lengths - 2)
    state = dsa_jax.write_kv_row(cfg, w, state, x[:, 75])
    y, state, sel = dsa_jax.decode(cfg, w, state, x[:, 76])
    return out + [y, sel, state.latent, state.index_k]


# The kernels in interpret mode read the blocks: a layer-level interpret run (--long).
STEP_CASES = [CASES[0], pytest.param(TINY8.replace(weight_block=(32, 40)), id="tiny-ragged",
                                      marks=pytest.mark.long),  # CI time: the folds' test
              CASES[2], pytest.param(TINY8.replace(implementation="pallas-interpret"),
                                     id="tiny-kernels", marks=pytest.mark.long),
              pytest.param(TINY8.replace(implementation="pallas"), id="tiny-compiled",
                           marks=pytest.mark.gpu),
              pytest.param(CASES[2].values[0].replace(implementation="pallas"),
                           id="odd-compiled", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("cfg", STEP_CASES)
def test_every_step_gives_the_bits_of_the_dequantized_weights(cfg):
    """xla: the blocks dequantized in the step. pallas-interpret: the row-invariant GEMMs
    (decode, verify, the co-launched q_b, the row-metadata launch's x projection over
    `StackedRows`) and the per-head U_k / U_v kernels read the blocks, a prompt's XLA GEMMs
    dequantize them. Every output is the bf16 weights' path's, `==`."""
    _, (w8, w16) = _pair(cfg, key=3)
    x = T.random_rows(4, 2, 80, cfg.hidden_size)
    got = _serve(cfg, w8, x)
    want = _serve(cfg.replace(param_dtype="bfloat16"), w16, x)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"output {i}")


def test_the_serving_step_under_your_own_jit_takes_fp8_weights():
    cfg = TINY8
    _, (w8, _) = _pair(cfg, key=5)
    x = T.random_rows(6, 2, cfg.hidden_size)
    step = dsa_jax.serving_step(cfg, "decode")
    state = dsa_jax.init_state(cfg, num_seqs=2)
    y, _, sel = step.jit(lambda w, s, x: step(w, s, x))(w8, state, x)
    y0, _, sel0 = dsa_jax.decode(cfg, w8, dsa_jax.init_state(cfg, num_seqs=2), x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(sel), np.asarray(sel0))


def test_fp8_weights_match_the_reference_on_the_dequantized_tensors():
    """The reference dequantizes the fp8 checkpoint; the block computes on those weights
    rounded to bf16: within the activations' bf16 roundings (5 u, as bf16 weights are held),
    on the weights rounded as the block rounds them."""
    cfg = ODD.replace(param_dtype="float8_e4m3fn", weight_block=(4, 8))
    hf, (w8, _) = _pair(cfg, key=12)
    deq = dsa_jax.weights.dequantize_fp8(hf, block=cfg.weight_block)
    hf16 = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32))
            for k, v in deq.items()}
    x = T.random_rows(13, 2, 60, cfg.hidden_size)
    y, state, _ = dsa_jax.prefill(cfg, w8, dsa_jax.init_state(cfg, 2), x)
    for b in range(2):
        ref = dsa_jax.reference.forward(cfg, hf16, x[b])
        T.assert_rel_close(y[b], ref.y, 5 * T.unit_roundoff(jnp.bfloat16), f"sequence {b}")
    # the reference reads the fp8 checkpoint itself at its dequantized values
    np.testing.assert_array_equal(np.asarray(dsa_jax.reference.forward(cfg, hf, x[0]).y),
                                  np.asarray(dsa_jax.reference.forward(cfg, deq, x[0]).y))


def test_an_fp8_checkpoint_file_loads_as_fp8(tmp_path):
    cfg = TINY8
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(7))
    path = str(tmp_path / "model.safetensors")
    save_file({f"model.layers.0.self_attn.{k}": np.asarray(v) for k, v in hf.items()}, path)
    got = dsa_jax.load_hf_layer(path, cfg, 0)
    T.assert_trees_bitwise_equal(jax.tree.leaves(got),
                                 jax.tree.leaves(dsa_jax.fold_weights(cfg, hf)))
    assert isinstance(got.o_proj, fp8.Fp8Block)


def test_power_of_two_e8m0_scales_fold_as_fp32_scales():
    """The scale forms the loader takes: e8m0 scales (powers of two, as MX-style releases
    store them) become the fp32 scale grid; the fp8 weights give the dequantized bits."""
    import ml_dtypes

    cfg = TINY8
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(6))
    e8m0 = {k: np.exp2(np.round(np.log2(v))).astype(ml_dtypes.float8_e8m0fnu)
            if k.endswith(fp8.SCALE_SUFFIX) else v for k, v in hf.items()}
    w8 = dsa_jax.fold_weights(cfg, e8m0)
    assert w8.o_proj.scale.dtype == jnp.float32
    T.assert_trees_bitwise_equal(tuple(fp8.dense(f) for f in w8), tuple(
        dsa_jax.fold_weights(cfg.replace(param_dtype="bfloat16"), e8m0)))


@pytest.mark.parametrize("how, match", [
    ("missing scale", r"'q_b_proj.weight' is float8_e4m3fn without its scale"),
    ("wrong grid", r"scale of 'o_proj.weight' has shape \[3, 8\].*needs \[8, 8\]"),
    ("scale beside a dense tensor", r"scale 'indexer.weights_proj.weight_scale_inv' is there"),
    ("nan scale", r"scale of 'kv_b_proj.weight' holds 1 non-finite"),
    ("inf scale", r"scale of 'q_a_proj.weight' holds 1 non-finite"),
    ("e5m2 weight", r"'indexer.wk.weight' is float8_e5m2; weights kept as fp8 are"),
])
def test_a_bad_fp8_checkpoint_is_refused_by_name(how, match):
    cfg = TINY8
    hf = dsa_jax.init_random_hf_tensors(cfg, jax.random.key(8))
    bad = dict(hf)
    if how == "missing scale":
        del bad["q_b_proj.weight_scale_inv"]
    elif how == "wrong grid":
        bad["o_proj.weight_scale_inv"] = np.ones((3, 8), np.float32)
    elif how == "scale beside a dense tensor":
        bad["indexer.weights_proj.weight_scale_inv"] = np.ones((1, 8), np.float32)
    elif how in ("nan scale", "inf scale"):
        name = "kv_b_proj.weight" if how == "nan scale" else "q_a_proj.weight"
        s = np.array(bad[name + "_scale_inv"])
        s[1, 0] = np.nan if how == "nan scale" else np.inf
        bad[name + "_scale_inv"] = s
    else:
        bad["indexer.wk.weight"] = np.asarray(bad["indexer.wk.weight"]).astype(
            jnp.float8_e5m2)
    with pytest.raises(WeightError, match=match):
        dsa_jax.fold_weights(cfg, bad)


def test_a_bad_weight_block_is_refused():
    with pytest.raises(ConfigError, match="weight_block must be two positive integers"):
        TINY8.replace(weight_block=(32, 0))


def test_the_step_dequantizes_on_xla_and_passes_the_blocks_to_the_kernels(monkeypatch):
    """`implementation="auto"` is 'xla' on a CPU (the step sees the bf16 weights) and the
    compiled kernels on a GPU, which read the blocks, as they do in interpret mode."""
    cfg = TINY8.replace(implementation="auto")
    _, (w8, w16) = _pair(cfg, key=9)
    dense = fp8.compute_weights(cfg, w8)
    assert not any(fp8.is_fp8(f) for f in dense)
    T.assert_trees_bitwise_equal(tuple(dense), tuple(w16))
    assert fp8.compute_weights(cfg.replace(implementation="pallas-interpret"), w8) is w8
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert fp8.compute_weights(cfg, w8) is w8


def _dense_model(mw):
    """Model weights with every fp8 field of every layer dequantized (the bf16 model)."""
    return mw._replace(layers=tuple(type(w)(*[fp8.dense(f) for f in w]) for w in mw.layers))


def test_every_kernel_gemm_over_fp8_blocks_runs_at_the_bf16_weights_tiles():
    """On Hopper the GEMM kernel's dot over dequantized fp8 tiles sums in the bf16 weight's
    order only where the MMA's M side (the rows, or the weight's columns of a `swap_ab` tile)
    is 64 or more (`matmul.FP8_MIN_BLOCK_M`; interpret mode cannot show the difference), so
    the kernel refuses a narrower one over an fp8 weight, and every GEMM of the
    steps and the scanned model picks its tiles for the fp8 weight it reads: the shared
    decode front (its qi GEMM), the co-launched q_b, the row metadata's x projection, U_k,
    U_v. Traced (abstract shapes) at 1, 2 and max_verify rows per sequence."""
    from dsa_jax import model as M
    from dsa_jax.pallas import matmul as mm

    v, w = jnp.ones((1, 64), jnp.float32), fp8.quantize_blocks(
        np.random.default_rng(0).standard_normal((40, 64), np.float32), (32, 32))
    with pytest.raises(ValueError, match=r"block_m=16 \(swap_ab=False\) over an fp8 weight"):
        mm.matmul_pallas(v, w, interpret=True, block_m=16, swap_ab=False)
    with pytest.raises(ValueError, match=r"block_n=32 \(swap_ab=True\) over an fp8 weight"):
        mm.matmul_pallas(v, w, interpret=True, block_n=32)  # 1 row: a transposed tile
    cfg = TINY8.replace(implementation="pallas-interpret")
    w8 = _pair(cfg)[1][0]
    state = dsa_jax.init_state(cfg, num_seqs=2, kv_scale=1 / 64)
    x = T.random_rows(1, 2, cfg.max_verify, cfg.hidden_size)
    for rows in sorted({1, 2, cfg.max_verify}):
        jax.eval_shape(lambda s, xx: dsa_jax.decode_k(cfg, w8, s, xx), state, x[:, :rows])
    jax.eval_shape(lambda s, xx: dsa_jax.prefill(cfg, w8, s, xx), state, x)
    mcfg = M.ModelConfig(cfg, vocab_size=37)
    weights = M.init_model(mcfg, jax.random.key(1))
    ms = M.init_model_state(mcfg, 2, 2 * cfg.blocks_per_seq,
                            np.arange(2 * cfg.blocks_per_seq, dtype=np.int32).reshape(2, -1))
    jax.eval_shape(lambda w, s, t, n: M.forward(mcfg, w, s, t, n),
                   M.stack_weights(mcfg, weights), ms, jnp.zeros((2, 1), jnp.int32),
                   jnp.ones((2,), jnp.int32))


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas-interpret",
                                                      marks=pytest.mark.long), PALLAS])
def test_the_scanned_model_gives_the_bits_of_its_dequantized_weights(impl):
    """The model's scan over stacked fp8 layers (`Fp8Block` and `StackedRows` stacks, read in
    place by the kernels at the layer's index) against the same model on the bf16 weights,
    and against its own unrolled layers: every logit and selection `==`."""
    from dsa_jax import model as M

    cfg = ODD.replace(param_dtype="float8_e4m3fn", weight_block=(4, 8),
                      cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16",
                      implementation=impl, indexer_types=("full", "shared", "shared", "full"))
    m8 = M.ModelConfig(cfg, vocab_size=37)
    m16 = M.ModelConfig(cfg.replace(param_dtype="bfloat16"), vocab_size=37)
    w8 = M.init_model(m8, jax.random.key(1))
    assert isinstance(w8.layers[0].o_proj, fp8.Fp8Block)
    scanned = jax.jit(M.forward, static_argnums=0, donate_argnums=2)  # as tests/test_model.py
    unrolled = jax.jit(M.forward_unrolled, static_argnums=0, donate_argnums=2)
    runs = {}
    for name, mcfg, w in (("fp8", m8, w8), ("bf16", m16, _dense_model(w8))):
        b, nb, mb = 2, 30, cfg.blocks_per_seq
        tables = np.random.default_rng(2).permutation(nb)[:b * mb].reshape(b, mb)
        ms = M.init_model_state(mcfg, b, nb, tables.astype(np.int32))
        stacked, states = M.stack_weights(mcfg, w), tuple(M.unfold_state(mcfg, ms))
        rng = np.random.default_rng(3)
        out = []
        for rows, n_new in ((8, [8, 5]), (4, [1, 4]), (4, [3, 0])):
            tokens = jnp.asarray(rng.integers(0, 37, (b, rows)), jnp.int32)
            n = jnp.asarray(n_new, jnp.int32)
            logits, ms, sel = scanned(mcfg, stacked, ms, tokens, n)
            out += [logits, sel]
            if name == "fp8":
                want, states, want_sel = unrolled(mcfg, w, states, tokens, n)
                T.assert_trees_bitwise_equal((logits, sel), (want, want_sel))
        runs[name] = out
    T.assert_trees_bitwise_equal(runs["fp8"], runs["bf16"])


@pytest.mark.long  # CI time; the scanned model's test above runs the same forward in CI
def test_the_engine_serves_fp8_weights_with_the_tokens_of_their_bf16_weights():
    """`Engine` (the serving loop, speculation on) over fp8 layers: greedy tokens equal to
    the same model's on the dequantized bf16 weights."""
    from dsa_jax import model as M
    from dsa_jax.engine import Engine

    cfg = TINY8.replace(max_context=256)
    m8 = M.ModelConfig(cfg, vocab_size=61)
    m16 = M.ModelConfig(cfg.replace(param_dtype="bfloat16"), vocab_size=61)
    w8 = M.init_model(m8, jax.random.key(4))
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 61, 30 + 7 * i)]
               for i in range(3)]
    out = []
    for mcfg, w in ((m8, w8), (m16, _dense_model(w8))):
        eng = Engine(mcfg, w, max_seqs=3, num_blocks=48, speculate=2)
        reqs = [eng.submit(p, 6) for p in prompts]
        eng.run_until_done()
        out.append([r.output for r in reqs])
    assert out[0] == out[1] and all(len(t) == 6 for t in out[0])


@pytest.mark.gpu
def test_glm53_flash_fp8_weights_give_the_bits_of_their_bf16_weights_compiled():
    """GLM-5.3-Flash shapes, 128 x 128 blocks, the compiled kernels: a 2100-token prompt in
    two chunks, decodes with an inactive row, a verify, a rewind and a decode; every `y`,
    `sel` and cache `==` the same checkpoint dequantized at load."""
    from dsa_jax.shapes import glm53_flash

    cfg = glm53_flash(max_context=4096, implementation="pallas", param_dtype="float8_e4m3fn")
    _, (w8, w16) = _pair(cfg, key=7)
    def size(w):
        return sum(a.nbytes for a in jax.tree.leaves(w))
    assert size(w8) < 0.52 * size(w16)  # the checkpoint's bytes, not 2x
    x = T.random_rows(8, 2, 2110, cfg.hidden_size, dtype=jnp.bfloat16)
    runs = []
    for c, w in ((cfg, w8), (cfg.replace(param_dtype="bfloat16"), w16)):
        state = dsa_jax.init_state(c, num_seqs=2, kv_scale=1 / 64)
        out = []
        for a, b in ((0, 1500), (1500, 2100)):
            y, state, sel = dsa_jax.prefill(c, w, state, x[:, a:b])
            out += [y, sel]
        y, state, sel = dsa_jax.decode(c, w, state, x[:, 2100], active=[True, False])
        out += [y, sel]
        y, state, sel = dsa_jax.decode_k(c, w, state, x[:, 2101:2104])
        out += [y, sel]
        state = dsa_jax.rewind(c, state, state.lengths - 2)
        y, state, sel = dsa_jax.decode(c, w, state, x[:, 2104])
        runs.append(out + [y, sel, state.latent, state.index_k, state.pool_keys])
    T.assert_trees_bitwise_equal(runs[0], runs[1])
