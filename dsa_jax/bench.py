"""`dsa-jax bench` (also `python -m dsa_jax.bench`): the benchmark suite of the DSA block.

GLM-5.3-Flash shapes (`dsa_jax.shapes.glm53_flash()`: bf16 weights, fp8 latent cache), random
weights and inputs (never zeros), caches filled to the context directly (random fp8 latents,
random indexer k / gate, random pool keys, lengths = context) rather than by a prefill.

What is timed:
- the layer step: `dsa_jax.layer._step_jit` (the jitted step that `decode`, `decode_k`
  and `prefill` call, without their host-side checks), rows padded to `cfg.max_verify` as
  `decode` / `decode_k` pad them; with `implementation="pallas"` and `"xla"`;
- the kernels alone: `sparse_attend_pallas` / `sparse_attend_xla`; the selection (pool scores,
  top-k, expansion) through `dsa_jax.indexer.pool_scores`, `dsa_jax.select`;
- the Hugging Face `Glm5NextTextAttention` (bf16, torch, eager and sdpa): one decode step at
  batch 1 at each context (its cache filled by its own forward, then tiled), and the
  counterparts of the K=3 verify, the 64-sequence decode and the prefill. It runs after every
  JAX point (torch's allocations slowed the JAX steps timed after it) and its times are
  attached to the points at the end.

Timing: warm-up calls, then groups of `inner` back-to-back calls with `jax.block_until_ready`
around each group; the figure is the median over groups of (group time / inner). Torch: CUDA
events around each call, median. Between groups the decode state's lengths are set back (a
rewind), so every call decodes at the stated context (within `inner * K` tokens).

Roofline for every point: the fewest bytes the step must move (weights read once, the caches it
must read and write, its inputs and outputs) over the measured copy bandwidth (a large
device-to-device copy, read + write bytes), and its FLOPs over the measured bf16 matmul rate;
the larger is the floor. Both ceilings are measured in the same run.

Tensor parallelism: at TP 8 the suite benchmarks ONE rank's work on one GPU (8 local heads of
q_b / kv_b / o_proj; the indexer and the latent projection replicated); no collective is timed.

Writes one JSON per run (`--out`, default `$OUT` when set, else benchmarks/results) with
machine, versions, date, the exact command, the ceilings, and `points`: each with `name`,
`median_us`, `floor_us`, `target`, `met`, the implementation timed, and the baselines
(`xla_us`, `hf_us` where measured, and the ratios). `--smoke` runs the whole suite on the tiny
config with few repetitions (CPU, seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

SCHEMA_VERSION = 1
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")
FLASHMLA_TFLOPS = 410.0  # FlashMLA, fp8 sparse decode, H800 (published)


# ---------------------------------------------------------------------------------------------
# The plan: every shape the suite runs, full (GLM-5.3-Flash on an H200) or smoke (tiny, CPU).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    ctx: int  # context of the decode points
    big_batch: int  # "64 sequences"
    prefill_tokens: int
    scaling_ctx: tuple[int, ...]
    kernel_a: tuple[int, int, int, int]  # (B, R, H, W) gather-attend, "64 rows, 64 heads, 2051"
    kernel_b: tuple[int, int, int, int]  # "128 rows x 2 query rows, 128 heads, 2,048 slots"
    hf_ctx: tuple[int, ...]
    tp: tuple[int, ...]
    warmup: int
    groups: int
    inner: int
    long_groups: int  # prefill / HF at long contexts
    split_sweep: tuple[int, ...]


def full_plan(cfg) -> Plan:
    return Plan(ctx=cfg.max_context, big_batch=64, prefill_tokens=9000,
                scaling_ctx=(1024, 4096, 16384, 65536, 131072),
                kernel_a=(64, 1, cfg.num_heads, cfg.sel_width), kernel_b=(128, 2, 128, 2048),
                hf_ctx=(1024, 4096, 16384, 65536, 131072), tp=(1, 8), warmup=3, groups=15,
                inner=10, long_groups=7, split_sweep=(1, 2, 4, 8, 16))


def smoke_plan(cfg) -> Plan:
    m = cfg.max_context
    # prefill_tokens = max_verify: the smoke prefill reuses the decode step's program.
    return Plan(ctx=m, big_batch=2, prefill_tokens=cfg.max_verify,
                scaling_ctx=(m // 4, m // 2, m),
                kernel_a=(4, 1, cfg.num_heads, cfg.sel_width), kernel_b=(2, 2, 16, cfg.index_topk),
                hf_ctx=(m,), tp=(1, 8), warmup=1, groups=3, inner=2, long_groups=2,
                split_sweep=(1, 2))


def quick(plan: Plan) -> Plan:
    """The full shapes with the fewest repetitions (a dry run of the shapes, e.g. on a CPU)."""
    return dataclasses.replace(plan, warmup=1, groups=2, inner=1, long_groups=1,
                               hf_ctx=plan.hf_ctx[:1], split_sweep=plan.split_sweep[:2])


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def _err(e: BaseException) -> str:
    """One error as text: type, message and the last frames (kept short)."""
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    text = "".join(tb)
    return f"{type(e).__name__}: {str(e)[:1500]}\n...{text[-2500:]}"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def fmt_us(us) -> str:
    if us is None:
        return "-"
    if us >= 10_000:
        return f"{us / 1000:.1f} ms"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} us"


class DeviceLost(RuntimeError):
    """The device stopped answering after an error (e.g. a kernel's illegal address)."""


@dataclasses.dataclass
class Ceilings:
    copy_GBps: float  # read + write bytes per second / 1e9
    matmul_TFLOPs: float  # bf16 matmul rate
    detail: dict

    def floor(self, nbytes: float, flops: float) -> dict:
        t_bytes = nbytes / (self.copy_GBps * 1e9) * 1e6
        t_flops = flops / (self.matmul_TFLOPs * 1e12) * 1e6
        return {"bytes": int(nbytes), "flops": int(flops), "bytes_us": t_bytes,
                "flops_us": t_flops, "floor_us": max(t_bytes, t_flops),
                "bound": "bytes" if t_bytes >= t_flops else "flops"}


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def measure(call: Callable[[], Any], *, warmup: int, groups: int, inner: int,
            reset: Callable[[], None] | None = None) -> dict:
    """Median seconds per call: `groups` groups of `inner` back-to-back calls, each group
    bracketed by `jax.block_until_ready`; `reset` runs before each group, outside the timing."""
    import jax

    for _ in range(warmup):
        if reset is not None:
            reset()
        jax.block_until_ready(call())
    per_call = []
    for _ in range(groups):
        if reset is not None:
            reset()
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = call()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / inner)
    us = sorted(t * 1e6 for t in per_call)
    return {"median_us": statistics.median(us), "min_us": us[0], "max_us": us[-1],
            "p10_us": us[max(0, int(0.1 * len(us)))],
            "p90_us": us[min(len(us) - 1, int(0.9 * len(us)))],
            "groups": groups, "inner": inner, "warmup": warmup}


