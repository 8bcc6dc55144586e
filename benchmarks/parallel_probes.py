"""Probes that benchmarks/h200_parallel.py runs beside its checks and times (issue 16).

- `collective_names` / `is_collective`: which profiled kernels are the step's collectives. XLA
  names a kernel after its HLO instruction ('.' and '-' as '_'), and on one host it may run a
  small all-reduce as a kernel of its own named after the instruction (`psum_7_0_fusion_1`),
  not as NCCL's `ncclDevKernel_*`; so a kernel counts as a collective if its name carries the
  name of one of the compiled program's collective instructions, or an NCCL-like word.
- `attend_rule(before=True)`: the gather-attend backend rule as it was before 32 heads per
  device took the Mosaic kernel (Triton unless the heads fill 64-row tiles), for an A/B of
  the whole step; it must span the program's compilation.
- `masked_step`: the sharded decode step with the split selection as it was before the score
  kernel took a range of sequences (issue 16): every rank scores the whole batch with the other
  ranks' rows given no candidate (their programs launch and store -inf), then slices its rows.
  A `shard_map` of its own (not a patched `split_select`: jax caches a mapped body's trace).
- `score_range_bits`: the score kernel over a range of sequences against the same rows of the
  whole batch's kernel, with `==`, at the step's shapes.
- `attend32`: the Mosaic kernel at 32 heads (zero-padded to its 64-row tile) against the jnp
  twin, with the elementwise f16 bound of tests/test_attend_kernel.py (via attend_checks.py).
- `prefill_bits`: where a prefill's selection picks up bits that depend on the batch or the
  program: each piece of the selection's input chain alone (x_proj GEMM, q_a RMSNorm, the
  indexer's query GEMM, pool scores, top-k) at B and at B/2 sequences on the same inputs;
  then the whole step, with what its selection saw (qi, head weights, pool keys), at B
  against B/2 (what a dp=2 device runs) and against a tp=2 rank's program run alone, under
  XLA's default compile options and with XLA's split-K forced off (`force_split_k_1`); the
  indexer's GEMMs alone at M and m rows under several XLA options (`gemm_rows`); and the
  sharded tp=2 and dp=2 prefills against one device with split-K forced off.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                  "all-to-all")
KERNEL_WORDS = ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reducescatter",
                "reduce_scatter")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^\n]*?\b(?:"
                    + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(", re.MULTILINE)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(", re.MULTILINE)


def _kernel_spelling(name: str) -> str:
    """An HLO name as kernel names spell it: no "fused_" prefix or ".clone" suffix, '.' and
    '-' as '_' (`fused_psum.7.0.clone` -> `psum_7_0`, whose kernel is `psum_7_0_fusion_1`)."""
    name = name.removeprefix("fused_").removesuffix(".clone")
    return re.sub(r"[.\-]", "_", name)


def collective_names(hlo_text: str) -> list[str]:
    """The compiled program's collective instructions and the fused computations that hold
    one (XLA runs a small all-reduce as a Triton collective fusion), spelled as kernel names
    spell them."""
    names = {_kernel_spelling(m.group(1)) for m in _INSTR.finditer(hlo_text)}
    heads = list(_COMPUTATION.finditer(hlo_text))
    for i, head in enumerate(heads):
        body = hlo_text[head.end():heads[i + 1].start() if i + 1 < len(heads) else None]
        if head.group(1).startswith("fused_") and _INSTR.search(body):  # a fusion's own
            names.add(_kernel_spelling(head.group(1)))
    return sorted(names)


def is_collective(kernel: str, names: list[str]) -> bool:
    low = kernel.lower()
    return (any(w in low for w in KERNEL_WORDS)
            or any(low == n.lower() or low.startswith(n.lower() + "_") for n in names))


@contextlib.contextmanager
def attend_rule(before: bool):
    """`before=True`: `sparse_attend.pick_backend` as it was (Mosaic only for heads that are a
    multiple of 64) while the block is open; compile inside it."""
    from dsa_jax.pallas import sparse_attend as sa
    from dsa_jax.pallas import sparse_attend_mgpu as mg

    if not before:
        yield
        return
    rule = sa.pick_backend

    def pick(tuning, cache_dtype, heads, c, interpret, triton_args):
        if tuning.backend == "auto" and heads % mg.HEADS_PER_CTA:
            return "triton"
        return rule(tuning, cache_dtype, heads, c, interpret, triton_args)

    sa.pick_backend = pick
    try:
        yield
    finally:
        sa.pick_backend = rule


def masked_select(cfg, qi, w, pool_keys, pos, valid):
    """`sharding.split_select` before the ranged score kernel (see the module docstring)."""
    import jax.numpy as jnp
    from jax import lax

    from dsa_jax.indexer import pool_scores
    from dsa_jax.layer import candidate_pools
    from dsa_jax.select import top_pools
    from dsa_jax.sharding import TP

    b = qi.shape[0]
    n = b // cfg.tp_degree
    rank = lax.axis_index(TP)
    mine = (jnp.arange(b) // n == rank)[:, None]  # [B, 1]
    scores = pool_scores(cfg, qi, w, pool_keys, candidate_pools(cfg, pos, valid & mine))
    pools = top_pools(cfg, lax.dynamic_slice_in_dim(scores, rank * n, n, 0))  # [n, R, k]
    return lax.all_gather(pools, TP, axis=0, tiled=True)  # [B, R, k]


def masked_step(cfg, m):
    """A decode step (one new row per sequence, `y` and `sel` of the first row) over mesh `m`
    as `sharding.sharded_step(cfg, m, w, s, x, 1, out_rows=1, split_selection=True)` runs it,
    with `masked_select` as the selection."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from dsa_jax import layer, sharding

    def body(weights, state, x):
        n_new = jnp.ones((x.shape[0],), jnp.int32)
        y, state, sel = layer.step(cfg, sharding.rank_weights(weights), state, x, n_new,
                                   select=masked_select)
        y, sel = lax.optimization_barrier((y, sel))
        return sharding.reduce_heads(cfg, y[:, :1]), state, sel[:, :1]

    return jax.shard_map(body, mesh=m, in_specs=(sharding.WEIGHT_SPEC, sharding.STATE_SPECS,
                                                 sharding.ROW_SPEC),
                         out_specs=(sharding.ROW_SPEC, sharding.STATE_SPECS, sharding.ROW_SPEC),
                         check_vma=False)


