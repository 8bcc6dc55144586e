"""H200: the pool-score kernel's rows per program (rows of one sequence sharing each key tile)
and warps, at the shapes the layer runs, checked against the XLA twin and timed.

    PYTHONPATH=. python3 benchmarks/h200_pool_rows.py

Writes $OUT/h200-pool-rows.json (or ./h200-pool-rows.json). Times: `wall_us`, the median of
back-to-back calls (benchmarks.harness.measure), and `kernel_us`, the device kernel time per
call from a profiler trace (benchmarks.harness.kernel_us).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import sweep_row, sweep_times
from dsa_jax.pallas import pool_scores as ps

HI, DI, P = 32, 128, 4096  # GLM-5.3-Flash indexer at max_context 16K, index_kpool 4

# (name, B, R, n_cand per row [B, R]): what the step feeds the kernel.
def _cases():
    full = P
    prompt = (np.arange(9000) + 1) // 4
    return [
        ("decode-b64", 64, 1, np.full((64, 1), full)),
        ("decode-b64-padded-r4", 64, 4, np.tile([full, 0, 0, 0], (64, 1))),
        ("verify-b16-r4", 16, 4, np.full((16, 4), full) - np.arange(4)[::-1] // 4),
        ("prefill-9000", 1, 9000, prompt[None, :]),
    ]


VARIANTS = [dict(rows_per_program=rb, num_warps=nw) for rb in (1, 2, 4, 8) for nw in (4, 8)]


def main() -> int:
    out_dir = os.environ.get("OUT", ".")
    res = {"command": "PYTHONPATH=. python3 benchmarks/h200_pool_rows.py",
           "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "jax_version": jax.__version__, "device": jax.devices()[0].device_kind,
           "shape": {"Hi": HI, "Di": DI, "P": P}, "results": [], "errors": []}
    rng = np.random.default_rng(0)
    for name, b, r, n_cand in _cases():
        qi = jnp.asarray(rng.standard_normal((b, r, HI, DI), np.float32))
        w = jnp.asarray(rng.standard_normal((b, r, HI), np.float32) * (HI * DI) ** -0.5)
        keys = jnp.asarray(0.3 * rng.standard_normal((b, P, DI), np.float32))
        nc = jnp.asarray(n_cand.astype(np.int32))
        ref = np.asarray(jax.jit(ps.pool_scores_xla)(qi, w, keys, nc))
        fin = np.isfinite(ref)
        for kw in [None] + VARIANTS:
            row = {"case": name, "B": b, "R": r, "variant": kw or "default"}

            def work(row, kw=kw, name=name, qi=qi, w=w, keys=keys, nc=nc, ref=ref, fin=fin):
                fn = jax.jit(functools.partial(ps.pool_scores_pallas, **(kw or {})))
                out = np.asarray(fn(qi, w, keys, nc))
                row["inf_pattern_ok"] = bool(np.array_equal(np.isneginf(out), ~fin))
                row["rel_err"] = float(np.linalg.norm(out[fin] - ref[fin])
                                       / np.linalg.norm(ref[fin]))
                call = functools.partial(fn, qi, w, keys, nc)
                row.update(sweep_times(call, heavy=name.startswith("prefill")))

            sweep_row(res, row, work, os.path.join(out_dir, "h200-pool-rows.json"))
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
