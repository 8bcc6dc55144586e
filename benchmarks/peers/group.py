"""The `peers` group: FlashMLA's sparse attend (decode and prefill) and DeepGEMM's indexer
logits with a top-k, timed beside ours on the same card in one process, on the same inputs
where the formats allow (`formats.py`).

Each point records `peer_us` and `ours_us` (device kernel time per call, from a CUPTI trace on
both sides: torch's profiler and `harness.kernel_us`), both walls, `ratio` = ours / peer in
kernel time, what each side computes and counts, and how far the two agree. A peer that does
not import (a CPU, or not built: benchmarks/peers/README.md) has its points skipped, the
reason recorded.
"""

from __future__ import annotations

import importlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import indexer, select
from dsa_jax.attend import attend

from ..harness import kernel_us, log, measure, profile
from ..measures import selection_call
from ..roofline import attend_cost, itemsize, selection_cost
from ..workloads import Cycle, attend_inputs, selection_inputs
from . import formats

PEERS = {"attend": "flash_mla", "selection": "deep_gemm"}
DG_BLOCK_KV = 64  # DeepGEMM's paged logits block on sm90
CALLS = 20  # traced calls per kernel time
# Both attends read the same fp8 bytes and write bf16: they may differ by each side's bf16
# rounding of the probabilities fed to the PV product and of the output, 2^-8 of the largest
# output each.
AGREE_BOUND = 2.0 ** -7
OURS = "pallas"  # our implementation measured: the kernels


def import_peers() -> dict:
    """`{name: module or the reason it is absent}` for torch and the two peers."""
    mods = {}
    for name in ("torch", "flash_mla", "deep_gemm"):
        try:
            mods[name] = importlib.import_module(name)
        except Exception as e:  # ImportError, or a built extension that does not load
            mods[name] = f"{name} does not import: {type(e).__name__}: {str(e)[:200]}"
    if not isinstance(mods["torch"], str) and not mods["torch"].cuda.is_available():
        mods["torch"] = "torch has no CUDA device"
    return mods


def peer_kernel_us(torch, fn) -> tuple[float | None, list[str]]:
    """Device kernel time per call of the torch call `fn` and its kernels' names, from the
    same CUPTI trace our kernel times come from (`harness.profile`: one tracer in the process;
    torch's own profiler would be a second subscriber, which CUPTI refuses)."""
    prof = profile(lambda: (fn(), torch.cuda.synchronize()), CALLS, top=4)
    names = [k["name"][:120] for k in prof.get("top_kernels", [])]
    return prof.get("kernel_us_per_step"), names


def torch_wall_us(torch, fn, plan) -> float:
    """`harness.measure`'s median wall for a torch call: groups of `inner` back-to-back calls,
    synchronized after each group."""
    for _ in range(plan.warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(plan.groups):
        t0 = time.perf_counter()
        for _ in range(plan.inner):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) / plan.inner * 1e6)
    return statistics.median(per_call)


def timed_pair(suite, ours: Cycle, torch, peer) -> dict:
    """Kernel time and wall of our call and the peer's, and their ratios."""
    p = suite.plan
    jax.block_until_ready(ours())
    o_k = kernel_us(ours, CALLS)
    o_w = measure(ours, warmup=p.warmup, groups=p.groups, inner=p.inner)["median_us"]
    p_k, names = peer_kernel_us(torch, peer)
    p_w = torch_wall_us(torch, peer, p)
    return {"ours_us": o_k, "peer_us": p_k, "ratio": o_k / p_k if o_k and p_k else None,
            "ours_wall_us": o_w, "peer_wall_us": p_w, "wall_ratio": o_w / p_w,
            "peer_kernels": names}


def torch_of(torch, x: jax.Array):
    """A device array shared with torch (DLPack: no copy)."""
    return torch.from_dlpack(x)


# ---------------------------------------------------------------------------------------------
# The attend: FlashMLA's sparse decode (fp8 V32 cache) and sparse prefill (bf16 keys)
# ---------------------------------------------------------------------------------------------


def attend_points(suite) -> list[tuple[str, dict]]:
    (ba, ra, ha, wa), (bb, rb, hb, wb) = suite.plan.kernel_a, suite.plan.kernel_b
    n = suite.plan.prefill_tokens
    return [(f"attend-decode-{ba}x{ra}-h{ha}", dict(B=ba, R=ra, H=ha, W=wa)),
            (f"attend-decode-{bb}x{rb}-h{hb}", dict(B=bb, R=rb, H=hb, W=wb)),
            (f"attend-decode-1x1-h{ha}", dict(B=1, R=1, H=ha, W=wa)),
            (f"attend-prefill-{n}-h{ha}", dict(B=1, R=n, H=ha, W=wa, prefill=True))]


