"""The raw Triton top-k (`pallas/pool_topk_triton.py`, `PoolTopkTuning(backend="triton")`).

On the CPU: the kernel's logic in Triton's interpreter (torch CPU tensors, in a subprocess:
the interpreter is switched on by TRITON_INTERPRET before triton is imported, which must not
leak into this process) against the selection's total order with `==`, on ties, -inf tails,
rows with fewer finite scores than k, all -inf rows, -0.0 and odd P and k; then everything
around the kernel: the backend choice, the errors where jax-triton is missing or interpret
mode is asked for, the argument checks. On a GPU (`gpu` marker; needs jax-triton): the
compiled kernel through jax-triton `==` lax.top_k at odd and GLM-5.3-Flash shapes, and in the
selection.
"""

import json
import os
import subprocess
import sys
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import select, shapes
from dsa_jax import testing as T
from dsa_jax.pallas import pool_topk as pt
from dsa_jax.pallas import pool_topk_triton as ptt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, seed, rows, P, k, live per row, ties): odd P and k, k == P, k == 1, short rows.
CASES = [
    ("p300-k37", 1, 3, 300, 37, [300, 150, 37], False),
    ("p300-k37-ties", 2, 3, 300, 37, [300, 150, 37], True),
    ("p1000-k200-short", 3, 3, 1000, 200, [1000, 511, 3], True),
    ("p64-k64", 4, 2, 64, 64, [64, 33], True),
    ("p70-k1", 5, 2, 70, 1, [70, 0], False),
    ("p1-k1", 6, 2, 1, 1, [1, 0], False),
]


def special_rows() -> list[tuple[str, np.ndarray, int]]:
    """(name, scores [N, P], k): +0.0 / -0.0 mixed with ties and -inf; all equal; all -inf."""
    z = np.where(np.arange(96) % 2 == 0, 0.0, -0.0).astype(np.float32)  # [96]
    z[::7] = 1.5
    z[5::11] = -np.inf
    # finite scores in the first quarter of the lanes but one (the kernel's full path), and
    # in the first quarter only (its prefix path): P 300 pads to 512, quarter 128, k 37
    far = np.array(T.topk_scores(9, 2, 300, [100, 100], ties=True))
    far[0, 299] = 3.0
    return [("signed-zeros", np.stack([z, z[::-1].copy()]), 40),
            ("all-equal-all-neginf", np.stack([np.full(200, 0.25, np.float32),
                                               np.full(200, -np.inf, np.float32)]), 100),
            ("prefix-and-not", far, 37),
            # 128 lanes, KP 64: no quarter branch, the half one only (its row of 50 live)
            ("half-prefix-only", np.asarray(T.topk_scores(10, 2, 96, [50, 96], ties=True)),
             40)]


# ------------------------------------------------------------------ the kernel, interpreted

_INTERPRETED = r"""
import json, sys
import numpy as np
import torch
from dsa_jax import testing as T
from dsa_jax.pallas import pool_topk_triton as ptt
from dsa_jax.pallas import triton_topk_kernel as tk
from tests.test_pool_topk_triton import CASES, special_rows

def run(scores, k):
    n, p = scores.shape
    s = torch.from_numpy(np.array(scores, np.float32))
    out = torch.full((n, k), -7, dtype=torch.int32)
    cu, ci = (torch.zeros(ptt.scratch_shape(n, p, k), dtype=torch.int32) for _ in "ab")
    tk.pool_topk_kernel[(n,)](s, out, cu, ci, **ptt.kernel_constants(p, k))
    return out.numpy()

inputs = [(name, np.asarray(T.topk_scores(seed, n, p, live, ties)), k)
          for name, seed, n, p, k, live, ties in CASES] + special_rows()
results = []
for name, scores, k in inputs:
    ok = np.array_equal(run(scores, k), T.topk_definition(scores, k))
    results.append([name, bool(ok)])
print(json.dumps(results))
"""


