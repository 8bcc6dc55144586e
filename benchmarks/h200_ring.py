"""H200: the indexer-ring write (`index_write_pallas`) against its jnp twin at the shapes the
layer runs, and its time with a ring of `ring_rows(cfg)` rows against a "ring" of every
position (the layout before the ring: the same kernel, `Rr = max_context`).

    PYTHONPATH=. python3 benchmarks/h200_ring.py --out $OUT/ring
    PYTHONPATH=. python3 benchmarks/h200_ring.py --smoke   # CPU, interpret mode, seconds

Writes `<out>/h200-ring.json`. Parity: stored rows within one storage step of the cache dtype
(`testing.assert_stored_close`: a value on a rounding boundary may land on the neighbouring
code), pool keys within rtol 1e-5 (fp32 softmax over KP members in another order). Times:
`wall_us` (median of back-to-back calls, the ring and keys donated) and `kernel_us` (device
kernel time per call from a profiler trace; None off a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import sweep_row, sweep_times
from dsa_jax import testing as T
from dsa_jax.pallas import index_write as iw
from dsa_jax.shapes import glm53_flash
from dsa_jax.state import ring_rows

KEYS_RTOL = 1e-5


def _cases(smoke: bool):
    """(name, B, rows per sequence, real rows, layers, layer, prior length)."""
    if smoke:
        return [("decode-b4-r4", 4, 4, 1, 1, 0, 37), ("verify-b2-r4", 2, 4, 4, 1, 0, 38),
                ("prefill-b1-r40", 1, 40, 40, 1, 0, 6), ("model-layer2-b2-r4", 2, 4, 3, 3, 2, 21)]
    return [("decode-b64-r4", 64, 4, 1, 1, 0, 9001), ("verify-b16-r4", 16, 4, 4, 1, 0, 9002),
            ("prefill-b1-r2048", 1, 2048, 2048, 1, 0, 6), ("decode-b1-r4", 1, 4, 1, 1, 0, 9003),
            ("model-layer3-b8-r4", 8, 4, 3, 4, 3, 9001)]


def _inputs(cfg, b, r, real, layers, rows, length, seed):
    rng = np.random.default_rng(seed)
    di, kp = cfg.index_head_dim, cfg.index_kpool
    idt = jnp.dtype(cfg.index_cache_dtype)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    k_raw = f32(rng.standard_normal((b, r, di)) * 2 + 0.5)
    g = f32(rng.standard_normal((b, r, di)))
    norm_w, norm_b = f32(1 + 0.3 * rng.standard_normal(di)), f32(0.3 * rng.standard_normal(di))
    ape = f32(0.5 * rng.standard_normal((kp, di)))
    ring = [jnp.asarray(rng.standard_normal((b, layers * rows, di)), jnp.float32).astype(idt)
            for _ in range(2)]
    keys = jnp.full((b, layers * cfg.num_pools, di), T.POISON, jnp.float32)
    lengths = length - np.arange(b) % 3  # ragged: pools complete at different rows
    pos = jnp.asarray(lengths[:, None] + np.arange(r), jnp.int32)
    valid = jnp.asarray(np.broadcast_to(np.arange(r) < real, (b, r)))
    return [k_raw, g, norm_w, norm_b, ape, *ring, keys, pos, valid]


def run(out_dir: str, smoke: bool) -> int:
    cfg = glm53_flash() if not smoke else glm53_flash(max_context=128, index_head_dim=16)
    path = os.path.join(out_dir, "h200-ring.json")
    res = {"command": "PYTHONPATH=. python3 benchmarks/h200_ring.py" + (" --smoke" * smoke),
           "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "jax_version": jax.__version__, "device": jax.devices()[0].device_kind,
           "ring_rows": ring_rows(cfg), "max_context": cfg.max_context, "results": [],
           "errors": []}
    for name, b, r, real, layers, layer, length in _cases(smoke):
        for rows in (ring_rows(cfg), cfg.max_context):
            if rows == cfg.max_context and layers > 1:
                continue  # the full layout is timed at one layer
            row = {"case": name, "B": b, "R": r, "real_rows": real, "layers": layers,
                   "ring_rows": rows, "variant": "ring" if rows < cfg.max_context else "full"}

            def work(row, b=b, r=r, real=real, layers=layers, layer=layer, rows=rows,
                     length=length):
                args = _inputs(cfg, b, r, real, layers, rows, length, seed=b * 7 + r)
                static = dict(layers=layers)
                twin = jax.jit(functools.partial(iw.index_write_xla, **static))
                kern = jax.jit(functools.partial(iw.index_write_pallas, interpret=smoke,
                                                 **static))
                want = twin(*args, jnp.int32(layer))
                got = kern(*args, jnp.int32(layer))
                for g_, w_ in zip(got[:2], want[:2], strict=True):
                    T.assert_stored_close(g_, w_, cfg.index_cache_dtype)
                written = np.asarray(want[2]) != T.POISON
                keys_err = T.rel_err(jnp.where(written, got[2], 0), jnp.where(written, want[2], 0))
                row["keys_written"] = int(written.any(-1).sum())
                row["keys_rel_err"] = float(keys_err)
                row["parity_ok"] = bool(keys_err <= KEYS_RTOL and (
                    np.asarray(got[2])[~written] == T.POISON).all())
                if not row["parity_ok"]:
                    raise AssertionError(f"keys rel err {keys_err} > {KEYS_RTOL}")
                for label, fn in (("pallas", kern), ("xla", twin)):
                    donating = jax.jit(fn, donate_argnums=(5, 6, 7))
                    held = [jnp.copy(a) if i in (5, 6, 7) else a  # donated: own copies
                            for i, a in enumerate(args)]

                    def call(donating=donating, held=held):
                        held[5:8] = donating(*held, jnp.int32(layer))
                        return held[7]

                    times = sweep_times(call, heavy=r > 64)
                    row[f"{label}_wall_us"], row[f"{label}_kernel_us"] = (
                        times["wall_us"], times["kernel_us"])

            sweep_row(res, row, work, path)
    print(f"wrote {path}; {len(res['errors'])} error(s)")
    return 1 if res["errors"] else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    return run(a.out, a.smoke)


if __name__ == "__main__":
    sys.exit(main())