def attend_point(suite, s: dict, torch, flash_mla) -> dict:
    cfg = suite.cfg.replace(implementation=OURS)
    b, r, h, w, c = s["B"], s["R"], s["H"], s["W"], cfg.kv_lora_rank
    prefill = s.get("prefill", False)
    st, sets = attend_inputs(cfg, b, r, h, w, suite.plan.ctx, 911 + b + r,
                             n_sets=1 if prefill else 3)
    # q exactly bf16 on both sides (FlashMLA takes bf16); f16-exact too: a prompt's rows
    # reach our kernel as q_scaled (`projection.scaled_q_abs`, the U_k GEMM's output), here
    # q itself as f16 with unit scales, made before the timed call as the step's GEMM makes it
    sets = [(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32), sel) for q, sel in sets]
    scaled = [(q.astype(jnp.float16), jnp.ones(q.shape[:-1], jnp.float32)) if prefill else None
              for q, _ in sets]

    @jax.jit
    def ours_fn(latent, kv_scale, tables, q, sel, q_scaled):
        state = st._replace(latent=latent, kv_scale=kv_scale, block_tables=tables)
        return attend(cfg, state, q, sel, dtype=jnp.bfloat16, q_scaled=q_scaled)

    args = [(st.latent, st.kv_scale, st.block_tables, q, sel, qs)
            for (q, sel), qs in zip(sets, scaled, strict=True)]
    ours = Cycle(ours_fn, args)
    bs, scale = cfg.block_size, cfg.qk_nope_head_dim ** -0.5
    multiple = formats.FLASHMLA_PREFILL_TOPK if prefill else formats.FLASHMLA_TOPK
    slots = [formats.padded_indices(jax.vmap(lambda t, tb: formats.token_slots(t, tb, bs))(
        sel, st.block_tables), multiple) for _, sel in sets]  # [B, R, W'] flat slots, -1 pad
    idx = [torch_of(torch, x) for x in slots]
    if prefill:  # d_qk 512 (phase1_k512): keys [S, 1, C] bf16, q [R, H, C], indices [R, 1, W']
        qs = [torch_of(torch, q.astype(jnp.bfloat16)) for q, _ in sets]
        kv = torch_of(torch, formats.dequantized_latents(st.latent, st.kv_scale))

        def call(i):
            return flash_mla.flash_mla_sparse_fwd(qs[i][0], kv, idx[i][0][:, None], scale,
                                                  d_v=c)[0]
        what = "flash_mla_sparse_fwd, bf16 keys [S, 1, 512], d_qk = d_v = 512"
        d_qk = c
    else:  # the V32 layout: q [B, R, H, 576], its RoPE part zeros
        qs = [torch_of(torch, formats.flashmla_query(q)) for q, _ in sets]
        d_qk = formats.V32_NOPE + formats.V32_ROPE
        cache = torch_of(torch, formats.flashmla_v32_cache(st.latent, st.kv_scale)).view(
            torch.float8_e4m3fn)  # [NB, bs, 1, 656]
        meta = flash_mla.get_mla_metadata()[0]

        def call(i):
            return flash_mla.flash_mla_with_kvcache(
                qs[i], cache, None, None, c, meta, softmax_scale=scale, is_fp8_kvcache=True,
                indices=idx[i])[0]
        what = "flash_mla_with_kvcache, V32 fp8 cache (656 B/token), sparse"
    turn = iter(range(10 ** 9))
    res = timed_pair(suite, ours, torch, lambda: call(next(turn) % len(sets)))
    mine = np.asarray(ours_fn(*args[0]), np.float32)
    theirs = call(0).float().cpu().numpy().reshape(mine.shape)
    wp = slots[0].shape[-1]
    res.update(
        peer=what, ours="dsa_jax.attend.attend, pallas, "
        f"{cfg.cache_dtype} latent [NB, bs, 512]", shape=s,
        padding=f"ours {w} slots a row; the peer's top-k {wp} (ours padded with -1 to a "
                f"multiple of {multiple})",
        ours_bytes_flops=attend_cost(b, r, h, w, c, itemsize(cfg.cache_dtype)),
        peer_flops=2 * b * r * h * wp * (d_qk + c),
        peer_flops_counted=f"2*h*s_q*topk*({d_qk}+{c}) per sequence, as FlashMLA counts",
        max_abs_diff=float(np.abs(mine - theirs).max()),
        max_abs=float(np.abs(theirs).max()),
        agreement="max |ours - peer| / max |peer|, bf16 outputs of the same fp8 bytes")
    res["rel_diff"] = res["max_abs_diff"] / res["max_abs"]
    res["agrees"] = res["rel_diff"] <= AGREE_BOUND
    if not res["agrees"]:
        log(f"[bench] peers: ours and the peer differ by {res['rel_diff']:.2e} of the largest "
            f"output (> {AGREE_BOUND:.2e}): a wrong input layout or a wrong kernel")
    return res