def score_range_bits(cfg, b: int, rows=(4, 32), seed: int = 9) -> dict:
    """The score kernel (cfg.implementation) over sequences [first, first + n) against rows
    first .. first + n - 1 of the whole batch's kernel, `==`, first traced: a tp=2 rank's
    halves and an odd range, for `rows` rows per sequence (a decode padded to max_verify: one
    live row; a prompt chunk: causal counts, the bounded loop). {R/range: share of rows that
    differ (0: equal)}."""
    import jax
    import jax.numpy as jnp

    from dsa_jax.indexer import pool_scores

    rng = np.random.default_rng(seed)
    hi, di, p = cfg.index_n_heads, cfg.index_head_dim, cfg.num_pools
    out = {}
    for r in rows:
        qi = jnp.asarray(rng.standard_normal((b, r, hi, di), np.float32))
        w = jnp.asarray(rng.standard_normal((b, r, hi), np.float32) * (hi * di) ** -0.5)
        keys = jnp.asarray(rng.standard_normal((b, p, di), np.float32))
        last = rng.integers(min(r, p), p + 1, (b, 1))  # [B, 1] the last row's candidates
        n_cand = np.maximum(last - np.arange(r)[::-1], 0)  # [B, R] causal
        if r <= 4:  # a decode: one live row, the rest padding
            n_cand[:, 1:] = 0
        n_cand = jnp.asarray(n_cand, jnp.int32)
        whole = np.asarray(jax.jit(lambda *a: pool_scores(cfg, *a))(qi, w, keys, n_cand))
        for first, n in ((0, b // 2), (b // 2, b // 2), (b // 3, b // 3 or 1)):
            f = jax.jit(lambda f, *a, n=n: pool_scores(cfg, *a, seqs=(f, n)))
            got = np.asarray(f(jnp.int32(first), qi, w, keys, n_cand))
            out[f"R{r}/{first}+{n}"] = _rows_differing(got, whole[first:first + n])
    return out


ATTEND32_CASES = [  # (B, R, H, C, W, bs, blocks per seq, input kwargs, call kwargs)
    (3, 1, 32, 512, 2051, 64, 40, {}, {}),
    (2, 2, 32, 512, 2048, 64, 40, dict(prefix=True, empty_rows=1), {}),
    (4, 4, 32, 512, 2051, 64, 40, dict(empty_rows=3), dict(live_rows=4)),
]


def attend32(res: dict) -> bool:
    """The auto rule's kernel at 32 heads (Mosaic, padded) against the twin; True if every
    case is within its bound."""
    import jax.numpy as jnp

    from benchmarks.attend_checks import check_case
    from dsa_jax.pallas import sparse_attend as sa

    out = {"backend_at_32_heads": sa.pick_backend(sa.AttendTuning(), jnp.float8_e4m3fn, 32,
                                                  512, False, False), "checks": []}
    ok = out["backend_at_32_heads"] == "mosaic"
    for i, case in enumerate(ATTEND32_CASES):
        row = check_case("auto-32-heads", {}, "float16", case, seed=7000 + i)
        out["checks"].append(row)
        ok &= bool(row["ok"])
    res["attend32"] = out
    return ok


def _rows_differing(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(1 - (a == b).reshape(a.shape[0] * a.shape[1], -1).all(axis=-1).mean())


def _head(state, h: int):
    """The first h sequences of a state whose block tables index one shared pool."""
    keep = ("latent", "kv_scale")
    return state._replace(**{f: getattr(state, f)[:h] for f in state._fields
                             if f not in keep and getattr(state, f) is not None})


def _step_capture(cfg, weights, state, x, n_new):
    """`layer.step`, also returning what its selection saw: (sel, qi, w, pool keys after the
    writes). The selection hook hands its inputs out of the same trace."""
    from dsa_jax import layer


    seen = {}

    def select(cfg, qi, w, pool_keys, pos, valid):
        seen.update(qi=qi, w=w, keys=pool_keys)
        return layer.select_pools(cfg, qi, w, pool_keys, pos, valid)

    _, _, sel = layer.step(cfg, weights, state, x, n_new, select=select)
    return sel, seen["qi"], seen["w"], seen["keys"]


# XLA options that might fix a GEMM's algorithm whatever its row count (None: the defaults).
GEMM_OPTIONS = {"default": None,
                "force_split_k_1": {"xla_gpu_experimental_force_split_k": 1},
                "autotune_off": {"xla_gpu_autotune_level": 0}}
GEMM_ROWS = ((128, 64), (256, 128))  # (M, m): a prefill chunk at dp 1 / 2, a B=64 decode


def gemm_rows(w1, d: int, r_q: int) -> dict:
    """The indexer's two GEMMs (x_proj over x, qi_proj over q_resid) at M rows against their
    first m rows computed alone, under each of `GEMM_OPTIONS`: the share of the m rows whose
    bits differ (0: this GEMM's rows do not depend on the row count there)."""
    import jax
    import jax.numpy as jnp

    from dsa_jax.projection import matmul

    rng = np.random.default_rng(11)
    out = {}
    for label, opts in GEMM_OPTIONS.items():
        try:
            f = jax.jit(matmul, compiler_options=opts)
            row = {}
            for name, w, k in (("x_proj", w1.x_proj, d), ("qi_proj", w1.qi_proj, r_q)):
                for big, small in GEMM_ROWS:
                    v = jnp.asarray(rng.standard_normal((big, k)).astype("float32"))
                    row[f"{name}_{big}_vs_{small}"] = _rows_differing(
                        f(v, w)[:small, None], f(v[:small], w)[:, None])
            out[label] = row
        except Exception as e:  # an option this XLA does not know
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def prefill_bits(cfg, hf, b: int, ctx: int, rows: int, res: dict) -> None:
    """See the module docstring; results under res["prefill_bits"]: for each piece the share
    of rows (of the first B/2 sequences) whose bits differ between the runs compared."""
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks.workloads import random_state
    from dsa_jax.indexer import pool_scores
    from dsa_jax.projection import matmul, rms_norm
    from dsa_jax.select import top_pools
    from dsa_jax.weights import fold_weights

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((b, rows, cfg.hidden_size)).astype("float32")).astype(
        jnp.bfloat16)
    h = b // 2
    w1 = fold_weights(cfg, hf)
    cfg2 = cfg.replace(tp_degree=2)
    w2 = fold_weights(cfg2, hf, tp_rank=0)
    host = jax.device_get(random_state(cfg, b, ctx, seed=1))
    dev = jax.devices()[0]
    n_new = jnp.full((b,), rows, jnp.int32)
    out = {}

    # Each piece alone, on the same inputs at B and at B/2 sequences (a dp=2 device's batch).
    r_q = cfg.q_lora_rank
    xw = jax.jit(matmul)(x, w1.x_proj)  # [B, S, Nx]
    q_resid = jax.jit(lambda v: rms_norm(v[..., :r_q], w1.q_a_norm, cfg.rms_norm_eps))(xw)
    qi = jax.jit(matmul)(q_resid, w1.qi_proj).reshape(b, rows, cfg.index_n_heads, -1)
    hw = xw[..., -cfg.index_n_heads:]  # [B, S, Hi] the head weights' columns
    keys = jnp.asarray(host.pool_keys)
    ncand = jnp.full((b, rows), cfg.num_pools // 2, jnp.int32)
    scores = jax.jit(functools.partial(pool_scores, cfg))
    sc = scores(qi, hw, keys, ncand)
    top = jax.jit(functools.partial(top_pools, cfg))
    out["pieces_b_vs_half"] = {
        "x_proj_gemm": _rows_differing(xw[:h], jax.jit(matmul)(x[:h], w1.x_proj)),
        "q_a_rms_norm": _rows_differing(q_resid[:h], jax.jit(
            lambda v: rms_norm(v[..., :r_q], w1.q_a_norm, cfg.rms_norm_eps))(xw[:h])),
        "qi_gemm": _rows_differing(qi[:h], jax.jit(matmul)(q_resid[:h], w1.qi_proj).reshape(
            h, rows, cfg.index_n_heads, -1)),
        "pool_scores": _rows_differing(sc[:h], scores(qi[:h], hw[:h], keys[:h], ncand[:h])),
        "top_pools": _rows_differing(top(sc)[:h], top(sc[:h])),
    }
    out["gemm_rows_vs_options"] = gemm_rows(w1, cfg.hidden_size, cfg.q_lora_rank)
    # The whole step, and what its selection saw, at B, at B/2 and as a tp=2 rank's program.
    for label, opts in (("default", None), ("force_split_k_1", GEMM_OPTIONS["force_split_k_1"])):
        try:
            f = jax.jit(_step_capture, static_argnums=0, compiler_options=opts)
            full = f(cfg, w1, jax.device_put(host, dev), x, n_new)
            half = f(cfg, w1, jax.device_put(_head(host, h), dev), x[:h], n_new[:h])
            rank0 = f(cfg2, w2, jax.device_put(host, dev), x, n_new)
            names = ("sel", "qi", "head_w", "pool_keys")
            row = {f"half_batch_{k}": _rows_differing(a[:h], c)
                   for k, a, c in zip(names, full, half, strict=True)}
            row.update({f"tp2_rank0_{k}": _rows_differing(a, c)
                        for k, a, c in zip(names, full, rank0, strict=True)})
            if label != "default":
                row["sel_vs_default"] = _rows_differing(full[0], out["_sel"])
            else:
                out["_sel"] = np.asarray(full[0])
            out[label] = row
        except Exception as e:  # an option this XLA does not know
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out.pop("_sel", None)
    res["prefill_bits"] = out
    try:
        out["mesh_force_split_k_1"] = _mesh_prefill(cfg, hf, x, host,
                                                     GEMM_OPTIONS["force_split_k_1"])
    except Exception as e:
        out["mesh_force_split_k_1"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _mesh_prefill(cfg, hf, x, host, opts) -> dict:
    """The sharded prefill steps (tp=2 on a 1x2 mesh, dp=2 on a 2x1 mesh) against one device,
    every program compiled with XLA options `opts`: the share of rows whose `sel` differs."""
    import jax

    import dsa_jax
    from dsa_jax import layer, sharding

    out = {}
    b, rows = x.shape[:2]
    w1 = dsa_jax.fold_weights(cfg, hf)
    one = jax.jit(layer.step, static_argnames="cfg", compiler_options=opts)
    _, _, sel1 = one(cfg, w1, jax.device_put(host, jax.devices()[0]), x,
                     jax.numpy.full((b,), rows, jax.numpy.int32))
    for name, dp, tp in (("tp2", 1, 2), ("dp2", 2, 1)):
        c = cfg.replace(tp_degree=tp)
        m = sharding.mesh(dp, tp)
        step = jax.jit(lambda w, s, v, c=c, m=m: sharding.sharded_step(c, m, w, s, v, rows),
                       compiler_options=opts)
        _, _, sel = step(sharding.shard_weights(c, hf, m), sharding.shard_state(c, m, host),
                         sharding.put(x, sharding.row_sharding(m)))
        out[f"{name}_sel_rows_differing"] = _rows_differing(sel, sel1)
    return out