def test_kernel_in_triton_interpreter_equals_the_total_order():
    pytest.importorskip("triton", reason="the 'triton' package (test extra) runs the "
                                         "kernel's logic in its interpreter")
    pytest.importorskip("torch", reason="Triton's interpreter takes torch tensors")
    env = {**os.environ, "TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(CASES) + len(special_rows())
    assert [r for r in results if not r[-1]] == []


@pytest.mark.parametrize("p,k", [(4096, 512), (300, 37), (96, 40), (1, 1)])
def test_kernel_compiles_for_hopper(p, k):
    """The kernel compiled for sm_90 on the CPU (Triton's compiler and ptxas need no GPU):
    what jax-triton compiles on the H200, so a lowering error shows here first."""
    triton = pytest.importorskip("triton", reason="the 'triton' package (test extra)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsa_jax.pallas import triton_topk_kernel as tk
    consts = ptt.kernel_constants(p, k)
    sig = {"s_ptr": "*fp32", "out_ptr": "*i32", "cu_ptr": "*i32", "ci_ptr": "*i32",
           **{name: "constexpr" for name in consts}}
    compiled = triton.compile(ASTSource(fn=tk.pool_topk_kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": ptt.NUM_WARPS, "num_stages": 1})
    assert "pool_topk_kernel" in compiled.asm["ptx"]


# ------------------------------------------------------------------ around the kernel (CPU)


def test_backend_is_checked():
    with pytest.raises(ValueError, match="backend='cuda'"):
        pt.PoolTopkTuning(backend="cuda")
    assert pt.PoolTopkTuning().backend == "auto"  # see PoolTopkTuning.backend


def test_auto_picks_triton_for_a_prompts_rows_and_the_prefix_lanes():
    """The "auto" rule is static on the row count (AUTO_TRITON_MIN_ROWS); interpret mode runs
    the Pallas kernel under backend "auto". The kernel's prefix branches: a quarter and a half
    of the padded lanes, each where it holds KP lanes at least."""
    c = ptt.kernel_constants(4096, 512)
    assert (c["QUARTER"], c["HALF"], c["KP"], c["DIGIT_BITS"]) == (1024, 2048, 512, 4)
    c = ptt.kernel_constants(300, 37)  # 512 lanes, KP 64
    assert (c["QUARTER"], c["HALF"]) == (128, 256)
    assert ptt.kernel_constants(4096, 1500)["QUARTER"] == 0  # KP 2048
    assert ptt.kernel_constants(4096, 1500)["HALF"] == 2048
    assert (ptt.kernel_constants(96, 40)["QUARTER"], ptt.kernel_constants(96, 40)["HALF"]) == (
        0, 64)  # 128 lanes, KP 64: the half only
    assert (ptt.kernel_constants(1, 1)["QUARTER"], ptt.kernel_constants(1, 1)["HALF"]) == (0, 0)
    assert ptt.scratch_shape(9000, 4096, 512) == (9000, 512)
    k = pt.PoolTopkTuning(backend="auto")
    m = pt.AUTO_TRITON_MIN_ROWS
    assert pt.runs_triton(k, m, interpret=False) and not pt.runs_triton(k, m - 1, False)
    assert not pt.runs_triton(k, m, interpret=True)
    assert not pt.runs_triton(pt.PoolTopkTuning(backend="pallas"), 9000, False)
    assert pt.runs_triton(pt.PoolTopkTuning(backend="triton"), 1, False)
    s = T.topk_scores(5, 2, 50, [50, 20], ties=True)
    jaxpr = str(jax.make_jaxpr(lambda s: pt.pool_topk_pallas(s, 5, interpret=True,
                                                             backend="auto"))(s))
    assert "pallas_call" in jaxpr


def test_bad_k_and_long_rows_raise_before_any_import():
    with pytest.raises(ValueError, match="k=51"):
        ptt.pool_topk_triton(jnp.zeros((2, 50)), 51)
    with pytest.raises(ValueError, match="KERNEL_MAX_P=4096"):
        ptt.pool_topk_triton(jnp.zeros((1, 4097)), 8)


@pytest.mark.parametrize("absent,named", [("triton", "'triton' package"),
                                          ("jax_triton", "'jax-triton' package")])
def test_missing_package_is_named(monkeypatch, absent, named):
    """Asked for and not installed: MissingDependencyError naming the package; no fallback."""
    if absent == "jax_triton":  # triton "present", jax-triton not
        monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, absent, None)  # import raises ImportError
    with pytest.raises(ptt.MissingDependencyError, match=named):
        ptt.pool_topk_triton(jnp.zeros((2, 50)), 5)
    with pytest.raises(ptt.MissingDependencyError, match=named):
        pt.pool_topk_pallas(jnp.zeros((2, 50)), 5, backend="triton")


def test_triton_backend_refuses_interpret_mode():
    s = T.topk_scores(3, 2, 50, [50, 20], ties=True)
    with pytest.raises(ValueError, match="no Pallas interpret mode"):
        T.run_op("pool_topk", "pallas-interpret", s, 5, kernel_options=dict(backend="triton"))
    cfg = shapes.ODD.replace(implementation="pallas-interpret")
    with pytest.raises(ValueError, match="no Pallas interpret mode"):
        select.top_pools(cfg, s, pt.PoolTopkTuning(backend="triton"))
    with pytest.raises(ValueError, match="writes no token slots"):
        pt.pool_topk_expand_pallas(s, 5, jnp.zeros(2, jnp.int32), jnp.ones(2, bool),
                                   pt.Expansion(4, 23, True), interpret=True,
                                   tuning=pt.PoolTopkTuning(backend="triton"))


def test_xla_implementation_ignores_the_kernel_choice():
    """implementation="xla" runs lax.top_k whatever the tuning names (no kernel runs)."""
    cfg = shapes.ODD.replace(implementation="xla")
    s = T.topk_scores(4, 3, 60, [60, 30, 0], ties=True)
    k = min(cfg.select_k, 60)
    got = select.top_pools(cfg, s, pt.PoolTopkTuning(backend="triton"))
    chex.assert_trees_all_equal(np.asarray(got), T.topk_definition(s, k))


# ------------------------------------------------------------------ compiled (GPU)


def _gpu_topk(s, k):
    pytest.importorskip("jax_triton", reason="the raw Triton top-k needs jax-triton "
                                             "(gpu extra)")
    return np.asarray(pt.pool_topk_pallas(s, k, tuning=pt.PoolTopkTuning(backend="triton")))


@pytest.mark.gpu
def test_compiled_equals_the_total_order():
    for name, seed, n, p, k, live, ties in CASES:
        s = T.topk_scores(seed, n, p, live, ties)
        chex.assert_trees_all_equal(_gpu_topk(s, k), T.topk_definition(s, k),
                                    custom_message=name)
    for name, s, k in special_rows():
        chex.assert_trees_all_equal(_gpu_topk(jnp.asarray(s), k),
                                    T.topk_definition(s, k), custom_message=name)


@pytest.mark.gpu
def test_compiled_at_glm53_flash_shapes():
    """k 512 of P 4096: a padded decode, a verify, short rows, ties, live prefixes at the
    prefix branches' edges (a quarter, a half, one more); batch dims kept."""
    cfg = shapes.glm53_flash()
    p, k = cfg.num_pools, cfg.select_k
    for ties in (False, True):
        live = [p, 0, 0, 0, p, p, p, 0, p // 2 + 1, k, k - 1, 3, p // 4, p // 4 + 1, p // 2]
        s = T.topk_scores(11 + ties, len(live), p, live, ties).reshape(3, 5, p)
        got = _gpu_topk(s, k)
        chex.assert_shape(got, (3, 5, k))
        chex.assert_trees_all_equal(got, T.topk_definition(s, k))


@pytest.mark.gpu
def test_the_default_at_a_prompts_rows():
    """The default tuning (backend "auto": the Triton kernel from AUTO_TRITON_MIN_ROWS rows)
    at GLM-5.3-Flash's P and k: rows with a causal prompt's
    candidate counts (fewer than k, exactly k, up to P), ties."""
    pytest.importorskip("jax_triton", reason="the raw Triton top-k needs jax-triton "
                                             "(gpu extra)")
    cfg = shapes.glm53_flash()
    p, k, n = cfg.num_pools, cfg.select_k, pt.AUTO_TRITON_MIN_ROWS + 37
    assert pt.runs_triton(pt.PoolTopkTuning(), n, interpret=False)
    live = [min(p, (2 * i + 1) % (p + 1)) for i in range(n)]
    for ties in (False, True):
        s = T.topk_scores(21 + ties, n, p, live, ties)
        got = np.asarray(pt.pool_topk_pallas(s, k))
        chex.assert_trees_all_equal(got, T.topk_definition(s, k))


@pytest.mark.gpu
def test_selection_with_the_triton_top_k():
    """`select_slots` and `top_pools` with the Triton backend: the xla selection, bit for bit."""
    pytest.importorskip("jax_triton", reason="needs jax-triton (gpu extra)")
    cfg = shapes.glm53_flash(max_context=4096).replace(implementation="pallas")
    p = cfg.num_pools  # 1024, k 512
    s = T.topk_scores(7, 6, p, [p, 0, 100, 3, p, 1], ties=True).reshape(2, 3, p)
    pos = jnp.asarray([[4095, 4094, 400], [11, 4095, 5]], jnp.int32)
    valid = jnp.asarray([[True, False, True], [True, True, True]])
    tuning = pt.PoolTopkTuning(backend="triton")
    want = select.expand_selection(cfg.replace(implementation="xla"),
                                   pt.pool_topk_xla(s, cfg.select_k), pos, valid)
    chex.assert_trees_all_equal(select.select_slots(cfg, s, pos, valid, tuning=tuning), want)
    chex.assert_trees_all_equal(select.top_pools(cfg, s, tuning),
                                pt.pool_topk_xla(s, cfg.select_k))