# ---------------------------------------------------------------------------------------------
# Selection: DeepGEMM's fp8 paged logits over the pool keys, then torch.topk
# ---------------------------------------------------------------------------------------------


def selection_points(suite) -> list[tuple[str, dict]]:
    ctx, big = suite.plan.ctx, max(suite.plan.scaling_ctx)
    b = suite.plan.big_batch
    return [(f"selection-{b}x{ctx // 1024}K", dict(B=b, ctx=ctx)),
            (f"selection-1x{ctx // 1024}K", dict(B=1, ctx=ctx)),
            (f"selection-1x{big // 1024}K", dict(B=1, ctx=big))]


def selection_point(suite, s: dict, torch, deep_gemm) -> dict:
    b, ctx = s["B"], s["ctx"]
    cfg = suite.cfg.replace(implementation=OURS, max_context=max(ctx, suite.cfg.max_context))
    keys, pos, valid, sets = selection_inputs(cfg, b, 1, ctx, 419 + b)
    p_live = ctx // cfg.index_kpool  # pool keys complete at the row (ctx - 1 is its position)
    k = min(cfg.select_k, p_live)
    ours = Cycle(lambda qi, w: selection_call(cfg, qi, w, keys, pos, valid), sets)
    kv, table = formats.deepgemm_fp8_keys(keys[:, :p_live], DG_BLOCK_KV)
    kv_t, table_t = torch_of(torch, kv), torch_of(torch, table)
    lens = torch.full((b, 1), p_live, dtype=torch.int32, device=kv_t.device)  # [B, next_n]
    meta = deep_gemm.get_paged_mqa_logits_metadata(lens, DG_BLOCK_KV, deep_gemm.get_num_sms())
    q8 = [torch_of(torch, qi).to(torch.float8_e4m3fn) for qi, _ in sets]  # [B, 1, Hi, Di]
    wt = [torch_of(torch, w.reshape(b, -1)).float() for _, w in sets]  # [B, Hi]

    def call(i):
        logits = deep_gemm.fp8_paged_mqa_logits(q8[i], kv_t.view(torch.uint8), wt[i], lens,
                                                table_t, meta, p_live, False)
        return torch.topk(logits, k, dim=-1).indices

    turn = iter(range(10 ** 9))
    res = timed_pair(suite, ours, torch, lambda: call(next(turn) % len(sets)))
    scores = indexer.pool_scores_at(cfg, *sets[0], keys, pos, valid)  # [B, 1, P]
    mine = np.asarray(select.top_pools(cfg, scores))[:, 0]  # [B, k]
    theirs = call(0).cpu().numpy()  # [B, k]
    overlap = np.mean([len(np.intersect1d(a, t)) / k for a, t in zip(mine, theirs, strict=True)])
    res.update(
        peer=f"deep_gemm.fp8_paged_mqa_logits (fp8 q x fp8 keys, f32 logits over {p_live} "
             f"pool keys) + torch.topk(k={k})",
        ours="pool scores (bf16 keys, bf16-split q: near f32) + top-k + expansion to "
             f"{cfg.sel_width} token slots, pallas", shape=s, top_k=k,
        ours_bytes_flops=selection_cost(cfg, b, 1, ctx),
        overlap=float(overlap), agreement="mean share of our selected pools the peer selects")
    return res


# ---------------------------------------------------------------------------------------------
# The group
# ---------------------------------------------------------------------------------------------


def run(suite) -> None:
    """Every point whose peer imports, guarded one by one; the rest skipped with the reason."""
    out = suite.result.setdefault("peers", {"points": {}, "skipped": {}})
    if jax.default_backend() != "gpu":
        out["skipped"]["all"] = f"no GPU (backend {jax.default_backend()})"
        log("[bench] peers skipped: no GPU")
        return
    mods = import_peers()
    out["card"] = jax.devices()[0].device_kind
    attends = attend_points(suite)
    # the prompt's point last: a peer's failed device assertion ends the process
    todo = [(n, sh, attend_point, "attend") for n, sh in attends if not sh.get("prefill")]
    todo += [(n, sh, selection_point, "selection") for n, sh in selection_points(suite)]
    todo += [(n, sh, attend_point, "attend") for n, sh in attends if sh.get("prefill")]
    for name, shape, fn, kind in todo:
        peer = mods[PEERS[kind]]
        why = next((m for m in (mods["torch"], peer) if isinstance(m, str)), None)
        if why is not None:
            out["skipped"][name] = why
            log(f"[bench] peers {name} skipped: {why}")
            continue
        out["points"][name] = suite.guarded(f"peers {name}", lambda s=shape, f=fn, m=peer: f(
            suite, s, mods["torch"], m))
        r = out["points"][name]
        log(f"[bench] peers {name}: ours {r.get('ours_us')} us, peer {r.get('peer_us')} us, "
            f"ratio {r.get('ratio')}")
        suite.save()
