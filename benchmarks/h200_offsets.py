"""H200 probe: do the kernels address a latent pool of 2**31 .. 2**32+ bytes correctly?

jax's Pallas Triton lowering computes element offsets in 32 bits for any array of at most
2**32 bytes; an fp8 cache has one element per byte, so per-element offsets past 2**31 wrap
(h200-offsets-20261130.json: an illegal address). Now, for such a cache, the latent write's
Triton kernel computes the rows into a small buffer and XLA scatters them into the cache
(`latent_write.pick_store`); the Triton gather-attend still refuses it; the Mosaic GPU attend
gathers rows with bulk copies whose addresses are 64-bit (memref offsets). One call, every
case in its own subprocess (an illegal address poisons the CUDA context):

- bitwise: the XLA-stored write == the kernel-stored one (today's kernel, in place) byte for
  byte on small pools (fp8 / bf16 / fp32, C = 512 and 511, random rows, poisoned pool,
  invalid rows); the two timed side by side (20 writes in one program, per write); whether
  the pool viewed as 32-bit words compiles to a bitcast (the word store measured at tree
  8e4e631, h200-offsets-20261201-run2.json, and not kept).
- pool-3GiB / pool-4GiB / pool-4GiB+1 (fp8, [NB, 64, 512]): the write (default rule: XLA
  store in the zone, kernel store past 2**32 bytes) puts 128 random rows into two blocks of the
  top GiB (one the pool's last) of a poisoned pool: rows `==` the kernel's on a small pool,
  every other byte still the poison; the compiled write's memory analysis (a pool-sized temp
  would be a copy). Then the Mosaic attend (and the Triton attend: refused in the zone, run
  past 2**32 bytes) reads those rows, against the XLA twin on the small pool with the bound of
  tests/test_attend_kernel.py.
- model-b64: the `loop-b64-l8` model (GLM-5.3-Flash blocks, 8 layers, 64 sequences x 16K, fp8:
  a stacked pool of exactly 2**32 bytes) one decode forward, scanned (stacked pool) against
  the unrolled stack (per-layer pools of 512 MiB, below the zone), both under BITWISE_OPTIONS:
  no byte of the stacked pool outside the new rows changed, the new rows alike
  (`loop_checks.check_written_rows`' measure, and bit for bit), tokens, logits; the scanned
  program's memory analysis.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. python3 benchmarks/h200_offsets.py --out $OUT/offsets
    PYTHONPATH=. python3 benchmarks/h200_offsets.py --smoke --out /tmp/offsets  (CPU, tiny)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_jax import testing as T
from dsa_jax.pallas import latent_write as lw
from dsa_jax.pallas import sparse_attend as sa
from dsa_jax.pallas.common import KernelLimitError

BS, C, H = 64, 512, 64
KERNEL, XLA = lw.LatentWriteTuning(store="kernel"), lw.LatentWriteTuning(store="xla")
AUTO = lw.LatentWriteTuning()
POISON_CODE = 0x3A  # an fp8 e4m3 code (1.25): the untouched bytes of the big pools
CASES = ("bitwise", "pool-3GiB", "pool-4GiB", "pool-4GiB+1", "model-b64")


def as_bytes(x) -> np.ndarray:
    x = jnp.asarray(x)
    return np.asarray(lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")))


# ------------------------------------------------------------------ bitwise + timing

def case_bitwise(smoke: bool) -> dict:
    """The XLA-stored write == the kernel-stored one, byte for byte, on small pools."""
    interp = smoke
    out = {}
    n_rows, nb, bs = (24, 12, 4) if smoke else (2048, 64, 64)
    widths = (24, 23) if smoke else (512, 511)
    for dtype in ("float8_e4m3fn", "bfloat16", "float32"):
        for c in widths:
            rng = np.random.default_rng(c)
            raw = jnp.asarray(rng.standard_normal((1, n_rows, c), np.float32) * 3)
            w = jnp.asarray(1 + 0.3 * rng.standard_normal(c).astype(np.float32))
            table = jnp.asarray(rng.permutation(nb)[None].astype(np.int32))  # [1, NB]
            pos = jnp.arange(n_rows, dtype=jnp.int32)[None]
            valid = jnp.asarray(rng.random((1, n_rows)) < 0.9)
            fill = 400.0 if dtype == "float8_e4m3fn" else T.POISON
            pool = jnp.full((nb, bs, c), fill, dtype)
            kv = jnp.float32(0.02)
            args = (raw, w, pool, kv, table, pos, valid)
            a = lw.latent_write_pallas(*args, eps=1e-6, interpret=interp, tuning=XLA)
            b = lw.latent_write_pallas(*args, eps=1e-6, interpret=interp, tuning=KERNEL)
            x = lw.latent_write_xla(*args, eps=1e-6)
            out[f"{dtype}-C{c}"] = {
                "xla_store_eq_kernel_store": bool((as_bytes(a) == as_bytes(b)).all()),
                "written_elements": int((as_bytes(b) != as_bytes(pool)).sum()),
                "elements_kernel_ne_twin": int((as_bytes(b) != as_bytes(x)).sum())}
    out["timing"] = time_writes(smoke)
    out["widen_view_hlo"] = widen_view_hlo()
    return out


def widen_view_hlo() -> dict:
    """Is an fp8 pool viewed as 32-bit words (`lax.bitcast_convert_type` over [.., C/4, 4])
    a free bitcast in the compiled program, or a pass over the pool (XLA's
    BitcastDtypesExpander: shifts and a reduce)? Compiled only."""
    struct = jax.ShapeDtypeStruct((4096, BS, C), jnp.float8_e4m3fn)
    f = jax.jit(lambda p: lax.bitcast_convert_type(p.reshape(-1, C // 4, 4), jnp.uint32))
    text = f.lower(struct).compile().as_text()
    ops = ("reduce(", "shift-left(", "bitcast-convert(", "fusion(", "copy(", "bitcast(")
    return {op.rstrip("("): text.count(op) for op in ops}


def time_writes(smoke: bool) -> dict:
    """Per write (20 in one jitted loop on a donated pool), kernel store vs XLA store, fp8,
    C = 512, a 256 MiB pool (below the zone, where both apply)."""
    if smoke:
        return {}
    nb = 2 ** 28 // (BS * C)
    res = {}
    for n in (64, 4096):
        rng = np.random.default_rng(n)
        raw = jnp.asarray(rng.standard_normal((1, n, C), np.float32))
        w = jnp.ones((C,), jnp.float32)
        table = jnp.asarray(rng.permutation(nb)[None, : -(-n // BS)].astype(np.int32))
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        valid = jnp.ones((1, n), bool)
        for name, tuning in (("kernel", KERNEL), ("xla", XLA)):
            def loop(p, tuning=tuning, ops=(raw, w, table, pos, valid)):
                raw_, w_, table_, pos_, valid_ = ops
                return lax.fori_loop(0, 20, lambda i, q: lw.latent_write_pallas(
                    raw_, w_, q, jnp.float32(0.02), table_, pos_, valid_, eps=1e-6,
                    tuning=tuning), p)
            f = jax.jit(loop, donate_argnums=0)
            pool = jnp.zeros((nb, BS, C), jnp.float8_e4m3fn)
            pool = jax.block_until_ready(f(pool))
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                pool = jax.block_until_ready(f(pool))
                ts.append(time.perf_counter() - t0)
            res[f"n{n}-{name}_store_us_per_write"] = round(float(np.median(ts)) / 20 * 1e6, 2)
            del pool
    return res


# ------------------------------------------------------------------ big pools

def _hlo_facts(compiled, pool_bytes: int) -> dict:
    """A compiled write's memory analysis and its pool-sized copies (none expected)."""
    facts = {}
    try:
        m = compiled.memory_analysis()
        facts.update(temp_bytes=int(m.temp_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes),
                     output_bytes=int(m.output_size_in_bytes))
    except Exception as e:  # noqa: BLE001 - recorded
        facts["memory_analysis_error"] = repr(e)[:200]
    text = compiled.as_text()
    copies = [ln.strip()[:160] for ln in text.splitlines()
              if re.search(r"=\s*\S+\s+copy\(", ln) and _elements(ln) * 1 >= pool_bytes // 4]
    facts["pool_sized_copies"] = copies
    facts["pool_aliased"] = facts.get("alias_bytes", 0) >= pool_bytes
    facts["temp_holds_a_pool"] = facts.get("temp_bytes", 0) >= pool_bytes  # i.e. a copy
    return facts


def _elements(line: str) -> int:
    m = re.search(r"\[([\d,]+)\]", line)
    return int(np.prod([int(d) for d in m.group(1).split(",")])) if m else 0


def case_pool(nb: int, smoke: bool, tuning=AUTO) -> dict:
    bs, c, h = (4, 24, 5) if smoke else (BS, C, H)
    interp = smoke
    rows = 2 * bs  # two blocks of the top GiB: the pool's last, and one half a GiB below
    per_gib = max(1, 2 ** 30 // (bs * c)) if not smoke else 4
    blocks = jnp.asarray([[nb - 1 - per_gib // 2, nb - 1]], jnp.int32)  # [1, 2]
    small_table = jnp.asarray([[0, 1]], jnp.int32)
    key = jax.random.split(jax.random.key(nb), 3)
    raw = jax.random.normal(key[0], (1, rows, c), jnp.float32) * 3  # [1, 2bs, C]
    norm_w = 1.0 + 0.1 * jax.random.normal(key[1], (c,), jnp.float32)  # [C]
    kv = jnp.float32(1 / 64)
    pos = jnp.arange(rows, dtype=jnp.int32)[None]  # [1, 2bs]
    valid = jnp.ones((1, rows), bool)
    poison = lax.bitcast_convert_type(jnp.uint8(POISON_CODE), jnp.float8_e4m3fn)
    small = lw.latent_write_pallas(raw, norm_w, jnp.full((2, bs, c), poison), kv, small_table,
                                   pos, valid, eps=1e-6, interpret=interp,
                                   tuning=KERNEL)  # [2, bs, C]: the kernel's rows, in place
    twin = lw.latent_write_xla(raw, norm_w, jnp.full((2, bs, c), poison), kv, small_table, pos,
                               valid, eps=1e-6)
    pool_bytes = nb * bs * c
    out = {"pool_bytes": pool_bytes, "past_2**31": pool_bytes > 2 ** 31,
           "past_2**32": pool_bytes > 2 ** 32,
           "store": lw.pick_store(tuning, (nb, bs, c), jnp.float8_e4m3fn),
           "reference_elements_ne_twin": int((as_bytes(small) != as_bytes(twin)).sum())}

    def write(p):
        return lw.latent_write_pallas(raw, norm_w, p, kv, blocks, pos, valid, eps=1e-6,
                                      interpret=interp, tuning=tuning)

    compiled = jax.jit(write, donate_argnums=0).lower(
        jax.ShapeDtypeStruct((nb, bs, c), jnp.float8_e4m3fn)).compile()
    out["hlo"] = _hlo_facts(compiled, pool_bytes)
    pool = jnp.full((nb, bs, c), poison)  # [NB, bs, C]
    pool = compiled(pool)
    got = pool[blocks[0]]  # [2, bs, C]
    out["write_rows_equal"] = bool((as_bytes(got) == as_bytes(small)).all())
    changed = int(jnp.sum(lax.bitcast_convert_type(pool, jnp.uint8) != POISON_CODE))
    out["bytes_changed_elsewhere"] = changed - int((as_bytes(small) != POISON_CODE).sum())
    out["write_ok"] = out["write_rows_equal"] and out["bytes_changed_elsewhere"] == 0

    # The attend reads the written rows: 2 query rows, every token selected once in a shuffled
    # order with some slots empty; against the twin on the small pool.
    sel = np.stack([np.random.default_rng(s).permutation(rows) for s in range(2)])
    sel[:, ::7] = -1
    sel = jnp.asarray(sel[None].astype(np.int32))  # [1, 2, 2bs]
    q = jax.random.normal(key[2], (1, 2, h, c), jnp.float32)  # [1, 2, H, C]
    scale = c ** -0.5
    ref = sa.sparse_attend_xla(q, small, kv, small_table, sel, softmax_scale=scale)
    args = (q, small, kv, small_table, sel)
    for backend in (("triton",) if smoke else ("mosaic", "triton")):
        f = jax.jit(lambda p, backend=backend: sa.sparse_attend_pallas(
            q, p, kv, blocks, sel, softmax_scale=scale, interpret=interp,
            tuning=sa.AttendTuning(backend=backend)))
        try:
            o = f(pool)
        except KernelLimitError as e:
            out[f"attend_{backend}"] = {"refused": str(e)[:200]}
            continue
        if backend == "mosaic":
            down = np.asarray(sa.mgpu_op.row_scales(q.reshape(2, h, c))[1]).reshape(1, 2)
            bound = T.attend_bound(*args, scale, T.unit_roundoff(jnp.float16), 16,
                                   q_floor=2.0 ** -25 * down, p_floor=2.0 ** -25)
        else:
            bound = T.attend_bound(*args, scale, T.unit_roundoff(jnp.bfloat16), 16)
        err = np.abs(np.asarray(o, np.float64) - np.asarray(ref, np.float64))
        out[f"attend_{backend}"] = {"max_err_over_bound": float((err / bound).max()),
                                    "ok": bool((err <= bound).all() and np.isfinite(err).all())}
    return out


# ------------------------------------------------------------------ the model at B=64

def case_model(smoke: bool) -> dict:
    from benchmarks.loop_checks import model, random_serving
    from dsa_jax import bitwise_jit, serve
    from dsa_jax.model import forward, forward_unrolled, unfold_state
    from dsa_jax.shapes import glm53_flash, tiny

    if smoke:
        cfg, b = tiny(implementation="pallas-interpret", max_context=64,
                      indexer_types=("full", "shared")), 2
    else:
        cfg, b = glm53_flash(implementation="pallas", indexer_types=("full", "shared") * 4), 64
    vocab, seed = 256, 21
    mcfg, weights, stacked = model(cfg, vocab, seed)
    ms = random_serving(serve.Program(mcfg), b, cfg.max_context - 8, jax.random.key(seed)).model
    states = tuple(unfold_state(mcfg, ms))
    pos = np.asarray(ms.lengths)  # [B] where the new token goes
    tables = np.asarray(ms.block_tables)
    blk, off = tables[np.arange(b), pos // cfg.block_size], pos % cfg.block_size  # [B] each
    nb = ms.latent.shape[0] // len(cfg.indexer_types) if ms.latent.ndim == 3 else \
        ms.latent.shape[1]
    before = jnp.copy(ms.latent)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, cfg.max_verify)),
                         jnp.int32)
    one = jnp.ones((b,), jnp.int32)
    # Both under BITWISE_OPTIONS (split-K 1): their GEMMs then sum alike, so the layers' new
    # rows and the logits are expected equal bit for bit.
    scanned = bitwise_jit(forward, static_argnums=0, donate_argnums=2)
    unrolled = bitwise_jit(forward_unrolled, static_argnums=0, donate_argnums=2)
    pool_bytes = int(ms.latent.size * ms.latent.dtype.itemsize)
    compiled = scanned.lower(mcfg, stacked, ms, tokens, one).compile()
    try:
        m = compiled.memory_analysis()
        mem = {"temp_bytes": int(m.temp_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes)}
    except Exception as e:  # noqa: BLE001 - recorded
        mem = {"error": repr(e)[:200]}
    la, ms2, _ = compiled(stacked, ms, tokens, one)
    lu, st2, _ = unrolled(mcfg, weights, states, tokens, one)
    out = {"pool_bytes": pool_bytes, "pool_shape": list(ms2.latent.shape), "layers": [],
           "scanned_memory": mem}
    lat = ms2.latent.reshape(len(cfg.indexer_types), nb, *ms2.latent.shape[-2:]) \
        if ms2.latent.ndim == 3 else ms2.latent
    lat0 = before.reshape(lat.shape)
    diff = lax.bitcast_convert_type(lat, jnp.uint8) != lax.bitcast_convert_type(lat0, jnp.uint8)
    rows_changed = jnp.any(diff, axis=-1)  # [L, NB, bs]
    expected = np.zeros(rows_changed.shape, bool)
    expected[:, blk, off] = True
    out["rows_changed_outside_new_rows"] = int(jnp.sum(rows_changed & ~jnp.asarray(expected)))
    for l in range(len(cfg.indexer_types)):
        a = np.asarray(lat[l][blk, off]).astype(np.float32)  # [B, C]
        u = np.asarray(st2[l].latent[blk, off]).astype(np.float32)
        out["layers"].append({"rows_far_apart": int(((a != u).mean(axis=1) > 0.5).sum()),
                              "elements_differing": int((a != u).sum())})
    out["logits_equal_bitwise"] = bool((np.asarray(la) == np.asarray(lu)).all())
    out["new_rows_equal_bitwise"] = not any(x["elements_differing"] for x in out["layers"])
    la, lu = np.asarray(la[:, 0], np.float64), np.asarray(lu[:, 0], np.float64)  # [B, V]
    out["tokens_equal"] = int((la.argmax(-1) == lu.argmax(-1)).sum())
    out["logits_max_abs_diff"] = float(np.abs(la - lu).max())
    out["logits_max_abs"] = float(np.abs(lu).max())
    out["ok"] = (out["rows_changed_outside_new_rows"] == 0
                 and not any(x["rows_far_apart"] for x in out["layers"]))
    return out


# ------------------------------------------------------------------ driver

def run_case(name: str, smoke: bool) -> dict:
    if name == "bitwise":
        return case_bitwise(smoke)
    if name == "model-b64":
        return case_model(smoke)
    per_gib = 2 ** 30 // (BS * C)
    nb = {"pool-3GiB": 3 * per_gib, "pool-4GiB": 4 * per_gib, "pool-4GiB+1": 4 * per_gib + 1}
    if smoke:  # [NB, 4, 24] fp8: a few KiB; the zone's XLA store forced where it would apply
        nb = {"pool-3GiB": 24, "pool-4GiB": 32, "pool-4GiB+1": 33}
        return case_pool(nb[name], smoke, XLA if name != "pool-4GiB+1" else KERNEL)
    return case_pool(nb[name], smoke)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="a directory: offsets.json and per-case files")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--case", help="run one case in this process (the driver's subprocesses)")
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--timeout-s", type=float, default=240)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.case:
        try:
            res = run_case(a.case, a.smoke)
        except Exception as e:  # noqa: BLE001 - recorded; the driver goes on
            res = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                   "trace": traceback.format_exc()[-1500:]}
        with open(os.path.join(a.out, f"{a.case.replace('+', 'plus')}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "smoke": a.smoke,
           "cases": {}}
    for name in a.only.split(","):
        t0 = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--case", name, "--out", a.out]
        cmd += ["--smoke"] if a.smoke else []
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s,
                               env=env)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        path = os.path.join(a.out, f"{name.replace('+', 'plus')}.json")
        case = json.load(open(path)) if os.path.exists(path) else {}
        if rc != 0:
            case.update(rc=rc, log_tail=tail)
        case["seconds"] = round(time.time() - t0, 1)
        res["cases"][name] = case
        print(name, json.dumps(case)[:1500], flush=True)
        with open(os.path.join(a.out, "offsets.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