class CompileLog:
    """Counts XLA backend compiles and their time (jax.monitoring events)."""

    def __init__(self):
        self.events: list[float] = []
        import jax

        try:
            jax.monitoring.register_event_duration_secs_listener(self._on)
            self.ok = True
        except Exception:  # pragma: no cover - older jax
            self.ok = False

    def _on(self, event, duration, *args, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.events.append(float(duration))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> tuple[int, float]:
        ev = self.events[mark:]
        return len(ev), float(sum(ev))


# ---------------------------------------------------------------------------------------------
# Random state and inputs
# ---------------------------------------------------------------------------------------------


def random_state(cfg, num_seqs: int, length: int, seed: int, kv_scale: float = 1 / 64,
                 indexer: bool = True):
    """A state whose caches hold `length` random tokens per sequence (permuted block tables);
    `indexer=False`: no indexer cache (0 rows), for the gather-attend alone. One jitted
    program per shape."""
    import numpy as np

    # Only the shapes matter: one compile per shape, whatever the implementation or TP.
    cfg = cfg.replace(implementation="xla", tp_degree=1, max_verify=1)
    return _random_state_jit()(cfg, num_seqs, np.int32(length), np.uint32(seed), kv_scale,
                               indexer)


@functools.lru_cache(maxsize=1)
def _random_state_jit():
    import jax
    import jax.numpy as jnp

    from dsa_jax.state import DsaState, quantize_latent

    def build(cfg, num_seqs, length, seed, kv_scale, indexer):
        mb, bs = cfg.blocks_per_seq, cfg.block_size
        nb = num_seqs * mb
        ks = jax.random.split(jax.random.key(seed), 6)
        c = jax.random.normal(ks[0], (nb, bs, cfg.kv_lora_rank), jnp.bfloat16)
        scale = jnp.asarray(kv_scale, jnp.float32)
        latent = quantize_latent(cfg, c.astype(jnp.float32) if cfg.cache_dtype == "float32"
                                 else c, scale)
        tables = jax.random.permutation(ks[1], nb).reshape(num_seqs, mb).astype(jnp.int32)
        idt = jnp.dtype(cfg.index_cache_dtype)
        shape = (num_seqs, cfg.max_context if indexer else 0, cfg.index_head_dim)
        index_k = jax.random.normal(ks[2], shape, idt)
        index_g = (0.5 * jax.random.normal(ks[3], shape, jnp.float32)).astype(idt)
        pool_keys = 0.3 * jax.random.normal(
            ks[4], (num_seqs, cfg.num_pools if indexer else 0, cfg.index_head_dim), jnp.float32)
        lengths = jnp.full((num_seqs,), length, jnp.int32)
        return DsaState(latent=latent, kv_scale=scale, block_tables=tables, index_k=index_k,
                        index_g=index_g, pool_keys=pool_keys, lengths=lengths,
                        index_lengths=lengths + 0)

    return jax.jit(build, static_argnums=(0, 1, 4, 5))


class StepRunner:
    """Calls the jitted layer step on a donated state, `k` new rows per sequence per call;
    `reset` sets every sequence back to `start` tokens (a rewind)."""

    def __init__(self, cfg, weights, num_seqs: int, k: int, rows: int, start: int, seed: int,
                 n_inputs: int = 3):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from dsa_jax import layer

        self.cfg, self.weights, self.k, self.start, self.num_seqs = cfg, weights, k, start, num_seqs
        self.step = layer._step_jit
        self.state = random_state(cfg, num_seqs, start, seed)
        rng = np.random.default_rng(seed)
        xs = []
        for _ in range(n_inputs):
            x = np.zeros((num_seqs, rows, cfg.hidden_size), np.float32)
            # padding rows stay zero, as decode / decode_k pad them
            x[:, :k] = rng.standard_normal((num_seqs, k, cfg.hidden_size), np.float32)
            xs.append(jax.device_put(x.astype(jnp.bfloat16)))
        self.xs = xs
        self.n_new = jax.device_put(np.full((num_seqs,), k, np.int32))
        self.i = 0
        self.last = None

    def __call__(self):
        x = self.xs[self.i % len(self.xs)]
        self.i += 1
        y, self.state, sel = self.step(self.cfg, self.weights, self.state, x, self.n_new, None)
        self.last = (y, sel)
        return y, self.state

    def reset(self):
        import jax
        import numpy as np

        # Two distinct buffers (both are donated); host arrays put on the device, no compile.
        self.state = self.state._replace(
            lengths=jax.device_put(np.full((self.num_seqs,), self.start, np.int32)),
            index_lengths=jax.device_put(np.full((self.num_seqs,), self.start, np.int32)))


@functools.lru_cache(maxsize=1)
def _trivial_jit():
    import jax

    return jax.jit(lambda v: (v * 2).sum())


def _cache_size(fn) -> int | None:
    try:
        return int(fn._cache_size())
    except Exception:
        return None


def random_hf_tensors(cfg, seed: int) -> dict:
    """Random fp32 HF tensors of one layer, drawn with numpy (no device compiles), by the
    recipe of `dsa_jax.weights.init_random_hf_tensors`: linear weights N(0, 1/in), norms
    1 + 0.2 N, LayerNorm bias 0.2 N, ape 0.5 N. Never zeros."""
    import numpy as np

    from dsa_jax.weights import hf_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        z = rng.standard_normal(shape, np.float32)
        if name.endswith("layernorm.weight") or name == "indexer.k_norm.weight":
            z = 1.0 + 0.2 * z
        elif name == "indexer.k_norm.bias":
            z *= 0.2
        elif name == "indexer.index_kpool_compress_ape":
            z *= 0.5
        else:  # [out, in] linear weights
            z *= np.float32(shape[-1] ** -0.5)
        out[name] = z
    return out


def _param_bytes(weights) -> int:
    import jax

    return int(sum(a.nbytes for a in jax.tree_util.tree_leaves(weights)))


# ---------------------------------------------------------------------------------------------
# Byte and FLOP counts (the roofline)
# ---------------------------------------------------------------------------------------------


def _itemsize(dtype) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def row_flops(cfg, ctx: int) -> dict:
    """FLOPs of one new row at position ~ctx (multiply-add = 2)."""
    D, R, C = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Hl, Dn, Dv = cfg.local_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    nx = R + C + 2 * Di + Hi
    nq = Hl * Dn + Hi * Di
    proj = 2 * (D * nx + R * nq + Hl * Dn * C + Hl * Dv * C + Hl * Dv * D)
    pools = ctx // cfg.index_kpool
    index = 2 * Hi * Di * pools + 2 * Hi * pools
    width = min(cfg.sel_width, ctx)
    attend = 4 * Hl * width * C
    return {"proj": proj, "index": index, "attend": attend}


def step_cost(cfg, param_bytes: int, num_seqs: int, k: int, ctx: int, x_itemsize: int = 2
              ) -> tuple[int, int]:
    """(bytes, flops) of a decode / verify step: `k` rows for each of `num_seqs` sequences at
    context `ctx`. Bytes: weights once; per sequence the live pool keys and one selection's
    latents (the rows of one sequence may share them); per row the cache writes (latent, index
    k and gate, the pool key on completion with its members re-read), x in, y (f32) and the
    selection (int32) out."""
    C, Di, KP, W = cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_kpool, cfg.sel_width
    lat = _itemsize(cfg.cache_dtype)
    idx = _itemsize(cfg.index_cache_dtype)
    per_seq = (ctx // KP) * Di * 4 + min(W, ctx) * C * lat
    per_row = (C * lat + 2 * Di * idx + 2 * Di * idx + Di * 4 / KP
               + cfg.hidden_size * (x_itemsize + 4) + W * 4)
    nbytes = param_bytes + num_seqs * per_seq + num_seqs * k * per_row
    flops = num_seqs * k * sum(row_flops(cfg, ctx).values())
    return int(nbytes), int(flops)


def prefill_cost(cfg, param_bytes: int, s: int, x_itemsize: int = 2) -> tuple[int, int]:
    """(bytes, flops) of a one-sequence prefill of `s` tokens from empty, causal: row t scores
    the (t+1)//KP pools complete at t and attends min(W, t+1) tokens."""
    C, Di, KP, W = cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_kpool, cfg.sel_width
    Hl, Hi = cfg.local_heads, cfg.index_n_heads
    lat = _itemsize(cfg.cache_dtype)
    idx = _itemsize(cfg.index_cache_dtype)
    nbytes = (param_bytes + s * (C * lat + 2 * Di * idx + cfg.hidden_size * (x_itemsize + 4)
                                 + W * 4)
              + (s // KP) * Di * 4  # pool keys written
              + s * C * lat)  # every latent read once
    proj = row_flops(cfg, 0)["proj"] * s
    t = list(range(s))
    index = sum((2 * Hi * Di + 2 * Hi) * ((i + 1) // KP) for i in t)
    attend = sum(4 * Hl * min(W, i + 1) * C for i in t)
    return int(nbytes), int(proj + index + attend)


def attend_cost(b: int, r: int, h: int, w: int, c: int, lat_item: int = 1) -> tuple[int, int]:
    """Gather-attend alone: each row's selected latents once, q in and out (f32), the slots."""
    n = b * r
    nbytes = n * w * c * lat_item + 2 * n * h * c * 4 + n * w * 4
    return int(nbytes), int(4 * n * h * w * c)


def selection_cost(cfg, b: int, r: int, ctx: int) -> tuple[int, int]:
    p = ctx // cfg.index_kpool
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    nbytes = b * p * Di * 4 + b * r * (Hi * Di * 4 + Hi * 4) + b * r * cfg.sel_width * 4
    return int(nbytes), int(b * r * (2 * Hi * Di * p + 2 * Hi * p))


def absorbed_vs_runtime(cfg) -> dict:
    """Weight bytes and per-row FLOPs of the kv_b forms for one rank (the lever)."""
    D, R, C = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Hl, Dn, Dv = cfg.local_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    pb = _itemsize(cfg.param_dtype)
    runtime = {"q_b": Hl * Dn * R, "u_k": Hl * Dn * C, "u_v": Hl * Dv * C, "o_proj": D * Hl * Dv}
    absorbed = {"q_b_absorbed": Hl * C * R, "o_absorbed": D * Hl * C}
    rb = sum(runtime.values()) * pb
    ab = sum(absorbed.values()) * pb
    return {
        "tp_degree": cfg.tp_degree,
        "runtime_params": runtime, "absorbed_params": absorbed,
        "runtime_bytes": rb, "absorbed_bytes": ab,
        "runtime_fewer_bytes_frac": 1 - rb / ab,
        "runtime_flops_per_row": 2 * sum(runtime.values()),
        "absorbed_flops_per_row": 2 * sum(absorbed.values()),
        "note": "q path: q_b [Hl*Dn, R] then U_k [Hl, Dn, C] (run time) vs W_qb absorbed "
                "[Hl*C, R]; out path: U_v [Hl, Dv, C] then o_proj [D, Hl*Dv] vs o absorbed "
                "[D, Hl*C]. The other weights (x_proj, indexer wq_b) are the same in both.",
    }


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------


class Suite:
    def __init__(self, args, cfg, plan: Plan, out_path: str, command: str):
        self.args, self.cfg, self.plan, self.out_path = args, cfg, plan, out_path
        self.impls = [s for s in args.impls.split(",") if s]
        self.t0 = time.time()
        self.compiles = CompileLog()
        self.result: dict = {"schema_version": SCHEMA_VERSION, "command": command,
                             "argv": list(args.argv), "smoke": bool(args.smoke),
                             "points": [], "errors": [], "levers": {}, "baselines": {},
                             "skipped": []}
        self.steps: dict = {}  # (point name, impl) -> timing dict
        self.hf: dict = {}  # ctx -> {"eager": us, "sdpa": us}
        self._weights: dict = {}
        self.compile_record: dict = {}  # (cfg, B) -> the first call of every run_step

    # ----------------------------------------------------------------- bookkeeping
    def elapsed(self) -> float:
        return time.time() - self.t0

    def over_budget(self, group: str) -> bool:
        if self.args.budget_s and self.elapsed() > self.args.budget_s:
            self.result["skipped"].append({"group": group, "reason": f"time budget "
                                           f"{self.args.budget_s}s spent at "
                                           f"{self.elapsed():.0f}s"})
            _log(f"[bench] skipping {group}: budget spent")
            return True
        return False

    def late(self) -> bool:
        """Inside a group: past the budget by a quarter (stop optional variants)."""
        return bool(self.args.budget_s) and self.elapsed() > 1.25 * self.args.budget_s

    def save(self):
        self.result["elapsed_s"] = self.elapsed()
        os.makedirs(os.path.dirname(os.path.abspath(self.out_path)), exist_ok=True)
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=_json_default)
        os.replace(tmp, self.out_path)

    def add_point(self, name: str, target: str, cost: tuple[int, int] | None,
                  timings: dict[str, dict], met_fn: Callable[[dict], bool | None],
                  **extra) -> dict:
        """One point: main implementation = pallas when it ran, else xla."""
        main = None
        for impl in ("pallas", "xla"):
            if impl in timings and timings[impl].get("median_us") is not None:
                main = impl
                break
        median = timings[main]["median_us"] if main else None
        floor = self.ceil.floor(*cost) if cost is not None else None
        xla_us = timings.get("xla", {}).get("median_us")
        hf_key = extra.pop("hf", None)
        hf_us = self.hf_best(hf_key) if hf_key is not None else None
        point = {
            "name": name, "target": target, "impl": main, "median_us": median,
            "floor_us": floor["floor_us"] if floor else None,
            "time_over_floor": _ratio(median, floor["floor_us"]) if floor else None,
            "roofline": floor, "xla_us": xla_us, "ratio_vs_xla": _ratio(median, xla_us),
            "hf_key": hf_key, "hf_us": hf_us, "ratio_vs_hf": _ratio(median, hf_us),
            "impls": timings,
        }
        point.update(extra)
        try:
            met = met_fn(point) if median is not None else False
        except Exception as e:  # a met rule that cannot be evaluated is not met
            point["met_error"] = repr(e)
            met = False
        point["met"] = bool(met) if met is not None else False
        self.result["points"].append(point)
        self.save()
        return point

    def attach_hf(self):
        """Fill each point's HF time from the HF group (which runs last: see `main`)."""
        for point in self.result["points"]:
            if point.get("hf_key") is not None:
                point["hf_us"] = self.hf_best(point["hf_key"])
                point["ratio_vs_hf"] = _ratio(point["median_us"], point["hf_us"])
        self.save()

    def tqdm(self, items, desc):
        try:
            from tqdm import tqdm
        except Exception:  # pragma: no cover
            return items
        return tqdm(items, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                    disable=self.args.no_progress)

    def after_error(self, e: BaseException) -> None:
        """After a failed measurement: if the device no longer runs a trivial op (a sticky
        CUDA error), stop the run (DeviceLost); otherwise carry on."""
        import jax
        import numpy as np

        try:
            x = jax.device_put(np.arange(4, dtype=np.float32))
            if float(_trivial_jit()(x)) != 12.0:
                raise RuntimeError("a trivial op gave a wrong result")
        except Exception as e2:
            raise DeviceLost(f"after {type(e).__name__}: {str(e)[:300]}, the device fails a "
                             f"trivial op: {type(e2).__name__}: {str(e2)[:300]}") from e2

    def cfg_for(self, impl: str, **changes):
        return self.cfg.replace(implementation=impl, **changes)

    def weights_for(self, tp: int):
        import jax

        from dsa_jax.weights import fold_weights

        if "hf" not in self._weights:
            self._weights["hf"] = random_hf_tensors(self.cfg, self.args.seed)
        if tp not in self._weights:
            self._weights[tp] = jax.block_until_ready(
                fold_weights(self.cfg.replace(tp_degree=tp), self._weights["hf"], tp_rank=0))
        return self._weights[tp]

    # ----------------------------------------------------------------- ceilings
    def ceilings(self):
        import jax
        import jax.numpy as jnp

        p = self.plan
        small = self.args.smoke or jax.default_backend() == "cpu"
        n_copy = (1 << 20) if small else (1 << 28)  # f32 elements: 1 GiB per buffer on a GPU
        n_mm = 256 if small else 8192
        detail = {}
        # Copy: y = x * 1.0001 over a 1 GiB buffer (one read, one write), two buffers rotated.
        xs = [jax.random.normal(jax.random.key(i), (n_copy,), jnp.float32) for i in range(2)]
        f = jax.jit(lambda x: x * 1.0001)
        it = iter(range(1 << 30))
        t = measure(lambda: f(xs[next(it) % 2]), warmup=2, groups=max(5, p.groups // 2),
                    inner=5)
        copy = 2 * 4 * n_copy / (t["median_us"] * 1e-6) / 1e9
        detail["jax_copy"] = {"bytes_per_op": 2 * 4 * n_copy, "GBps": copy, **t}
        xs.clear()
        # Matmul: bf16 [n, n] @ [n, n], f32 accumulation, bf16 out, random data.
        a = [jax.random.normal(jax.random.key(10 + i), (n_mm, n_mm), jnp.bfloat16)
             for i in range(2)]
        mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32
                                          ).astype(jnp.bfloat16))
        it2 = iter(range(1 << 30))
        t = measure(lambda: mm(a[next(it2) % 2], a[1]), warmup=2,
                    groups=max(5, p.groups // 2), inner=5)
        rate = 2 * n_mm ** 3 / (t["median_us"] * 1e-6) / 1e12
        detail["jax_matmul_bf16"] = {"n": n_mm, "TFLOPs": rate, **t}
        a.clear()
        if not small and not self.args.no_hf:
            try:
                detail.update(_torch_ceilings())
            except Exception as e:
                detail["torch_error"] = _err(e)
        copy_best = max([copy] + [v["GBps"] for k, v in detail.items()
                                  if k.startswith("torch_copy")])
        rate_best = max([rate] + [v["TFLOPs"] for k, v in detail.items()
                                  if k.startswith("torch_matmul")])
        self.ceil = Ceilings(copy_best, rate_best, detail)
        self.result["ceilings"] = {"copy_GBps": copy_best, "matmul_bf16_TFLOPs": rate_best,
                                   "rule": "the best of the JAX and torch measurements",
                                   "detail": detail}
        _log(f"[bench] ceilings: copy {copy_best:.0f} GB/s (read+write), bf16 matmul "
             f"{rate_best:.0f} TFLOP/s")
        self.save()

    # ----------------------------------------------------------------- layer step
    def run_step(self, impl: str, tp: int, num_seqs: int, k: int, ctx: int,
                 cfg_changes: dict | None = None, public_api: bool = False) -> dict:
        """Time the layer step; returns the timing dict (or {"error": ...})."""
        import jax
        import numpy as np

        cfg = self.cfg_for(impl, tp_degree=tp, **(cfg_changes or {}))
        p = self.plan
        start = max(0, ctx - p.inner * k)
        n_comp, comp_s = 0, 0.0
        try:
            weights = self.weights_for(tp)
            runner = StepRunner(cfg, weights, num_seqs, k, cfg.max_verify, start,
                                1000 + num_seqs * 7 + k + ctx)
            jax.block_until_ready(runner.state)
            size0 = _cache_size(runner.step)
            mark = self.compiles.mark()
            t_first = time.perf_counter()
            jax.block_until_ready(runner())  # compile (when not cached) + one step
            first_s = time.perf_counter() - t_first
            n_comp, comp_s = self.compiles.since(mark)
            size1 = _cache_size(runner.step)
            self.compile_record.setdefault((cfg, num_seqs), []).append(
                {"ctx": ctx, "k": k, "compiles": n_comp, "compile_s": comp_s,
                 "first_call_s": first_s,
                 "jit_cache_entries_added": None if size0 is None else size1 - size0})
            runner.reset()
            t = measure(runner, warmup=p.warmup, groups=p.groups, inner=p.inner,
                        reset=runner.reset)
            y = runner.last[0]
            finite = bool(np.isfinite(np.asarray(y[:, :k], np.float32)).all())
            t.update(first_call_s=first_s, compiles=n_comp, compile_s=comp_s,
                     jit_cache_entries_added=(None if size0 is None else size1 - size0),
                     ctx_range=[start, start + p.inner * k], finite=finite,
                     timed="dsa_jax.layer._step_jit (the jitted step)")
            if public_api and k == 1:
                t["public_decode_us"] = self._time_public_decode(cfg, weights, runner)
            del runner
            return t
        except Exception as e:
            _log(f"[bench] {impl} step failed: {type(e).__name__}: {str(e)[:300]}")
            self.after_error(e)
            return {"error": _err(e), "median_us": None, "compiles": n_comp}

    def _time_public_decode(self, cfg, weights, runner, *, warmup: int = 1,
                            **decode_kwargs) -> dict:
        """`dsa_jax.decode` (host checks + padding + the step) at the runner's state; the
        runner's lengths are set back before every group, as for the step itself."""
        import jax

        import dsa_jax

        holder = {"state": runner.state}
        x1 = runner.xs[0][:, 0]

        def call():
            y, holder["state"], _ = dsa_jax.decode(cfg, weights, holder["state"], x1,
                                                   **decode_kwargs)
            return y

        def reset():
            runner.state = holder["state"]
            runner.reset()
            holder["state"] = runner.state

        try:
            return measure(call, warmup=warmup, groups=self.plan.groups,
                           inner=self.plan.inner, reset=reset)
        except Exception as e:
            return {"error": _err(e), "median_us": None}
        finally:
            runner.state = holder["state"]
            jax.block_until_ready(runner.state)

    def group_decode(self, tp: int):
        """decode K=1 and verify K=3 at one sequence; decode at `big_batch` sequences."""
        p = self.plan
        cfg = self.cfg.replace(tp_degree=tp)
        pb = _param_bytes(self.weights_for(tp))
        tp_note = ("" if tp == 1 else f"; TP {tp}: one rank's work on one GPU ({cfg.local_heads}"
                   f" local heads; indexer and latent projection replicated)")
        k1 = {}
        runs = [(impl, b, k) for b, k in ((1, 1), (1, 3), (p.big_batch, 1))
                for impl in self.impls]
        for impl, b, k in self.tqdm(runs, f"decode tp{tp}"):
            self.steps[(tp, b, k, impl)] = self.run_step(impl, tp, b, k, p.ctx,
                                                         public_api=(b == 1 and k == 1))
        for impl in self.impls:
            k1[impl] = self.steps[(tp, 1, 1, impl)]
        pt1 = self.add_point(
            f"decode-b1-k1-tp{tp}", f"decode step, 1 sequence, K=1, context {p.ctx}: "
            f"<= 1.35 x floor{tp_note}", step_cost(cfg, pb, 1, 1, p.ctx), k1,
            lambda pt: pt["median_us"] <= 1.35 * pt["floor_us"],
            hf=p.ctx if tp == 1 else None,
            batch=1, k=1, ctx=p.ctx, tp=tp)
        k3 = {impl: self.steps[(tp, 1, 3, impl)] for impl in self.impls}

        def verify_met(pt):
            base = pt1["impls"].get(pt["impl"], {}).get("median_us")
            pt["k1_step_us"] = base
            pt["ratio_vs_k1"] = _ratio(pt["median_us"], base)
            return base is not None and pt["median_us"] <= 1.3 * base

        self.add_point(
            f"verify-b1-k3-tp{tp}", f"verify step, 1 sequence, K=3, context {p.ctx}: <= 1.3 x "
            f"the K=1 step{tp_note}", step_cost(cfg, pb, 1, 3, p.ctx), k3, verify_met,
            hf="verify" if tp == 1 else None, batch=1, k=3, ctx=p.ctx, tp=tp)
        kb = {impl: self.steps[(tp, p.big_batch, 1, impl)] for impl in self.impls}
        self.add_point(
            f"decode-b{p.big_batch}-k1-tp{tp}", f"decode step, {p.big_batch} sequences, K=1, "
            f"context {p.ctx}: <= 1.5 x floor{tp_note}",
            step_cost(cfg, pb, p.big_batch, 1, p.ctx), kb,
            lambda pt: pt["median_us"] <= 1.5 * pt["floor_us"],
            hf="batch" if tp == 1 else None, batch=p.big_batch, k=1,
            ctx=p.ctx, tp=tp)

    # ----------------------------------------------------------------- kernels alone
    def attend_inputs(self, b, r, h, w, ctx, seed, n_sets=3):
        """A random latent cache (b sequences of ctx tokens) and n_sets of (q, selections):
        distinct random pools of KP tokens per row, then the newest tokens as the tail."""
        import jax
        import numpy as np

        cfg = self.cfg
        st = random_state(cfg.replace(max_context=ctx), b, ctx, seed, indexer=False)
        kp = cfg.index_kpool
        npool = min(w // kp, ctx // kp)
        tail = w - npool * kp
        rng = np.random.default_rng(seed)
        sets = []
        for _ in range(n_sets):
            q = rng.standard_normal((b, r, h, cfg.kv_lora_rank), np.float32)
            u = rng.random((b * r, ctx // kp), np.float32)
            pools = np.argpartition(u, npool - 1, axis=1)[:, :npool]  # distinct random pools
            rng.permuted(pools, axis=1, out=pools)
            toks = (pools[..., None] * kp + np.arange(kp)).reshape(b, r, npool * kp)
            if tail:
                tl = ctx - tail + np.arange(tail)  # the visible tail: the newest tokens
                toks = np.concatenate([toks, np.broadcast_to(tl, (b, r, tail))], -1)
            sets.append((jax.device_put(q), jax.device_put(toks.astype(np.int32))))
        return st, sets

    def time_attend(self, b, r, h, w, ctx, impl, seed: int, **kw) -> dict:
        import jax
        import numpy as np

        from dsa_jax.pallas import sparse_attend as sa

        scale = self.cfg.qk_nope_head_dim ** -0.5
        try:
            st, sets = self.attend_inputs(b, r, h, w, ctx, seed)
            if impl == "xla":
                fn = jax.jit(functools.partial(sa.sparse_attend_xla, softmax_scale=scale))
            else:
                fn = jax.jit(functools.partial(sa.sparse_attend_pallas, softmax_scale=scale,
                                               interpret=impl == "pallas-interpret", **kw))
            it = iter(range(1 << 30))

            def call():
                q, sel = sets[next(it) % len(sets)]
                return fn(q, st.latent, st.kv_scale, st.block_tables, sel)

            if impl == "pallas" and jax.default_backend() != "gpu":
                raise RuntimeError("implementation='pallas' compiles the kernels for a GPU; "
                                   f"backend is {jax.default_backend()!r}")
            out = jax.block_until_ready(call())
            finite = bool(np.isfinite(np.asarray(out)).all())
            t = measure(call, warmup=self.plan.warmup, groups=self.plan.groups,
                        inner=self.plan.inner)
            t["finite"] = finite
            return t
        except Exception as e:
            _log(f"[bench] attend {impl} failed: {type(e).__name__}: {str(e)[:300]}")
            self.after_error(e)
            return {"error": _err(e), "median_us": None}

    def group_kernels(self):
        p = self.plan
        C = self.cfg.kv_lora_rank
        lat_item = _itemsize(self.cfg.cache_dtype)
        # (a) 64 rows, 64 heads, 2051 slots, fp8: >= 70% bandwidth or >= 50% matmul rate.
        b, r, h, w = p.kernel_a
        timings = {impl: self.time_attend(b, r, h, w, p.ctx, impl, 77)
                   for impl in self.tqdm(self.impls, "attend kernel a")}
        cost = attend_cost(b, r, h, w, C, lat_item)

        def met_a(pt):
            t = pt["median_us"] * 1e-6
            bw = cost[0] / t / 1e9 / self.ceil.copy_GBps
            rate = cost[1] / t / 1e12 / self.ceil.matmul_TFLOPs
            pt.update(frac_of_bandwidth=bw, frac_of_matmul_rate=rate,
                      GBps=cost[0] / t / 1e9, TFLOPs=cost[1] / t / 1e12)
            return bw >= 0.7 if pt["roofline"]["bound"] == "bytes" else rate >= 0.5

        self.add_point(
            f"attend-kernel-{b}x{r}-h{h}-w{w}", f"gather-attend kernel alone, {b * r} rows, {h} "
            f"heads, {w} slots, {self.cfg.cache_dtype}: >= 70% of measured bandwidth or >= 50% "
            f"of measured matmul rate, whichever binds", cost, timings, met_a,
            shape={"B": b, "R": r, "H": h, "W": w, "C": C, "ctx": p.ctx})
        # (b) 128 x 2 rows, 128 heads, 2048 slots: TFLOP/s beside FlashMLA's 410.
        b, r, h, w = p.kernel_b
        timings = {impl: self.time_attend(b, r, h, w, p.ctx, impl, 78)
                   for impl in self.tqdm(self.impls, "attend kernel b")}
        cost_b = attend_cost(b, r, h, w, C, lat_item)

        def met_b(pt):
            t = pt["median_us"] * 1e-6
            pt.update(TFLOPs=cost_b[1] / t / 1e12, GBps=cost_b[0] / t / 1e9,
                      flashmla_TFLOPs=FLASHMLA_TFLOPS,
                      frac_of_flashmla=cost_b[1] / t / 1e12 / FLASHMLA_TFLOPS,
                      flop_count="4*rows*heads*slots*C (QK and PV over the C=512 latent); "
                                 "FlashMLA counts 2*h*s_q*topk*(576+512) per sequence")
            return cost_b[1] / t / 1e12 >= FLASHMLA_TFLOPS

        self.add_point(
            f"attend-kernel-{b}x{r}-h{h}-w{w}", f"gather-attend kernel, {b} rows x {r} query "
            f"rows, {h} heads, {w} slots: report TFLOP/s beside FlashMLA's published "
            f"{FLASHMLA_TFLOPS:.0f} TFLOP/s (H800, fp8 sparse decode)", cost_b, timings, met_b,
            shape={"B": b, "R": r, "H": h, "W": w, "C": C, "ctx": p.ctx})

    def group_selection(self):
        import jax
        import numpy as np

        from dsa_jax import indexer, layer, select

        p = self.plan
        cfg0 = self.cfg
        b = p.big_batch
        for r, name, tgt in ((1, f"selection-b{b}", f"selection (pool scores, top-k, "
                              f"expansion), {b} sequences, 1 row each, context {p.ctx}: "
                              f"<= 100 us"),
                             (cfg0.max_verify, f"selection-b{b}-r{cfg0.max_verify}",
                              f"(extra) the same selection as the padded decode step runs it "
                              f"({cfg0.max_verify} rows per sequence, all but the first "
                              f"padding): <= 100 us")):
            timings = {}
            for impl in self.tqdm(self.impls, name):
                cfg = self.cfg_for(impl)
                try:
                    if impl == "pallas" and jax.default_backend() != "gpu":
                        raise RuntimeError("implementation='pallas' needs a GPU backend")
                    rng = np.random.default_rng(300 + r)
                    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
                    put = jax.device_put
                    keys = put(0.3 * rng.standard_normal((b, cfg.num_pools, Di), np.float32))
                    pos = put(np.broadcast_to(p.ctx - r + np.arange(r, dtype=np.int32),
                                              (b, r)).copy())
                    valid = put(np.broadcast_to(np.arange(r) < 1, (b, r)).copy())
                    sets = [(put(rng.standard_normal((b, r, Hi, Di), np.float32)),
                             put(rng.standard_normal((b, r, Hi), np.float32)
                                 * np.float32((Hi * Di) ** -0.5))) for _ in range(3)]

                    @functools.partial(jax.jit, static_argnums=0)
                    def sel_fn(cfg, qi, w, keys, pos, valid):
                        scores = indexer.pool_scores(cfg, qi, w, keys,
                                                     layer.candidate_pools(cfg, pos, valid))
                        return select.expand_selection(cfg, select.top_pools(cfg, scores),
                                                       pos, valid)

                    it = iter(range(1 << 30))

                    def call(sel_fn=sel_fn, cfg=cfg, sets=sets, keys=keys, pos=pos,
                             valid=valid, it=it):
                        qi, w = sets[next(it) % len(sets)]
                        return sel_fn(cfg, qi, w, keys, pos, valid)

                    jax.block_until_ready(call())
                    timings[impl] = measure(call, warmup=p.warmup, groups=p.groups,
                                            inner=p.inner)
                except Exception as e:
                    _log(f"[bench] selection {impl} failed: {type(e).__name__}: {str(e)[:300]}")
                    self.after_error(e)
                    timings[impl] = {"error": _err(e), "median_us": None}
            self.add_point(name, tgt, selection_cost(cfg0, b, r, p.ctx), timings,
                           lambda pt: pt["median_us"] <= 100.0, batch=b, rows=r, ctx=p.ctx)

    # ----------------------------------------------------------------- prefill
    def group_prefill(self):
        import jax
        import numpy as np

        p = self.plan
        s = p.prefill_tokens
        timings = {}
        for impl in self.tqdm(self.impls, "prefill"):
            cfg = self.cfg_for(impl)
            try:
                weights = self.weights_for(1)
                runner = StepRunner(cfg, weights, 1, s, s, 0, 500)
                jax.block_until_ready(runner.state)
                mark = self.compiles.mark()
                t_first = time.perf_counter()
                jax.block_until_ready(runner())
                first_s = time.perf_counter() - t_first
                n_comp, comp_s = self.compiles.since(mark)
                runner.reset()
                t = measure(runner, warmup=1, groups=p.long_groups, inner=1, reset=runner.reset)
                t.update(first_call_s=first_s, compiles=n_comp, compile_s=comp_s,
                         finite=bool(np.isfinite(np.asarray(runner.last[0][:, -8:])).all()),
                         timed="dsa_jax.layer._step_jit, x [1, S, D], from empty")
                timings[impl] = t
                del runner
            except Exception as e:
                _log(f"[bench] prefill {impl} failed: {type(e).__name__}: {str(e)[:300]}")
                self.after_error(e)
                timings[impl] = {"error": _err(e), "median_us": None}
        self.add_point(
            f"prefill-{s}", f"prefill of {s} tokens, one sequence: <= 25 ms per layer",
            prefill_cost(self.cfg, _param_bytes(self.weights_for(1)), s), timings,
            lambda pt: pt["median_us"] <= 25_000.0, hf="prefill", tokens=s)

    # ----------------------------------------------------------------- scaling and compile
    def group_scaling(self):
        p = self.plan
        top = max(p.scaling_ctx)
        changes = {"max_context": top}
        cfg = self.cfg.replace(**changes)
        pb = _param_bytes(self.weights_for(1))
        per_impl: dict = {impl: {} for impl in self.impls}
        compiles: dict = {impl: {"count": 0, "seconds": 0.0, "first_call_s": None}
                          for impl in self.impls}
        runs = [(impl, ctx) for impl in self.impls for ctx in p.scaling_ctx]
        for impl, ctx in self.tqdm(runs, "scaling"):
            t = self.run_step(impl, 1, 1, 1, ctx, cfg_changes=changes)
            per_impl[impl][ctx] = t
            compiles[impl]["count"] += t.get("compiles", 0) or 0
            compiles[impl]["seconds"] += t.get("compile_s", 0.0) or 0.0
            if compiles[impl]["first_call_s"] is None and "first_call_s" in t:
                compiles[impl]["first_call_s"] = t["first_call_s"]
        for ctx in p.scaling_ctx:
            self.add_point(
                f"scaling-b1-k1-ctx{ctx}", f"scaling: decode step, 1 sequence, context {ctx} "
                f"(one compiled step, max_context {top}), plotted",
                step_cost(cfg, pb, 1, 1, ctx), {impl: per_impl[impl][ctx] for impl in self.impls},
                lambda pt: pt["median_us"] is not None, hf=ctx, batch=1, k=1,
                ctx=ctx, max_context=top, group="scaling")
        # One compile per (B, K) across all contexts: every first call of this (config, B=1)
        # in the run (the K=3 verify pads to max_verify and so shares the K=1 program).
        timings = {}
        for impl in self.impls:
            calls = self.compile_record.get((self.cfg_for(impl, tp_degree=1, **changes), 1), [])
            n = sum(c["compiles"] for c in calls)
            secs = sum(c["compile_s"] for c in calls)
            first = next((c["first_call_s"] for c in calls if c["compiles"]), None)
            errs = [t for t in per_impl[impl].values() if t.get("error")]
            ok = bool(calls) and not errs
            timings[impl] = {"median_us": secs * 1e6 if ok and n else None, "compiles": n,
                             "compile_s": secs, "first_call_s": first, "calls": calls,
                             **({"error": errs[0]["error"]} if errs else {})}
        self.add_point(
            "compile-b1-k1", f"compile: one compile per (B, K) across all contexts "
            f"{list(p.scaling_ctx)} (B=1, K=1, max_context {top}); report its time "
            f"(median_us = the backend compile time)", None, timings,
            lambda pt: pt["impls"][pt["impl"]]["compiles"] == 1,
            contexts=list(p.scaling_ctx),
            compile_counting="jax.monitoring backend_compile_duration events during the first "
                             "step call at each context (and jit cache entries added)")

    def group_memory(self):
        import jax

        from dsa_jax.state import init_state, state_bytes_per_seq

        ctxs = sorted({self.cfg.max_context, max(self.plan.scaling_ctx)})
        for m in ctxs:
            cfg = self.cfg.replace(max_context=m)
            fn = state_bytes_per_seq(cfg)
            st = jax.eval_shape(lambda cfg=cfg: init_state(cfg, 1))
            actual = int(sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(st)))
            pt = {
                "name": f"memory-state-bytes-per-seq-ctx{m}",
                "target": f"memory: state bytes per sequence at max_context {m} "
                          f"(dsa_jax.state.state_bytes_per_seq)",
                "impl": None, "median_us": None, "floor_us": None, "time_over_floor": None,
                "xla_us": None, "hf_us": None, "ratio_vs_xla": None, "ratio_vs_hf": None,
                "value_bytes": fn, "value_MiB": fn / 2 ** 20,
                "state_array_bytes_one_seq": actual,
                "breakdown": {
                    "latent": m * cfg.kv_lora_rank * _itemsize(cfg.cache_dtype),
                    "index_k_and_g": 2 * m * cfg.index_head_dim
                    * _itemsize(cfg.index_cache_dtype),
                    "pool_keys": cfg.num_pools * cfg.index_head_dim * 4,
                    "block_table": cfg.blocks_per_seq * 4, "lengths": 8},
                # The state's arrays for one sequence add the one per-tensor kv_scale (4 bytes).
                "met": abs(actual - fn) <= 4,
            }
            self.result["points"].append(pt)
        self.save()

    # ----------------------------------------------------------------- Hugging Face
    def group_hf(self):
        if self.args.no_hf:
            self.result["baselines"]["hf"] = {"skipped": "--no-hf"}
            return
        try:
            res = hf_decode_times(self.cfg, self.weights_hf(), self.plan.hf_ctx,
                                  self.plan, self.args.seed, self.tqdm)
        except Exception as e:
            _log(f"[bench] HF baseline failed: {type(e).__name__}: {str(e)[:300]}")
            self.result["baselines"]["hf"] = {"error": _err(e)}
            self.save()
            return
        self.result["baselines"]["hf"] = res
        for ctx, r in res.get("contexts", {}).items():
            self.hf[int(ctx)] = r
        for kind in ("verify", "batch", "prefill"):
            for r in (res.get(kind) or {}).values():
                self.hf[kind] = r
        self.save()

    def weights_hf(self):
        self.weights_for(1)
        return self._weights["hf"]

    def hf_best(self, ctx):
        """The faster of HF eager and sdpa: a decode at context `ctx` (int), or "verify",
        "batch", "prefill" (the other points' counterparts)."""
        r = self.hf.get(ctx)
        if not r:
            return None
        vals = [v["median_us"] for v in r.values() if isinstance(v, dict)
                and v.get("median_us") is not None]
        return min(vals) if vals else None

    # ----------------------------------------------------------------- breakdown
    def group_breakdown(self):
        """Where the decode step's time goes: each stage of `layer._append_rows` jitted alone
        (same inputs, the state threaded and donated where a stage writes it), at 1 and
        `big_batch` sequences, K=1 (rows padded to max_verify); and the public `decode`
        call split into its host checks, its row padding and the step."""
        import jax

        from dsa_jax import attend as attend_mod
        from dsa_jax import indexer, layer, projection, select

        p = self.plan
        out: dict = {"note": "stage medians; 'sum' adds the stages, 'step' is the whole jitted "
                             "step (dsa_jax.layer._step_jit) at the same shapes",
                     "runs": {}}
        self.result["breakdown"] = out

        def stage_fns(cfg):
            def proj_fn(weights, x):
                return projection.project(cfg, weights, x)

            def write_fn(weights, state, proj, n_new):
                # The step's own row-write helper (latent + indexer rows + pool keys).
                return layer._write_rows(cfg, weights, state, proj, n_new)[0]

            def scores_fn(proj, pool_keys, pos, valid):
                return indexer.pool_scores(cfg, proj.qi, proj.w, pool_keys,
                                           layer.candidate_pools(cfg, pos, valid))

            def topk_fn(scores):
                return select.top_pools(cfg, scores)

            def expand_fn(pools, pos, valid):
                return select.expand_selection(cfg, pools, pos, valid)

            def attend_fn(state, q_abs, sel):
                return attend_mod.attend(cfg, state, q_abs, sel, layer._live_rows(cfg, q_abs))

            def out_fn(weights, o_lat):
                return projection.output_projection(weights, o_lat)

            return {"project": jax.jit(proj_fn),
                    "cache_writes": jax.jit(write_fn, donate_argnums=(1,)),
                    "pool_scores": jax.jit(scores_fn), "top_k": jax.jit(topk_fn),
                    "expand": jax.jit(expand_fn), "attend": jax.jit(attend_fn),
                    "output_projection": jax.jit(out_fn)}

        # (impl, sequences, rows per sequence, tp): decode at 1 and big_batch sequences, the
        # K=3 verify, one sequence's prompt, and the batch-1 decode at each TP degree > 1 (one
        # rank's work, as the tp8 points).
        verify_k = min(3, self.cfg.max_verify)
        runs = [(impl, b, 1, 1) for b in (1, p.big_batch) for impl in self.impls]
        runs += [(impl, 1, verify_k, 1) for impl in self.impls]
        runs += [(impl, 1, p.prefill_tokens, 1) for impl in self.impls]
        runs += [(impl, 1, 1, tp) for tp in p.tp if tp != 1 for impl in self.impls]
        for impl, b, k, tp in self.tqdm(runs, "breakdown"):
            if self.late():
                break
            key = (f"{impl}-b{b}" if k == 1 else f"{impl}-b{b}-k{k}" if k == verify_k
                   else f"{impl}-prefill{k}") + (f"-tp{tp}" if tp != 1 else "")
            res: dict = {}
            out["runs"][key] = res
            try:
                self._breakdown_one(impl, b, k, stage_fns(self.cfg_for(impl, tp_degree=tp)),
                                    res, tp)
            except Exception as e:
                _log(f"[bench] breakdown {key} failed: {type(e).__name__}: {str(e)[:300]}")
                self.after_error(e)
                res["error"] = _err(e)
            self.save()

    def _breakdown_one(self, impl: str, b: int, k: int, f: dict, res: dict, tp: int = 1
                       ) -> None:
        """Stages of one step: a decode or verify (k <= max_verify rows, padded to max_verify,
        at context ctx) or a prefill (k rows from an empty context; fewer repetitions); at
        TP degree `tp`, one rank's work."""
        import jax
        import numpy as np

        p = self.plan
        cfg = self.cfg_for(impl, tp_degree=tp)
        weights = self.weights_for(tp)
        decode = k <= cfg.max_verify
        rows, start = (cfg.max_verify, p.ctx - p.inner * k) if decode else (k, 0)
        groups, inner = (p.groups, p.inner) if decode else (p.long_groups, 1)
        runner = StepRunner(cfg, weights, b, k, rows, start, 2000 + b + k)
        x = runner.xs[0]
        st = {"state": runner.state}
        pos = jax.device_put(np.full((b, 1), start, np.int32) + np.arange(rows, dtype=np.int32))
        valid = jax.device_put(np.arange(rows)[None, :] < np.full((b, 1), k))
        proj = f["project"](weights, x)
        st["state"] = f["cache_writes"](weights, st["state"], proj, runner.n_new)
        scores = f["pool_scores"](proj, st["state"].pool_keys, pos, valid)
        pools = f["top_k"](scores)
        sel = f["expand"](pools, pos, valid)
        o_lat = f["attend"](st["state"], proj.q_abs, sel)
        jax.block_until_ready(f["output_projection"](weights, o_lat))

        def write_call():
            st["state"] = f["cache_writes"](weights, st["state"], proj, runner.n_new)
            return st["state"]

        calls = {
            "project": lambda: f["project"](weights, x),
            "cache_writes": write_call,
            "pool_scores": lambda: f["pool_scores"](proj, st["state"].pool_keys, pos, valid),
            "top_k": lambda: f["top_k"](scores),
            "expand": lambda: f["expand"](pools, pos, valid),
            "attend": lambda: f["attend"](st["state"], proj.q_abs, sel),
            "output_projection": lambda: f["output_projection"](weights, o_lat),
        }
        for name, call in calls.items():
            t = measure(call, warmup=2, groups=groups, inner=inner)
            res[name] = {q: t[q] for q in ("median_us", "p10_us", "p90_us")}
        res["sum_us"] = sum(v["median_us"] for v in res.values())
        runner.state = st["state"]
        runner.reset()
        jax.block_until_ready(runner())
        t = measure(runner, warmup=2, groups=groups, inner=inner, reset=runner.reset)
        res["step_us"] = t["median_us"]
        # The same step one call at a time (a block after each): dispatch not hidden.
        t1 = measure(runner, warmup=1, groups=groups, inner=1, reset=runner.reset)
        res["step_blocked_each_call_us"] = t1["median_us"]
        if b == 1 and k == 1 and tp == 1:
            res["public_decode"] = self._public_breakdown(cfg, weights, runner)
        try:
            res["profile"] = profile_step(runner, 20 if decode else 1)
        except Exception as e:
            res["profile"] = {"error": _err(e)}

    def _public_breakdown(self, cfg, weights, runner) -> dict:
        """`dsa_jax.decode` = host checks + row padding + the step (+ slicing)."""
        import jax

        from dsa_jax import layer

        p = self.plan
        x1 = runner.xs[0][:, 0]
        res = {}

        def check():
            layer.prepare_step(cfg, weights, runner.state, x1, kind="decode")
            return None

        res["host_checks_us"] = _host_time(check, p.groups * p.inner)

        def pad():
            return layer.RowLayout(cfg.max_verify, 1, True).pad(x1, None)[0]

        jax.block_until_ready(pad())
        res["row_padding_blocked_us"] = measure(pad, warmup=2, groups=p.groups,
                                                inner=1)["median_us"]
        res["decode_us"] = self._time_public_decode(cfg, weights, runner,
                                                    warmup=2)["median_us"]
        res["decode_unchecked_us"] = self._time_public_decode(
            cfg, weights, runner, warmup=2, check=False)["median_us"]
        return res

    # ----------------------------------------------------------------- levers
    def _lever(self, lev: dict, name: str, fn) -> None:
        if self.late():
            lev[name] = {"skipped": "over the time budget"}
            return
        try:
            lev[name] = fn()
        except Exception as e:
            _log(f"[bench] lever {name} failed: {type(e).__name__}: {str(e)[:300]}")
            self.after_error(e)
            lev[name] = {"error": _err(e)}
        self.save()

    def lever_kv_b_forms(self) -> dict:
        """kv_b applied at run time (q_b head rows then U_k; U_v then o_proj, as the step does)
        against absorbed at load time (one GEMM each way), timed on the same random inputs at 1
        and big_batch sequences, rows padded to max_verify as decode runs them, TP 1 and 8."""
        import jax
        import numpy as np

        p, cfg = self.plan, self.cfg
        f = _kv_b_fns()
        out = {"prediction": "at B=1 the run-time form reads fewer weight bytes (see "
                             "kv_b_absorbed_vs_runtime) and so should be faster once the GEMMs "
                             "are bandwidth-bound; at B=64 the absorbed form's extra FLOPs "
                             "(rows x bytes ratio) start to count as well",
               "results": {}}
        for tp in p.tp:
            w = self.weights_for(tp)
            hl, dn, c = w.u_k.shape
            w_q, w_o = jax.block_until_ready(absorbed_kv_b(w))
            q_b = w.q_proj[:hl * dn]
            for b in (1, p.big_batch):
                rng = np.random.default_rng(700 + b)
                rows = (b, cfg.max_verify)
                q_resid = jax.device_put(rng.standard_normal((*rows, cfg.q_lora_rank),
                                                             np.float32))
                o_lat = 0.1 * rng.standard_normal((*rows, hl, c), np.float32)
                o_flat = jax.device_put(o_lat.reshape(*rows, hl * c))
                o_lat = jax.device_put(o_lat)
                calls = {"q_runtime": functools.partial(f["q_runtime"], q_b, w.u_k, q_resid),
                         "q_absorbed": functools.partial(f["matmul"], q_resid, w_q),
                         "o_runtime": functools.partial(f["o_runtime"], w, o_lat),
                         "o_absorbed": functools.partial(f["matmul"], o_flat, w_o)}
                res = _wall_and_kernel_us(calls, p)
                for form in ("runtime", "absorbed"):
                    for t in ("", "_kernel"):
                        res[f"{form}{t}_us"] = _sum_or_none(res[f"q_{form}{t}_us"],
                                                            res[f"o_{form}{t}_us"])
                _add_ratios(res, "runtime", "absorbed")
                res["q_rel_diff"] = _rel_diff(np.asarray(calls["q_absorbed"]()).reshape(
                    *rows, hl, c), calls["q_runtime"]())
                res["o_rel_diff"] = _rel_diff(calls["o_absorbed"](), calls["o_runtime"]())
                out["results"][f"tp{tp}-b{b}"] = res
        out["note"] = ("<half>_us: median wall time of the jitted half, back-to-back calls "
                       "(at B=1 this is dispatch-bound); <half>_kernel_us: its device kernel "
                       "time from a profiler trace (the bytes-bound figure the prediction is "
                       "about); rel_diff = ||absorbed - runtime|| / ||runtime|| (bf16 weights: "
                       "the folds round once more)")
        return out

    def lever_pool_keys(self) -> dict:
        """Pool keys kept in the state (what the step reads) against recomputing every pool's
        key from the cached k and gate rows in the step (softmax over its KP members), then the
        same pool scores, at 1 and big_batch sequences, one row each, context ctx."""
        import jax
        import numpy as np

        from dsa_jax import layer

        p, kp, di = self.plan, self.cfg.index_kpool, self.cfg.index_head_dim
        f = _pool_key_fns()
        out = {"prediction": f"recomputing reads the k and gate rows (2 x {kp} x {di} bf16 = "
                             f"{2 * kp * di * 2} bytes per pool) instead of one fp32 key "
                             f"({di * 4} bytes): {kp}x the bytes, so slower once bandwidth-"
                             "bound (B=64); at B=1 both are launch-bound",
               "results": {}}
        ape = self.weights_for(1).ape
        for impl in self.impls:
            cfg = self.cfg_for(impl)
            if impl == "pallas" and jax.default_backend() != "gpu":
                continue
            for b in (1, p.big_batch):
                st = random_state(cfg, b, p.ctx, 800 + b)
                rng = np.random.default_rng(800 + b)
                hi = cfg.index_n_heads
                qi = jax.device_put(rng.standard_normal((b, 1, hi, di), np.float32))
                w = jax.device_put(rng.standard_normal((b, 1, hi), np.float32)
                                   * np.float32((hi * di) ** -0.5))
                pos = jax.device_put(np.full((b, 1), p.ctx - 1, np.int32))
                n_cand = layer.candidate_pools(cfg, pos, pos >= 0)
                calls = {"cached": functools.partial(f["cached"], cfg, qi, w, st.pool_keys,
                                                     n_cand),
                         "recomputed": functools.partial(f["recomputed"], cfg, qi, w,
                                                         st.index_k, st.index_g, ape, n_cand)}
                res = _compare_forms(calls, p, "cached", "recomputed")
                out["results"][f"{impl}-b{b}"] = res
        out["note"] = ("cached: the step's pool_scores on the state's keys; recomputed: "
                       "every pool's key from the cache rows, then the same pool_scores; "
                       + _FORM_TIMES)
        return out

    def lever_fused_projections(self) -> dict:
        """The step's two fused input GEMMs (x_proj = [q_a; kv_a; wk; gate; weights_proj],
        q_proj = [q_b; wq_b]) against seven separate GEMMs on the same (pre-split) weights,
        through the absorbed query, at 1 and big_batch sequences (rows padded to max_verify),
        TP 1 and 8; the two give the same projections."""
        import jax
        import numpy as np

        p, cfg = self.plan, self.cfg
        fused, separate = _projection_fns()
        out = {"prediction": "at B=1 the GEMMs are bandwidth-bound: both forms read the same "
                             "weight bytes, so fusing saves only the 5 extra launches (a few us "
                             "each); at B=64 the wider GEMMs also use the tensor cores better",
               "results": {}}
        for tp in p.tp:
            c = cfg.replace(tp_degree=tp)
            w = self.weights_for(tp)
            pieces = jax.block_until_ready(split_projection_weights(c, w))
            for b in (1, p.big_batch):
                rng = np.random.default_rng(600 + b)
                x = jax.device_put(rng.standard_normal((b, c.max_verify, c.hidden_size),
                                                       np.float32).astype(w.x_proj.dtype))
                calls = {"fused": functools.partial(fused, c, w, x),
                         "separate": functools.partial(separate, c, pieces, w.q_a_norm,
                                                       w.u_k, x)}
                res = _compare_forms(calls, p, "fused", "separate")
                a, z = calls["fused"](), calls["separate"]()
                res["max_rel_diff"] = max(_rel_diff(z[i], a[i]) for i in range(len(z)))
                out["results"][f"tp{tp}-b{b}"] = res
        out["note"] = ("fused: dsa_jax.projection.project (2 input GEMMs + the per-head U_k); "
                       "separate: the same with 7 input GEMMs; " + _FORM_TIMES)
        return out

    def lever_donated_state(self) -> dict:
        """The jitted step with its state donated (updated in place, as the library jits it)
        against the same step without donation (XLA then writes a fresh copy of every cache),
        at 1 and big_batch sequences, K=1, TP 1, each implementation."""
        import jax

        from dsa_jax import layer

        p = self.plan
        copying = jax.jit(layer.step, static_argnames=("cfg",))
        out = {"prediction": "without donation every step copies the whole state (18 MiB per "
                             "sequence at 16K): ~10 us at B=1, ~0.6 ms at B=64 at the copy "
                             "bandwidth", "results": {}}
        for impl in self.impls:
            cfg = self.cfg_for(impl)
            for b in (1, p.big_batch):
                res = {}
                for form, step in (("donated", layer._step_jit), ("copied", copying)):
                    runner = StepRunner(cfg, self.weights_for(1), b, 1, cfg.max_verify,
                                        p.ctx - p.inner, 1500 + b)
                    runner.step = step
                    jax.block_until_ready(runner())
                    res[f"{form}_us"] = measure(runner, warmup=2, groups=p.groups,
                                                inner=p.inner, reset=runner.reset)["median_us"]
                    res[f"{form}_kernel_us"] = profile_step(runner, 10, top=0).get(
                        "kernel_us_per_step")
                    del runner
                _add_ratios(res, "donated", "copied")
                out["results"][f"{impl}-b{b}"] = res
        out["note"] = ("donated: dsa_jax.layer._step_jit; copied: jax.jit of the same "
                       "function without donate_argnames; _us: median wall time of "
                       "back-to-back steps, _kernel_us: device kernel time (trace; the "
                       "state copies are kernels too)")
        return out

    def group_levers(self):
        p = self.plan
        lev = self.result["levers"]
        lev["kv_b_absorbed_vs_runtime"] = {
            f"tp{tp}": absorbed_vs_runtime(self.cfg.replace(tp_degree=tp)) for tp in p.tp}
        self.save()
        if self.args.no_levers:
            return
        # Split count of the gather-attend, at the decode-step shapes (pallas only).
        if "pallas" in self.impls:
            sweep = {}
            for b in (1, p.big_batch):
                for s in self.tqdm((None,) + tuple(p.split_sweep), f"split sweep b{b}"):
                    if self.late():
                        break
                    t = self.time_attend(b, 1, self.cfg.num_heads, self.cfg.sel_width, p.ctx,
                                         "pallas", 900 + b, num_splits=s)
                    sweep[f"b{b}-splits{s or 'default'}"] = {
                        "B": b, "splits": s or "default",
                        **{k: t.get(k) for k in ("median_us", "p10_us", "p90_us", "error")}}
                    self.save()
            lev["attend_split_sweep"] = {
                "results": sweep, "shape": "R=1, H=num_heads, W=sel_width, fp8",
                "note": "splits = programs per (row, head block) over the slot list; default = "
                        "the kernel's own choice (num_splits=None)"}
            self.save()
        self._lever(lev, "kv_b_absorbed_vs_runtime_measured", self.lever_kv_b_forms)
        self._lever(lev, "pool_keys_cached_vs_recomputed", self.lever_pool_keys)
        self._lever(lev, "fused_projections_vs_separate", self.lever_fused_projections)
        self._lever(lev, "donated_state_vs_copied", self.lever_donated_state)
        # Row padding: decode K=1 with max_verify=1 (rows not padded to 4) vs the padded step.
        pad = {}
        for impl in self.tqdm(self.impls, "max_verify=1"):
            if self.late():
                break
            pad[impl] = {k: v for k, v in self.run_step(
                impl, 1, 1, 1, p.ctx, cfg_changes={"max_verify": 1}).items()
                if k in ("median_us", "p10_us", "p90_us", "error", "compiles")}
            pad[impl]["padded_step_us"] = self.steps.get((1, 1, 1, impl), {}).get("median_us")
        lev["decode_rows_padded_to_max_verify"] = {
            "note": "decode K=1 at max_verify=1 (one row) vs the padded step "
                    f"(max_verify={self.cfg.max_verify} rows, {self.cfg.max_verify - 1} "
                    "of them padding)", "results": pad}
        self.save()


def absorbed_kv_b(weights):
    """The load-time form of kv_b: `W_qb` folded with `U_k` ([Hl*C, R_q]) and `o_proj` with
    `U_v` ([D, Hl*C]), folded in fp32 and stored in the param dtype (the lever's other side)."""
    import jax.numpy as jnp

    hl, dn, c = weights.u_k.shape
    f32 = jnp.float32
    q_b = weights.q_proj[:hl * dn].astype(f32).reshape(hl, dn, -1)  # [Hl, Dn, R]
    w_q = jnp.einsum("hdc,hdr->hcr", weights.u_k.astype(f32), q_b,
                     precision="highest").reshape(hl * c, -1)
    o = weights.o_proj.astype(f32).reshape(weights.o_proj.shape[0], hl, -1)  # [D, Hl, Dv]
    w_o = jnp.einsum("ehv,hvc->ehc", o, weights.u_v.astype(f32),
                     precision="highest").reshape(o.shape[0], hl * c)
    return w_q.astype(weights.q_proj.dtype), w_o.astype(weights.o_proj.dtype)


def _wall_and_kernel_us(calls: dict, plan: Plan) -> dict:
    """For each named call: `<name>_us`, the median wall time of back-to-back calls, and
    `<name>_kernel_us`, its device kernel time per call (None off a GPU)."""
    res = {}
    for name, fn in calls.items():
        res[f"{name}_us"] = measure(fn, warmup=plan.warmup, groups=plan.groups,
                                    inner=plan.inner)["median_us"]
        res[f"{name}_kernel_us"] = kernel_us(fn)
    return res


_FORM_TIMES = "_us: median wall time, _kernel_us: device kernel time (trace)"


def _add_ratios(res: dict, base: str, other: str) -> None:
    """A two-form lever's `<other>_over_<base>` ratios, of wall and of kernel times."""
    for t in ("", "_kernel"):
        res[f"{other}_over_{base}{t}"] = _ratio(res[f"{other}{t}_us"], res[f"{base}{t}_us"])


def _compare_forms(calls: dict, plan: Plan, base: str, other: str) -> dict:
    """Wall and kernel times of a lever's two forms and the ratios of `other` to `base`."""
    res = _wall_and_kernel_us(calls, plan)
    _add_ratios(res, base, other)
    return res


def _sum_or_none(a, b):
    return None if a is None or b is None else a + b


@functools.lru_cache(maxsize=1)
def _kv_b_fns() -> dict:
    """Jitted halves of the kv_b lever: the step's run-time q and out paths, and one GEMM."""
    import jax

    from dsa_jax import projection

    def q_runtime(q_b, u_k, q_resid):
        hl, dn, _ = u_k.shape
        q = projection._matmul(q_resid, q_b)  # [..., Hl*Dn]
        return projection._per_head(q.reshape(*q.shape[:-1], hl, dn), u_k, 1)  # [..., Hl, C]

    return {"q_runtime": jax.jit(q_runtime),
            "o_runtime": jax.jit(projection.output_projection),
            "matmul": jax.jit(projection._matmul)}


def split_projection_weights(cfg, weights) -> tuple:
    """The fused input weights cut back into the seven GEMMs they fuse: x_proj rows q_a, kv_a,
    wk, gate, weights_proj; q_proj rows q_b, wq_b (the separate side of the fusion lever)."""
    r, c, di, hi = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_n_heads
    cuts = [0, r, r + c, r + c + di, r + c + 2 * di, r + c + 2 * di + hi]
    x = tuple(weights.x_proj[a:b] for a, b in zip(cuts, cuts[1:], strict=False))
    qn = cfg.local_heads * cfg.qk_nope_head_dim
    return x, (weights.q_proj[:qn], weights.q_proj[qn:])


@functools.lru_cache(maxsize=1)
def _projection_fns():
    """Jitted sides of the fusion lever; both return (q_abs, kv_raw, qi, k_raw, g, w)."""
    import jax

    from dsa_jax import projection

    def fused(cfg, weights, x):
        return tuple(projection.project(cfg, weights, x))

    def separate(cfg, pieces, q_a_norm, u_k, x):
        (wqa, wkva, wk, wg, ww), (wqb, wqi) = pieces
        q_resid = projection.rms_norm(projection._matmul(x, wqa), q_a_norm, cfg.rms_norm_eps)
        q = projection._matmul(q_resid, wqb)
        q = q.reshape(*q.shape[:-1], cfg.local_heads, cfg.qk_nope_head_dim)
        qi = projection._matmul(q_resid, wqi)
        qi = qi.reshape(*qi.shape[:-1], cfg.index_n_heads, cfg.index_head_dim)
        return (projection._per_head(q, u_k, 1), projection._matmul(x, wkva), qi,
                projection._matmul(x, wk), projection._matmul(x, wg), projection._matmul(x, ww))

    return (jax.jit(fused, static_argnums=0), jax.jit(separate, static_argnums=0))


@functools.lru_cache(maxsize=1)
def _pool_key_fns() -> dict:
    """Jitted sides of the pool-key lever: scores on cached keys, or keys recomputed first."""
    import jax

    from dsa_jax import indexer
    from dsa_jax.pallas import index_write

    def cached(cfg, qi, w, keys, n_cand):
        return indexer.pool_scores(cfg, qi, w, keys, n_cand)

    def recomputed(cfg, qi, w, index_k, index_g, ape, n_cand):
        b, t, di = index_k.shape
        members = (b, t // ape.shape[0], ape.shape[0], di)  # [B, P, KP, Di]
        keys = index_write.pool_key(index_k.reshape(members), index_g.reshape(members), ape)
        return indexer.pool_scores(cfg, qi, w, keys, n_cand)

    return {"cached": jax.jit(cached, static_argnums=0),
            "recomputed": jax.jit(recomputed, static_argnums=0)}


def _rel_diff(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except Exception:
        pass
    return str(o)


# ---------------------------------------------------------------------------------------------
# Torch: ceilings cross-check, and the Hugging Face block
# ---------------------------------------------------------------------------------------------


def profile_step(runner: StepRunner, steps: int, top: int = 25) -> dict:
    """Device kernels of `steps` pipelined calls of the step, from a JAX profiler trace
    (CUPTI): per kernel name its time and launches per step, the total kernel time per step,
    and the span from the first kernel's start to the last one's end per step."""
    import gzip
    import tempfile

    import jax

    runner.reset()
    for _ in range(2):
        jax.block_until_ready(runner())
    runner.reset()
    d = tempfile.mkdtemp(prefix="dsa-bench-prof-")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        out = None
        for _ in range(steps):
            out = runner()
        jax.block_until_ready(out)
    paths = []
    for root, _, files in os.walk(d):
        paths += [os.path.join(root, f) for f in files if f.startswith("perfetto_trace")]
    if not paths:
        raise RuntimeError(f"no perfetto trace under {d}")
    with gzip.open(paths[0]) as f:
        data = json.load(f)
    ev = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in ev
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in ev
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    dev = {pid for pid, name in procs.items() if "GPU" in name or "/device:" in name}
    kern: dict = {}
    spans = []
    modules = []
    by_thread: dict = {}
    dev_ev = [e for e in ev if e.get("ph") == "X" and e.get("pid") in dev]
    for e in dev_ev:
        tname = threads.get((e["pid"], e.get("tid")), "")
        by_thread[tname] = by_thread.get(tname, 0.0) + float(e.get("dur", 0.0))
    has_streams = any("Stream" in t for t in by_thread)
    for e in dev_ev:
        tname = threads.get((e["pid"], e.get("tid")), "")
        dur = float(e.get("dur", 0.0))
        is_kernel = ("Stream" in tname if has_streams else
                     not any(w in tname for w in ("Module", "Ops", "Step", "Launch")))
        if is_kernel:
            k = kern.setdefault(e.get("name", "?"), [0.0, 0])
            k[0] += dur
            k[1] += 1
            spans.append((float(e["ts"]), float(e["ts"]) + dur))
        elif "Module" in tname:
            modules.append(dur)
    if not spans:
        return {"error": "no device kernel events in the trace",
                "processes": sorted(procs.values()), "threads": sorted(set(threads.values()))}
    by_thread = {k: v / steps for k, v in by_thread.items()}
    spans.sort()
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    rows = sorted(kern.items(), key=lambda kv: -kv[1][0])
    return {
        "steps": steps,
        "kernel_us_per_step": sum(v[0] for v in kern.values()) / steps,
        "kernel_busy_us_per_step": busy / steps,
        "first_to_last_kernel_us_per_step": (spans[-1][1] - spans[0][0]) / steps,
        "launches_per_step": sum(v[1] for v in kern.values()) / steps,
        "module_us_per_step": (sum(modules) / steps) if modules else None,
        "device_threads_us_per_step": by_thread,
        "top_kernels": [{"name": n[:160], "us_per_step": v[0] / steps,
                         "launches_per_step": v[1] / steps} for n, v in rows[:top]],
    }


class _Calls:
    """A plain callable as `profile_step`'s runner (nothing to reset between calls)."""

    def __init__(self, call: Callable[[], Any]):
        self.call = call

    def __call__(self):
        return self.call()

    def reset(self):
        pass


def sweep_row(res: dict, row: dict, work: Callable[[dict], None], path: str) -> None:
    """One row of a device sweep script (benchmarks/h200_*.py): `work(row)` fills the row; a
    failure is recorded in it and in `res["errors"]`, and the sweep goes on. The row is printed
    as JSON and all of `res` rewritten to `path`, so a run cut short keeps what it measured."""
    try:
        work(row)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        res["errors"].append(traceback.format_exc()[-2000:])
    res["results"].append(row)
    print(json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


def sweep_times(call: Callable[[], Any], heavy: bool, heavy_inner: int = 1) -> dict:
    """A device sweep row's times: `wall_us` (median of back-to-back calls) and `kernel_us`
    (device kernel time per call; None off a GPU); fewer repetitions for a `heavy` call."""
    wall = measure(call, warmup=2, groups=5 if heavy else 15,
                   inner=heavy_inner if heavy else 10)["median_us"]
    return {"wall_us": wall, "kernel_us": kernel_us(call, 3 if heavy else 20)}


def kernel_us(call: Callable[[], Any], calls: int = 20) -> float | None:
    """Device kernel time per call (CUPTI trace; no dispatch or gaps); None where the backend
    records no kernels (a CPU)."""
    return profile_step(_Calls(call), calls, top=0).get("kernel_us_per_step")


def _host_time(fn, reps: int) -> float:
    """Median host seconds of a host-side function, in us."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def _torch_time(fn, reps: int, warmup: int = 2) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return {"median_us": statistics.median(ts), "min_us": ts[0], "max_us": ts[-1],
            "reps": reps, "timing": "cuda events" if cuda else "perf_counter"}


def _torch_ceilings() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    out = {}
    n = 1 << 28
    bufs = [torch.randn(n, device="cuda"), torch.empty(n, device="cuda")]
    t = _torch_time(lambda: bufs[1].copy_(bufs[0]), 10)
    out["torch_copy"] = {"bytes_per_op": 8 * n, "GBps": 8 * n / (t["median_us"] * 1e-6) / 1e9,
                         **t}
    bufs.clear()
    m = 8192
    mats = [torch.randn(m, m, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    t = _torch_time(lambda: mats[0] @ mats[1], 10)
    out["torch_matmul_bf16"] = {"n": m, "TFLOPs": 2 * m ** 3 / (t["median_us"] * 1e-6) / 1e12,
                                **t}
    mats.clear()
    torch.cuda.empty_cache()
    return out


def _hf_dsa_layer_type() -> str:
    """The installed transformers' name for a DSA layer ("indexed_attention" in 5.23,
    "deepseek_sparse_attention" in 5.17, the GPU image's)."""
    from dsa_jax.hf_oracle import LAYER_TYPE

    return LAYER_TYPE


def _hf_block(cfg, hf_tensors: dict, dev: str):
    """HF `Glm5NextTextAttention` (bf16, eager to start with) holding `hf_tensors`, and its
    config."""
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    config = Glm5NextTextConfig(
        vocab_size=64, hidden_size=cfg.hidden_size, intermediate_size=64,
        moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=0, v_head_dim=cfg.v_head_dim, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        index_kpool=cfg.index_kpool, index_kpool_always_select_tail=cfg.always_select_tail,
        layer_types=[_hf_dsa_layer_type()], indexer_types=["full"], mlp_layer_types=["dense"],
        rms_norm_eps=cfg.rms_norm_eps, pad_token_id=0)
    config._attn_implementation = "eager"
    with torch.device(dev):
        attn = Glm5NextTextAttention(config, 0)
    attn = attn.to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, prm in attn.named_parameters():
            prm.copy_(torch.from_numpy(hf_tensors[name]).to(prm.device, prm.dtype))
    return attn, config


def hf_decode_times(cfg, hf_tensors: dict, contexts, plan: Plan, seed: int, tqdm_fn) -> dict:
    """One decode step of HF `Glm5NextTextAttention` (bf16, batch 1) at each context, with a
    DynamicCache prefilled to the context (`_hf_fill_tiled`); eager and sdpa. The cache layer
    is restored to its prefilled contents before every timed call. Then the verify, batch and
    prefill points' counterparts."""
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    attn, config = _hf_block(cfg, hf_tensors, dev)
    res: dict = {"transformers": transformers.__version__, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                 "layer_type": config.layer_types[0],
                 "what": "Glm5NextTextAttention bf16, batch 1, one decode step, DynamicCache "
                         "prefilled to the context, layer type "
                         f"{config.layer_types[0]!r}, attention_mask = bool ones [B, S] (the "
                         "indexer mask)",
                 "contexts": {}}
    runs = [(ctx, impl) for ctx in contexts for impl in ("eager", "sdpa")]
    for ctx, impl in tqdm_fn(runs, "HF glm5_next"):
        entry = res["contexts"].setdefault(str(ctx), {})
        try:
            config._attn_implementation = impl
            reps = plan.groups if ctx <= 16384 else plan.long_groups
            finite, timing, fill = _hf_one(cfg, attn, config, ctx, dev, seed, max(2, reps))
            entry[impl + "_finite"] = finite
            entry[impl] = timing
            entry[impl]["cache_fill"] = fill
        except Exception as e:
            entry[impl] = {"error": _err(e), "median_us": None}
        if dev == "cuda":
            torch.cuda.empty_cache()
    # The other points' counterparts, at the decode context: a K=3 verify and a batch of
    # decodes (the cache filled for one sequence, repeated), and a prompt from empty.
    ctx = plan.ctx
    extra = [("verify", f"b1-k3-ctx{ctx}", dict(batch=1, rows=3)),
             ("batch", f"b{plan.big_batch}-k1-ctx{ctx}", dict(batch=plan.big_batch, rows=1)),
             ("prefill", f"s{plan.prefill_tokens}", None)]
    runs = [(kind, key, kw, impl) for kind, key, kw in extra for impl in ("eager", "sdpa")]
    for kind, key, kw, impl in tqdm_fn(runs, "HF glm5_next, other points"):
        entry = res.setdefault(kind, {}).setdefault(key, {})
        try:
            config._attn_implementation = impl
            if kw is None:
                entry[impl] = _hf_prefill(cfg, attn, config, plan.prefill_tokens, dev, seed,
                                          max(2, plan.long_groups))
            else:
                entry[impl] = _hf_in_chunks(
                    lambda b, kw=kw: _hf_one(cfg, attn, config, ctx, dev, seed,
                                             max(2, plan.groups), batch=b, rows=kw["rows"]),
                    kw["batch"])
        except Exception as e:
            entry[impl] = {"error": _err(e), "median_us": None}
        if dev == "cuda":
            torch.cuda.empty_cache()
    return res


def _hf_fill_tiled(cfg, attn, config, ctx: int, dev: str, gen, fill_tokens: int = 1024):
    """A DynamicCache holding `ctx` tokens: the HF block's own forward over `n` random tokens
    (n <= fill_tokens, a multiple of KP), then every cache tensor tiled along its sequence axis to
    `ctx` (pools stay aligned). Layout-agnostic: transformers 5.17 caches per-head keys and
    values [B, H, S, D], 5.23 the latent [B, 1, S, C]; the sequence axis is the one that
    grows when KP more tokens go in. Returns (cache, description)."""
    import torch
    from transformers import DynamicCache

    kp = cfg.index_kpool
    n = max(2 * kp, min(ctx, fill_tokens) // kp * kp)
    cache = DynamicCache(config=config)

    def forward(count):
        x = torch.randn(1, count, cfg.hidden_size, device=dev, generator=gen,
                        dtype=torch.bfloat16)
        with torch.no_grad():
            attn(x, attention_mask=torch.ones(1, count, dtype=torch.bool, device=dev),
                 past_key_values=cache)

    def shapes():
        return {k: tuple(v.shape) for k, v in cache.layers[0].__dict__.items()
                if isinstance(v, torch.Tensor) and v.dim() > 1}

    forward(n - kp)
    before = shapes()
    forward(kp)
    layer = cache.layers[0]
    for name, shape in shapes().items():
        old = before.get(name, ())
        grown = ([d for d, (a, b) in enumerate(zip(old, shape, strict=True)) if b - a == kp]
                 if len(old) == len(shape) else [])
        if len(grown) != 1 or shape[grown[0]] != n:
            raise RuntimeError(f"HF cache tensor {name!r} {shape}: no single sequence axis "
                               f"of length {n} (before the last {kp} tokens: "
                               f"{before.get(name)})")
        if ctx > n:
            t, d = getattr(layer, name), grown[0]
            reps = [1] * t.dim()
            reps[d] = -(-ctx // n)
            setattr(layer, name, t.repeat(*reps).narrow(d, 0, ctx).contiguous())
    if cache.get_seq_length() != ctx:
        raise RuntimeError(f"HF cache length {cache.get_seq_length()} after the fill, "
                           f"expected {ctx}")
    how = (f"HF forward over {n} random tokens" +
           (f", its cache tensors tiled along the sequence to {ctx}" if ctx > n else ""))
    return cache, how


def _hf_in_chunks(run, batch: int) -> dict:
    """`run(b)` -> (finite, timing, fill) for `b` sequences at once. When `batch` sequences do
    not fit in GPU memory, halve until they do and report `batch / b` calls of `b` (the time
    of running all `batch` sequences through HF on this GPU), saying so."""
    import torch

    b, why = batch, None
    while True:
        try:
            finite, timing, fill = run(b)
            break
        except torch.cuda.OutOfMemoryError as e:
            if b == 1:
                raise
            why = why or f"{batch} at once: {type(e).__name__}: {str(e)[:160]}"
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            b //= 2
    out = dict(timing, finite=finite, cache_fill=fill)
    if b != batch:
        calls = -(-batch // b)
        for key in ("median_us", "min_us", "max_us"):
            out[key] = timing[key] * calls
        out["chunks"] = {"sequences_per_call": b, "calls": calls, "per_call_us":
                         timing["median_us"], "why": why}
    return out


def _batched_cache_state(state: dict, batch: int) -> dict:
    """A cache layer's attributes with every batch-1 tensor repeated to `batch` sequences (the
    same context in each: the timing, not the values, matters)."""
    import torch

    if batch == 1:
        return state
    return {k: (v.repeat(batch, *([1] * (v.dim() - 1)))
                if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[0] == 1 else v)
            for k, v in state.items()}


def _hf_one(cfg, attn, config, ctx: int, dev: str, seed: int, reps: int, batch: int = 1,
            rows: int = 1) -> tuple[bool, dict, str]:
    """One context: a cache holding `ctx` tokens (filled for one sequence, repeated to `batch`),
    then timed steps of `rows` new tokens per sequence (1: a decode; K: a K-token verify), each
    starting from that cache (the cache layer's attributes are restored before every call)."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(seed + ctx)
    xs = [torch.randn(batch, rows, cfg.hidden_size, device=dev, generator=gen,
                      dtype=torch.bfloat16) for _ in range(3)]
    mask = torch.ones(batch, rows, dtype=torch.bool, device=dev)

    def make_step(cache):
        layer = cache.layers[0]
        saved = _batched_cache_state(dict(layer.__dict__), batch)
        count = [0]

        def step():
            layer.__dict__.clear()
            layer.__dict__.update(saved)
            x = xs[count[0] % len(xs)]
            count[0] += 1
            with torch.no_grad():
                return attn(x, attention_mask=mask, past_key_values=cache)

        return step

    cache, fill = _hf_fill_tiled(cfg, attn, config, ctx, dev, gen)
    step = make_step(cache)
    out = step()
    finite = bool(torch.isfinite(out[0]).all())
    timing = _torch_time(step, reps, warmup=1)
    if cache.get_seq_length() != ctx + rows:
        raise RuntimeError(f"HF cache length {cache.get_seq_length()} after a step at context "
                           f"{ctx}, expected {ctx + rows}")
    if out[0].shape[0] != batch:
        raise RuntimeError(f"HF output batch {out[0].shape[0]}, expected {batch}")
    return finite, timing, fill


def _hf_prefill(cfg, attn, config, tokens: int, dev: str, seed: int, reps: int) -> dict:
    """One forward of the HF block over a `tokens`-token prompt from an empty cache, timed."""
    import torch
    from transformers import DynamicCache

    gen = torch.Generator(device=dev).manual_seed(seed + tokens)
    x = torch.randn(1, tokens, cfg.hidden_size, device=dev, generator=gen, dtype=torch.bfloat16)
    mask = torch.ones(1, tokens, dtype=torch.bool, device=dev)

    def step():
        with torch.no_grad():
            return attn(x, attention_mask=mask, past_key_values=DynamicCache(config=config))

    out = step()
    timing = _torch_time(step, reps, warmup=1)
    timing["finite"] = bool(torch.isfinite(out[0]).all())
    return timing


# ---------------------------------------------------------------------------------------------
# Machine description, table, entry point
# ---------------------------------------------------------------------------------------------


def machine_info() -> dict:
    import jax

    info: dict = {"hostname": socket.gethostname(), "python": platform.python_version(),
                  "jax": jax.__version__, "backend": jax.default_backend()}
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    try:
        dev = jax.devices()[0]
        info["device"] = dev.device_kind
        info["device_count"] = jax.device_count()
    except Exception as e:
        info["device_error"] = repr(e)
    from importlib import metadata

    for dist in ("triton", "torch", "transformers", "numpy", "jax-cuda13-plugin",
                 "jax-cuda12-plugin"):
        try:
            info[dist] = metadata.version(dist)
        except Exception:
            pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.sm,clocks.max.sm,clocks.mem,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if q.returncode == 0:
            info["nvidia_smi"] = q.stdout.strip()
    except Exception:
        pass
    for var in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS", "JAX_PLATFORMS"):
        if os.environ.get(var):
            info[var] = os.environ[var]
    return info


def format_table(result: dict) -> str:
    rows = [("point", "impl", "time", "floor", "t/floor", "met", "XLA", "vs XLA", "HF",
             "vs HF")]
    for p in result.get("points", []):
        if p.get("name", "").startswith("memory"):
            rows.append((p["name"], "-", f"{p['value_MiB']:.1f} MiB", "-", "-", str(p["met"]),
                         "-", "-", "-", "-"))
            continue
        f = p.get("time_over_floor")
        rx, rh = p.get("ratio_vs_xla"), p.get("ratio_vs_hf")
        rows.append((p["name"], str(p.get("impl")), fmt_us(p.get("median_us")),
                     fmt_us(p.get("floor_us")), f"{f:.2f}" if f else "-", str(p.get("met")),
                     fmt_us(p.get("xla_us")), f"{rx:.2f}" if rx else "-",
                     fmt_us(p.get("hf_us")), f"{rh:.4f}" if rh else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                     for r in rows)


GROUPS = ("decode", "hf", "kernels", "selection", "prefill", "scaling", "tp8", "memory",
          "levers", "breakdown")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dsa-jax bench",
        description="Benchmark the DSA block (GLM-5.3-Flash shapes): the layer step with "
                    "implementation pallas and xla, the kernels alone, the selection, prefill, "
                    "context scaling, compile count, state memory, the Hugging Face glm5_next "
                    "block as a baseline, against a measured roofline. Writes one JSON.",
        epilog="Exit status: 0 done (points that failed to run are recorded in the JSON), "
               "1 the ceilings could not be measured, 2 bad arguments, 3 the device was lost "
               "after an error (partial JSON written).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO_ROOT, "configs", "glm5.3-flash.json"),
                    help="a configs/*.json file (ignored with --smoke)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny config, tiny shapes, few repetitions (a CPU check of the suite)")
    ap.add_argument("--quick", action="store_true",
                    help="the full shapes with the fewest repetitions (a dry run)")
    ap.add_argument("--impls", default="xla,pallas",
                    help="implementations of the layer step, comma separated, run in this "
                         "order (each point's figure is pallas when it ran, else xla)")
    ap.add_argument("--only", default="", help=f"comma-separated groups to run, of {GROUPS}")
    ap.add_argument("--skip", default="", help="comma-separated groups to skip")
    ap.add_argument("--out", default=None,
                    help="output folder (default: $OUT when set, else benchmarks/results)")
    ap.add_argument("--name", default=None, help="output file name (default: "
                    "<device>-bench-<UTC date>.json, smoke-bench-... with --smoke)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. the commit)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="skip the groups not yet started once this many seconds have passed "
                         "(0: no limit)")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--no-levers", action="store_true",
                    help="levers: byte counts only, no split sweep / padding runs")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    ap.add_argument("--mem-fraction", default="0.45",
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION when not set (torch needs the rest: "
                         "HF 5.17 caches per-head keys and values, ~60 GB for 64 sequences "
                         "at 16K)")
    return ap


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    args.argv = raw
    only = {g for g in args.only.split(",") if g}
    skip = {g for g in args.skip.split(",") if g}
    unknown = (only | skip) - set(GROUPS)
    if unknown:
        print(f"dsa-jax bench: unknown group(s) {sorted(unknown)}; groups are {GROUPS}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", args.mem_fraction)
    # HF's caches grow by concatenation: without expandable segments torch fragments its pool
    # between contexts and a 9000-token eager prefill no longer finds 20 GB in one piece.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    import jax

    from dsa_jax.config import DsaConfig
    from dsa_jax.shapes import glm53_flash, tiny

    if args.smoke:
        cfg = tiny(implementation="xla")
        plan = smoke_plan(cfg)
    else:
        cfg = (glm53_flash() if os.path.abspath(args.config) == os.path.abspath(
            os.path.join(REPO_ROOT, "configs", "glm5.3-flash.json"))
            else DsaConfig.from_json(args.config))
        plan = full_plan(cfg)
        if args.quick:
            plan = quick(plan)
    now = datetime.datetime.now(datetime.UTC)
    info = machine_info()
    out_dir = args.out or os.environ.get("OUT") or DEFAULT_RESULTS
    slug = "".join(ch if ch.isalnum() else "-" for ch in info.get("device", "cpu").lower())
    slug = "-".join(s for s in slug.split("-") if s)
    if "h200" in slug:
        slug = "h200"
    name = args.name or (f"{'smoke' if args.smoke else slug}-bench-"
                         f"{now.strftime('%Y%m%d-%H%M%S')}.json")
    via = "python -m dsa_jax.bench" if argv is None else "dsa-jax bench"
    command = " ".join([via] + [shlex.quote(a) for a in raw])
    suite = Suite(args, cfg, plan, os.path.join(out_dir, name), command)
    suite.result.update(
        date=now.isoformat(), machine=info, jax_version=jax.__version__, note=args.note,
        config={k: v for k, v in dataclasses.asdict(cfg).items()},
        plan=dataclasses.asdict(plan),
        timing_method=(
            "JAX: warm-up calls, then groups of `inner` back-to-back calls with "
            "jax.block_until_ready around each group; median over groups of group time / "
            "inner. The layer step is dsa_jax.layer._step_jit (no host checks), rows "
            "padded to cfg.max_verify as decode/decode_k pad them; before each group the "
            "state's lengths are set back so every call runs at the stated context. Torch: "
            "CUDA events around each call, median."),
        tp_note="At TP 8 the suite benchmarks ONE rank's work on one GPU: 8 local heads of "
                "q_b/kv_b/o_proj, the indexer and latent projection replicated; no collective.",
        floor_rule="floor = max(fewest bytes / measured copy bandwidth (read+write), FLOPs / "
                   "measured bf16 matmul rate)")
    def want(g):
        return (not only or g in only) and g not in skip

    _log(f"[bench] {info.get('device')} jax {jax.__version__} -> {suite.out_path}")
    try:
        suite.ceilings()
    except Exception as e:
        suite.result["errors"].append({"group": "ceilings", "error": _err(e)})
        suite.save()
        print(f"dsa-jax bench: the ceilings could not be measured: {e}", file=sys.stderr)
        return 1
    # HF runs last: torch's allocations after its runs slowed the JAX steps timed after them
    # (scaling at 64K / 128K context: 318 / 359 us against 248 / 256 us in a run without HF,
    # h200-bench-20261130-071231 vs -071622). Its times are attached to the points afterwards.
    order = [("decode", lambda: suite.group_decode(1)),
             ("kernels", suite.group_kernels), ("selection", suite.group_selection),
             ("prefill", suite.group_prefill), ("scaling", suite.group_scaling),
             ("tp8", lambda: [suite.group_decode(tp) for tp in plan.tp if tp != 1]),
             ("memory", suite.group_memory), ("levers", suite.group_levers),
             ("breakdown", suite.group_breakdown), ("hf", suite.group_hf)]
    for g, fn in order:
        if not want(g) or (g not in ("memory", "hf") and suite.over_budget(g)):
            continue
        t0 = time.time()
        try:
            fn()
        except DeviceLost as e:
            _log(f"[bench] device lost in group {g}: {e}")
            suite.result["errors"].append({"group": g, "error": _err(e), "device_lost": True})
            suite.result.setdefault("group_seconds", {})[g] = time.time() - t0
            suite.save()
            print(format_table(suite.result))
            print(f"dsa-jax bench: the device was lost in group {g}; partial results in "
                  f"{suite.out_path}", file=sys.stderr)
            return 3
        except Exception as e:  # a whole group failing is recorded; the run continues
            _log(f"[bench] group {g} failed: {type(e).__name__}: {str(e)[:300]}")
            suite.result["errors"].append({"group": g, "error": _err(e)})
        suite.result.setdefault("group_seconds", {})[g] = time.time() - t0
        suite.save()
    suite.attach_hf()
    print(format_table(suite.result))
    print(f"ceilings: copy {suite.ceil.copy_GBps:.0f} GB/s, bf16 matmul "
          f"{suite.ceil.matmul_TFLOPs:.0f} TFLOP/s; {suite.elapsed():.0f} s; "
          f"wrote {suite.out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
