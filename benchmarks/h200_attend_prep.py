"""Pieces of benchmarks/h200_attend.py's prep group: the one-launch prep's bitwise check
against its jnp twin on the GPU, and the Mosaic kernel timed alone (launch vs device time)."""

from __future__ import annotations

import functools

import numpy as np


def prep_bitwise(name, tuning, check_inputs, interpret=False):
    """prep_pallas `==` mosaic_inputs_jnp on the GPU at two shapes, with rows of extreme
    magnitude (zero, 1e-30, f32 subnormal, 1e30, one element beyond f16, f16 subnormals)."""
    import jax
    import jax.numpy as jnp

    from dsa_jax.pallas import attend_prep as ap
    from dsa_jax.pallas import common
    from dsa_jax.pallas import sparse_attend as sa

    rows = []
    shapes = ((64, 1, 64, 512, 2051, 64, 40, 64, 2176), (3, 3, 5, 384, 70, 16, 9, 64, 128))
    for (b, r, h, c, w, bs, mb, hp, wp) in shapes[1:] if interpret else shapes:
        q, _, _, tables, sel = check_inputs(7 + h, b, r, h, c, w, bs, mb)
        q = q.reshape(b * r, h, c).copy()
        q[0] = 0.0
        q[1] *= 1e-30
        q[2] *= 1e-42
        q[3] *= 1e30
        q[4, 0, 0] = 65504.0 * 8
        q[5, :, 1::2] *= 3e-5
        args = (jnp.asarray(q), jnp.asarray(sel), jnp.asarray(tables))
        programs = tuning.prep_per_sm * common.sm_count() if not interpret else 4
        got = jax.jit(functools.partial(
            ap.prep_pallas, block_size=bs, hp=hp, wp=wp, heads_per_chunk=tuning.prep_heads,
            num_warps=tuning.prep_warps, programs=programs or None,
            interpret=interpret))(*args)
        want = jax.jit(functools.partial(sa.mosaic_inputs_jnp, block_size=bs, hp=hp,
                                         wp=wp))(*args)
        names = ("q16", "up", "down", "slots", "live")
        eq = {k: bool((np.asarray(x).view(np.uint8) == np.asarray(y).view(np.uint8)).all())
              for k, x, y in zip(names, got, want, strict=True)}
        diff_rows = np.nonzero((np.asarray(got[0]).view(np.uint16)
                                != np.asarray(want[0]).view(np.uint16)).any(axis=(1, 2)))[0]
        rows.append({"variant": name, "case": f"prep-bitwise N{b * r} H{h} C{c} W{w}",
                     "ok": all(eq.values()), "equal": eq, "q16_rows_differing":
                     diff_rows[:8].tolist()})
    return rows


def kernel_only(b, r, h, w, tables):
    """(q, lat, kv, tables, sel) -> the default Mosaic kernel's partials, with its inputs
    prepared once per (q, sel) outside the timed call (diagnostic: launch vs device time)."""
    import jax

    from dsa_jax.pallas import common
    from dsa_jax.pallas import sparse_attend as sa
    from dsa_jax.pallas import sparse_attend_mgpu as mg

    t, n, hp = mg.MgpuTuning(), b * r, -(-h // 64) * 64
    tiles_all = -(-w // t.block_w)
    splits = mg.num_splits(n * hp // 64, tiles_all, common.sm_count(), t.max_splits)
    tiles = -(-tiles_all // splits)
    prep = jax.jit(functools.partial(sa.mosaic_inputs_jnp, block_size=64, hp=hp,
                                     wp=splits * tiles * t.block_w))
    kern = jax.jit(lambda kv, up, down, live, q16, slots, lat: mg.sparse_attend_mgpu_partials(
        kv, (up, down), live, q16, slots, lat.reshape(-1, 512), softmax_scale=1 / 16,
        splits=splits, tiles=tiles, tuning=t))
    memo = {}

    def fn(q, lat, kv, tables_, sel):
        if id(q) not in memo:
            q16, up, down, slots, live = prep(q.reshape(n, h, 512), sel, tables_)
            memo[id(q)] = (kv, up, down, live, q16, slots)
        return kern(*memo[id(q)], lat)

    fn.parts = (prep, kern)  # for a lowering check off the GPU
    return fn
