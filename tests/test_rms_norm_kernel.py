"""The RMSNorm kernel (`dsa_jax/pallas/rms_norm.py`) against its jnp definition and a float64
one ("pallas-interpret", and "pallas" under the `gpu` marker), and the property it exists for:
the same bits in every program that calls it.

Tolerance, relative to |w v| / rms: the fp32 sum of n squares carries at most (n - 1) roundings
of u = 2^-24 relative to the sum (positive terms), the mean and eps one each, rsqrt halves
the argument's relative error and adds its own (a few ulps on a GPU: 4 u allowed), the two
products one each: |err| <= ((n + 1) / 2 + 7) u. Between two fp32 implementations: twice that.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dsa_jax import testing as T
from dsa_jax.implementation import rms_norm_op
from dsa_jax.pallas.rms_norm import rms_norm_pallas, rms_norm_xla
from dsa_jax.shapes import tiny

U = 2.0 ** -24
EPS = 1e-5


def _inputs(lead, n, seed):
    rng = np.random.default_rng(seed)
    v = jnp.asarray(rng.standard_normal((*lead, n)) * 3.0, jnp.float32)  # [..., n]
    w = jnp.asarray(1.0 + 0.5 * rng.standard_normal(n), jnp.float32)  # [n]
    return v, w


def _exact(v, w):
    v64, w64 = np.asarray(v, np.float64), np.asarray(w, np.float64)
    inv = 1.0 / np.sqrt(np.mean(v64 * v64, axis=-1, keepdims=True) + EPS)
    return w64 * v64 * inv, np.abs(w64 * v64) * inv  # value, scale of its error


@pytest.mark.parametrize("lead,n", [((1,), 12), ((3, 5), 33), ((2, 4), 128), ((7,), 1536)])
def test_rms_norm_kernel_matches_definition(kernel_impl, lead, n):
    v, w = _inputs(lead, n, seed=n)
    got = np.asarray(T.run_op("rms_norm", kernel_impl, v, w, eps=EPS))
    want = np.asarray(T.run_op("rms_norm", "xla", v, w, eps=EPS))
    exact, scale = _exact(v, w)
    bound = ((n + 1) / 2 + 7) * U
    assert got.shape == v.shape and got.dtype == np.float32
    assert np.all(np.abs(got - exact) <= bound * scale + 1e-30)
    assert np.all(np.abs(want - exact) <= bound * scale + 1e-30)
    assert np.all(np.abs(got - want) <= 2 * bound * scale + 1e-30)


def test_rms_norm_kernel_takes_bf16_rows(kernel_impl):
    """bf16 rows are normalized as their exact f32 values: the same bits."""
    v, w = _inputs((3,), 40, seed=3)
    vb = v.astype(jnp.bfloat16)
    got = rms_norm_pallas(vb, w, EPS, interpret=kernel_impl == "pallas-interpret")
    want = rms_norm_pallas(vb.astype(jnp.float32), w, EPS,
                           interpret=kernel_impl == "pallas-interpret")
    T.assert_trees_bitwise_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("cols,dtype", [((0, 24), jnp.bfloat16), ((7, 33), jnp.float32),
                                        ((40, 1), jnp.bfloat16), ((0, 41), jnp.float16)])
def test_rms_norm_reads_its_columns_in_place_and_writes_the_dtype(impl, cols, dtype):
    """`cols=(start, n)` of a wider v and `dtype=`: `==` the norm of the sliced columns, then
    converted (round to nearest even), for the definition and the kernel alike."""
    v, _ = _inputs((3, 5), 41, seed=9)
    _, w = _inputs((1,), cols[1], seed=10)
    got = T.run_op("rms_norm", impl, v, w, eps=EPS, cols=cols, dtype=dtype)
    want = T.run_op("rms_norm", impl, v[..., cols[0]:cols[0] + cols[1]], w, eps=EPS)
    assert got.dtype == dtype and got.shape == (3, 5, cols[1])
    T.assert_trees_bitwise_equal(np.asarray(got), np.asarray(want.astype(dtype)))


@pytest.mark.parametrize("fn", [rms_norm_xla, functools.partial(rms_norm_pallas, interpret=True)])
def test_rms_norm_refuses_columns_outside_v(fn):
    v, w = _inputs((2,), 16, seed=4)
    with pytest.raises(ValueError, match=r"cols=\(10, 8\) must lie within v's last axis of 16"):
        fn(v, w[:8], EPS, cols=(10, 8))
    with pytest.raises(ValueError, match=r"w has shape \(16,\), expected \(8,\)"):
        fn(v, w, EPS, cols=(0, 8))


def test_rms_norm_reads_a_stacked_weight_in_place(impl):
    """`layer=`: row l of a stacked `w [G, n]` (the model's scan) gives the bits of `w[l]`,
    for the definition and the kernel alike, an index past G clamped (as XLA's dynamic index);
    a stack of the wrong width or a non-scalar index is refused."""
    fn = rms_norm_xla if impl == "xla" else functools.partial(
        rms_norm_pallas, interpret=impl == "pallas-interpret")
    v, _ = _inputs((3, 5), 41, seed=11)
    stack = jnp.stack([_inputs((1,), 33, seed=s)[1] for s in range(3)])  # [G, n]
    run = jax.jit(lambda v, w, layer: fn(v, w, EPS, cols=(7, 33), dtype=jnp.bfloat16,
                                         layer=layer))
    for layer in (0, 1, 2, 7):
        got = run(v, stack, jnp.int32(layer))
        want = fn(v, stack[min(layer, 2)], EPS, cols=(7, 33), dtype=jnp.bfloat16)
        T.assert_trees_bitwise_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match=r"a stacked w must be \[G, 33\]"):
        fn(v, stack[:, :8], EPS, cols=(7, 33), layer=jnp.int32(0))
    with pytest.raises(ValueError, match="layer must be a scalar integer index"):
        fn(v, stack, EPS, cols=(7, 33), layer=jnp.zeros(2, jnp.int32))


def test_rms_norm_op_follows_the_implementation():
    v, w = _inputs((2, 3), 16, seed=5)
    for impl, fn in (("xla", "rms_norm_xla"), ("pallas-interpret", "rms_norm_pallas")):
        jaxpr = str(jax.make_jaxpr(lambda v, w, i=impl: rms_norm_op(
            tiny().replace(implementation=i), v, w, EPS))(v, w))
        assert ("pallas_call" in jaxpr) == (fn == "rms_norm_pallas")


@pytest.mark.gpu
def test_rms_norm_kernel_same_bits_in_any_program():
    """The q_a norm's rows at 64 sequences x 4 rows, normalized in a scan's body (weights
    sliced from a stack, as the scanned model does) and in a plain program: `==` row for row,
    which XLA's own fused reduction did not give (pallas/rms_norm.py)."""
    v, w = _inputs((256,), 1536, seed=11)
    ws = jnp.stack([w * 0.5, w])  # [2, n]

    def scanned(v, ws):
        def body(h, wl):
            return h, rms_norm_pallas(h * 1.0, wl, EPS)
        return lax.scan(body, v, ws)[1][1]

    a = jax.jit(scanned)(v, ws)
    b = jax.jit(lambda v, w: rms_norm_pallas(v, w, EPS))(v, w)
    T.assert_trees_bitwise_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rows,stacked", [(1, True), (256, True), (256, False)])
def test_rms_norm_lowers_for_cuda(rows, stacked):
    """The Triton lowering (on any host) of the q_a norm at GLM-5.3 shapes, its weight alone
    or read in place in a stack: a lowering error (a chained indexer, say) surfaces here,
    before the GPU, where interpret mode accepts it."""
    v = jax.ShapeDtypeStruct((rows, 2336), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 1536) if stacked else (1536,), jnp.float32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)

    def fn(v, w, layer):
        return rms_norm_pallas(v, w, EPS, cols=(0, 1536), dtype=jnp.bfloat16,
                               layer=layer if stacked else None)

    text = jax.jit(fn).trace(v, w, layer).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text
