"""H200: the Pallas top-k (radix select + rank, pallas/pool_topk.py) against lax.top_k at the
shapes the layer feeds it, checked with `==` and timed; kernel variants swept.

    PYTHONPATH=. python3 benchmarks/h200_topk.py

Writes $OUT/h200-topk.json (or ./h200-topk.json). Times: `wall_us`, the median of back-to-back
calls (benchmarks.harness.measure), and `kernel_us`, the device kernel time per call from a
profiler trace (benchmarks.harness.kernel_us).
"""

from __future__ import annotations

import datetime
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import sweep_row, sweep_times
from dsa_jax.pallas import pool_topk as pt

K = 512  # index_topk 2048 / index_kpool 4


def _cases():
    """(name, rows, P, live candidates per row): what the step feeds the top-k. P = 4096 is
    max_context 16K / KP 4; 32768 is the scaling points' 128K ceiling."""
    p = 4096
    return [
        ("decode-b1-padded-r4", 4, p, [p, 0, 0, 0]),
        ("verify-b1-k3-padded-r4", 4, p, [p, p, p, 0]),
        ("decode-b64-padded-r4", 256, p, [p, 0, 0, 0] * 64),
        ("prefill-9000", 9000, p, list((np.arange(9000) + 1) // 4)),
        ("decode-b1-ctx16k-of-128k", 4, 32768, [4096, 0, 0, 0]),
        ("decode-b1-ctx128k", 4, 32768, [32768, 0, 0, 0]),
    ]


VARIANTS = [None, dict(radix_bits=2), dict(radix_bits=4), dict(radix_bits=2, num_warps=8),
            dict(radix_bits=2, rank_block=64), dict(chunk=8192, num_warps=8, radix_bits=2),
            dict(chunk=8192, num_warps=8, radix_bits=4)]


def _scores(rng, n, p, live, ties=False):
    x = rng.standard_normal((n, p)).astype(np.float32)
    if ties:
        x = np.round(x * 8) / 8
    x[np.arange(p)[None, :] >= np.asarray(live)[:, None]] = -np.inf
    return jnp.asarray(x)


def main() -> int:
    out_dir = os.environ.get("OUT", ".")
    res = {"command": "PYTHONPATH=. python3 benchmarks/h200_topk.py",
           "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "jax_version": jax.__version__, "device": jax.devices()[0].device_kind, "k": K,
           "results": [], "errors": []}
    rng = np.random.default_rng(0)
    for name, n, p, live in _cases():
        s = _scores(rng, n, p, live)
        s_ties = _scores(rng, n, p, live, ties=True)
        ref = np.asarray(jax.jit(pt.pool_topk_xla, static_argnums=1)(s, K))
        ref_ties = np.asarray(jax.jit(pt.pool_topk_xla, static_argnums=1)(s_ties, K))
        heavy = n > 1000
        for kw in ["xla", None] + VARIANTS[1:]:
            row = {"case": name, "rows": n, "P": p, "variant": kw or "default"}

            def work(row, kw=kw, s=s, s_ties=s_ties, ref=ref, ref_ties=ref_ties, heavy=heavy):
                if kw == "xla":
                    fn = jax.jit(pt.pool_topk_xla, static_argnums=1)
                else:
                    fn = jax.jit(functools.partial(pt.pool_topk_pallas, backend="pallas",
                                                   **(kw or {})), static_argnums=1)
                    row["equal"] = bool(np.array_equal(np.asarray(fn(s, K)), ref))
                    row["equal_ties"] = bool(np.array_equal(np.asarray(fn(s_ties, K)),
                                                            ref_ties))
                call = functools.partial(fn, s, K)
                row.update(sweep_times(call, heavy, heavy_inner=2))

            sweep_row(res, row, work, os.path.join(out_dir, "h200-topk.json"))
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
