"""Top-k pool indices by a raw Triton kernel called through jax-triton: `pool_topk_xla`'s
indices, bit for bit, with what the Pallas-Triton lowering lacks (`tl.histogram`, `tl.sort`).

The kernel (`triton_topk_kernel.py`) runs one program per row with the row in registers: a
radix select of the k-th largest key in histogram passes (by default 8 of 4-bit digits), the
k winners compacted and sorted on a composite key (score, then index). The Pallas kernel
(`pool_topk.py`) needs 16 counting passes and a k^2 ranking for the same answer.

jax-triton and triton are optional GPU dependencies (`pip install 'dsa_jax[gpu]'`): they are
imported when this kernel is called, and their absence raises `MissingDependencyError` naming
the package; nothing falls back to another kernel. The twin is `pool_topk.pool_topk_xla`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsa_jax.pallas.common import next_pow2, with_overrides

# The row is held in registers; the selection runs lax.top_k past this (as for the Pallas
# kernel, `pool_topk.KERNEL_MAX_P`).
KERNEL_MAX_P = 4096
METHODS = {"radix": 0, "topk": 1, "sort": 2, "sample": 3}
JAX_TRITON_REQUIREMENT = "jax-triton==0.3.1"


class MissingDependencyError(ImportError):
    """The raw Triton top-k was asked for and jax-triton or triton is not installed."""


# "auto" runs "sample" up to this many rows (a decode's 4 to 256 rows: fastest measured there)
# and "radix" beyond (a 9000-row prompt), both with 4-bit digits (at 9000 rows 635 vs 698 us
# for 8-bit ones, h200-topk-triton-20261202-s16-call3.json). Nothing was measured between 256
# and 9000 rows: the threshold sits at a decode batch of 256 sequences x 4 rows.
AUTO_SAMPLE_MAX_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class TritonTopkTuning:
    """Launch parameters of `pool_topk_triton`.

    method: "radix" (histogram select, the k winners compacted and sorted), "sample" (a
    threshold from the maxima of blocks of 4 keys, the candidates above it compacted and
    sorted; radix where they do not fit), "topk" (Triton's bitonic `tl.topk` over the whole
    row), "sort" (`tl.sort` of the whole row), or "auto" (the default): "sample" for up to
    `AUTO_SAMPLE_MAX_ROWS` rows, "radix" beyond, a static rule on the row count (`resolved`).
    digit_bits: radix (and sample's radix passes): bits per histogram pass (8: 4 passes of
    256 bins; 4: 8 passes of 16); None: 4 under "auto" (both of its methods: 4-bit radix
    measured faster at a prompt's 9000 rows, h200-topk-triton-20261202-s16-call3.json), else
    8.
    num_warps: Triton's. short_rows: radix and sample: a row with fewer than k scores above
    -inf skips the passes (its kth is -inf); a row of only -inf (padding) stores 0..k-1
    directly. prefix (radix with short_rows): a row whose scores above -inf all lie in the
    first quarter (or half) of the padded row is selected over that quarter (half) alone: a
    prompt's row of r tokens has its r / 4 candidate pools first, so most of a long prompt's
    rows hold a quarter or a half of the pools live; the same indices either way (the lanes
    left out are -inf, below the kth). On the H200 a 9000-row prompt's top-k took 475 vs 635
    us with it (h200-topk-triton-20261204-s22-call1.json); "sample" (decode rows, all live at
    full context) takes no branches: with them its kernel took 27.7 vs 13.8 us at 64 rows and
    its call twice the host time (h200-topk-triton-20261204-s22-call4-5.json). H200 sweeps:
    benchmarks/results/h200-topk-triton-2026120*-*.json."""
    method: str = "auto"
    digit_bits: int | None = None
    num_warps: int = 8
    short_rows: bool = True
    prefix: bool = True

    def __post_init__(self):
        if self.method not in METHODS and self.method != "auto":
            raise ValueError(f"method={self.method!r}: must be 'auto' or one of "
                             f"{sorted(METHODS)}")
        if self.digit_bits not in (None, 4, 8):
            raise ValueError(f"digit_bits={self.digit_bits} must be 4 or 8 (or None)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two in [1, 16]")

    def resolved(self, rows: int) -> TritonTopkTuning:
        """This tuning for `rows` rows, "auto" and a None digit width decided."""
        method = self.method
        if method == "auto":
            method = "sample" if rows <= AUTO_SAMPLE_MAX_ROWS else "radix"
        bits = self.digit_bits
        if bits is None:
            bits = 4 if self.method == "auto" else 8
        return dataclasses.replace(self, method=method, digit_bits=bits)


def load_jax_triton():
    """(jax_triton, the kernel module), or `MissingDependencyError` naming what is missing."""
    what = ("the raw Triton top-k (PoolTopkTuning(backend='triton'), or 'auto' (the default) "
            "compiled for pool_topk.AUTO_TRITON_MIN_ROWS or more rows: a prompt's)")
    fix = "Install 'dsa_jax[gpu]', or pass PoolTopkTuning(backend='pallas')"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} needs the 'triton' package (>= 3.6, a GPU install), which cannot be "
            f"imported here: {e}. {fix}") from e
    try:
        import jax_triton
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} needs the 'jax-triton' package ({JAX_TRITON_REQUIREMENT}), which cannot be "
            f"imported here: {e}. {fix}") from e
    from dsa_jax.pallas import triton_topk_kernel
    return jax_triton, triton_topk_kernel


def check_args(p: int, k: int) -> None:
    """Raise ValueError, before anything runs, for a k or a row length the kernel refuses."""
    if not 1 <= k <= p:
        raise ValueError(f"pool_topk_triton: k={k} must be in [1, P={p}]")
    if p > KERNEL_MAX_P:
        raise ValueError(f"pool_topk_triton: rows of P={p} pools exceed the kernel's "
                         f"KERNEL_MAX_P={KERNEL_MAX_P} (the row is held in registers); use "
                         f"pool_topk_xla")


def pool_topk_triton(scores: jax.Array, k: int, *,
                     tuning: TritonTopkTuning = TritonTopkTuning(), **overrides) -> jax.Array:
    """`pool_topk_xla` as a raw Triton kernel (GPU only): the same indices, bit for bit.

    scores [..., P] f32 (no NaN), P <= KERNEL_MAX_P -> [..., k] int32, best first.
    `overrides`: fields of `tuning` by name (`method="topk"`)."""
    tuning = with_overrides(tuning, overrides)
    *lead, p = scores.shape
    check_args(p, k)
    jt, kernels = load_jax_triton()
    n = 1
    for d in lead:
        n *= d
    if n == 0:
        return jnp.zeros((*lead, k), jnp.int32)
    x = scores.reshape(n, p).astype(jnp.float32)  # [N, P]
    tuning = tuning.resolved(n)
    scratch = scratch_shape(n, p, k, tuning)
    out, _, _ = jt.triton_call(
        x, kernel=kernels.pool_topk_kernel,
        out_shape=[jax.ShapeDtypeStruct((n, k), jnp.int32),
                   jax.ShapeDtypeStruct(scratch, jnp.int32),
                   jax.ShapeDtypeStruct(scratch, jnp.int32)],
        grid=(n,), num_warps=tuning.num_warps, num_stages=1, name="pool_topk_triton",
        **kernel_constants(p, k, tuning))
    return out.reshape(*lead, k)


def kernel_constants(p: int, k: int, tuning: TritonTopkTuning, rows: int = 1
                     ) -> dict[str, int]:
    """The kernel's constexpr arguments for `rows` rows of `p` pools and top `k` (blocks of
    at least 2: `tl.topk` does not compile for 1). "sample" runs as "radix" where a quarter
    of the row holds fewer than next_pow2(k) blocks."""
    tuning = tuning.resolved(rows)
    pp, kp = max(2, next_pow2(p)), max(2, next_pow2(k))
    method = _fitting(tuning.method, pp, kp)
    consts = dict(P=p, PP=pp, K=k, KP=kp, SLOTS=scratch_slots(pp, kp, method),
                  METHOD=METHODS[method], DIGIT_BITS=tuning.digit_bits,
                  SHORT_ROWS=tuning.short_rows)
    consts["QUARTER"], consts["HALF"] = prefix_lanes(pp, kp, method, tuning)
    return consts


def _fitting(method: str, pp: int, kp: int) -> str:
    """The method that runs: "sample" needs 4 * KP <= PP lanes (a quarter of the row
    holding KP block maxima), else "radix" runs."""
    return "radix" if method == "sample" and 4 * kp > pp else method


def prefix_lanes(pp: int, kp: int, method: str, tuning: TritonTopkTuning
                 ) -> tuple[int, int]:
    """(QUARTER, HALF): the prefix lengths the kernel may select a row over
    (`TritonTopkTuning.prefix`), each 0 where it does not apply (the tuning, a method other
    than "radix", or a prefix shorter than KP)."""
    if not (tuning.prefix and tuning.short_rows and method == "radix"):
        return 0, 0
    return tuple(n if n >= kp else 0 for n in (pp // 4, pp // 2))  # kp >= 2


def scratch_slots(pp: int, kp: int, method: str) -> int:
    """Scratch slots per row: the radix method's k winners, the sample method's candidates
    (up to 2 * KP), none for the others (1, never touched)."""
    return {"radix": kp, "sample": 2 * kp}.get(method, 1)


def scratch_shape(n: int, p: int, k: int, tuning: TritonTopkTuning) -> tuple[int, int]:
    """Each of the two int32 scratch outputs [N, SLOTS] (compacted keys, indices)."""
    slots = kernel_constants(p, k, tuning, n)["SLOTS"]
    return (n if slots > 1 else 1, slots)
