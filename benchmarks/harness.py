"""Timing: wall-clock medians, device kernel time from profiler traces, compile counts, the
measured ceilings (copy bandwidth, bf16 matmul rate), the machine's description, and what to
do when a measurement fails (carry on, or stop when the device is lost).

JAX timing: warm-up calls, then groups of `inner` back-to-back calls with
`jax.block_until_ready` around each group; the figure is the median over groups of
(group time / inner). Torch: CUDA events around each call, median.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def err_text(e: BaseException) -> str:
    """One error as text: type, message and the last frames (kept short)."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return f"{type(e).__name__}: {str(e)[:1500]}\n...{text[-2500:]}"


class DeviceLost(RuntimeError):
    """The device stopped answering after an error (e.g. a kernel's illegal address)."""


@functools.lru_cache(maxsize=1)
def _trivial_jit():
    return jax.jit(lambda v: (v * 2).sum())


def check_device(after: BaseException) -> None:
    """After a failed measurement: if the device no longer runs a trivial op (a sticky CUDA
    error), raise DeviceLost; otherwise return and let the run carry on."""
    try:
        x = jax.device_put(np.arange(4, dtype=np.float32))
        if float(_trivial_jit()(x)) != 12.0:
            raise RuntimeError("a trivial op gave a wrong result")
    except Exception as e2:
        raise DeviceLost(f"after {type(after).__name__}: {str(after)[:300]}, the device fails "
                         f"a trivial op: {type(e2).__name__}: {str(e2)[:300]}") from e2


def measure(call: Callable[[], Any], *, warmup: int, groups: int, inner: int,
            reset: Callable[[], None] | None = None) -> dict:
    """Median microseconds per call: `groups` groups of `inner` back-to-back calls, each group
    bracketed by `jax.block_until_ready`; `reset` runs before each group, outside the timing
    (what it returns is waited for: a reset's device work must not land in the timed call)."""
    for _ in range(warmup):
        if reset is not None:
            jax.block_until_ready(reset())
        jax.block_until_ready(call())
    per_call = []
    for _ in range(groups):
        if reset is not None:
            jax.block_until_ready(reset())
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


def host_time_us(fn: Callable[[], Any], reps: int) -> float:
    """Median host time of a host-side function, in us (one untimed call first)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


class CompileLog:
    """Counts XLA backend compiles and their time (jax.monitoring events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.events: list[float] = []
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, *args, **kwargs):
        if event == self.EVENT:
            self.events.append(float(duration))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> tuple[int, float]:
        ev = self.events[mark:]
        return len(ev), float(sum(ev))


def jit_cache_size(fn) -> int | None:
    """Entries in a jitted function's cache (jax's own counter); None where jax has none."""
    size = getattr(fn, "_cache_size", None)
    return int(size()) if callable(size) else None


# Ceilings ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Ceilings:
    copy_GBps: float  # read + write bytes per second / 1e9
    matmul_TFLOPs: float  # bf16 matmul rate

    def floor(self, nbytes: float, flops: float) -> dict:
        """The roofline floor of a step moving `nbytes` and computing `flops`."""
        t_bytes = nbytes / (self.copy_GBps * 1e9) * 1e6
        t_flops = flops / (self.matmul_TFLOPs * 1e12) * 1e6
        return {"bytes": int(nbytes), "flops": int(flops), "bytes_us": t_bytes,
                "flops_us": t_flops, "floor_us": max(t_bytes, t_flops),
                "bound": "bytes" if t_bytes >= t_flops else "flops"}


def measure_ceilings(*, small: bool, groups: int, with_torch: bool) -> tuple[Ceilings, dict]:
    """Copy bandwidth (a 1 GiB f32 buffer read and written; 4 MiB when `small`) and bf16
    matmul rate (8192^2; 256^2 when `small`), by JAX and, `with_torch`, by torch; the best
    of each. Returns the ceilings and the JSON record of every measurement."""
    n_copy = (1 << 20) if small else (1 << 28)
    n_mm = 256 if small else 8192
    detail: dict = {}
    reps = max(5, groups // 2)
    xs = [jax.random.normal(jax.random.key(i, impl="rbg"), (n_copy,), jnp.float32)
          for i in range(2)]
    f = jax.jit(lambda x: x * 1.0001)
    it = iter(range(1 << 30))
    t = measure(lambda: f(xs[next(it) % 2]), warmup=2, groups=reps, inner=5)
    copy = 2 * 4 * n_copy / (t["median_us"] * 1e-6) / 1e9
    detail["jax_copy"] = {"bytes_per_op": 2 * 4 * n_copy, "GBps": copy, **t}
    xs.clear()
    a = [jax.random.normal(jax.random.key(10 + i, impl="rbg"), (n_mm, n_mm), jnp.bfloat16)
         for i in range(2)]
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32
                                      ).astype(jnp.bfloat16))
    it2 = iter(range(1 << 30))
    t = measure(lambda: mm(a[next(it2) % 2], a[1]), warmup=2, groups=reps, inner=5)
    rate = 2 * n_mm ** 3 / (t["median_us"] * 1e-6) / 1e12
    detail["jax_matmul_bf16"] = {"n": n_mm, "TFLOPs": rate, **t}
    a.clear()
    call_floor = measure_call_floor(reps)
    detail["jax_call_floor"] = call_floor
    if with_torch:
        try:
            detail.update(_torch_ceilings())
        except Exception as e:
            detail["torch_error"] = err_text(e)
    copy_best = max([copy] + [v["GBps"] for k, v in detail.items() if k.startswith("torch_copy")])
    rate_best = max([rate] + [v["TFLOPs"] for k, v in detail.items()
                              if k.startswith("torch_matmul")])
    record = {"copy_GBps": copy_best, "matmul_bf16_TFLOPs": rate_best,
              "call_floor_us": call_floor["median_us"],
              "rule": "the best of the JAX and torch measurements; call_floor_us: JAX's",
              "detail": detail}
    return Ceilings(copy_best, rate_best), record


def call_floor_program(fn: Callable[..., Any], args: tuple) -> Callable[..., Any]:
    """A one-fusion program with fn's arguments and result shapes: it reads one element of
    every argument (so jit prunes none) and fills fn's outputs with their sum. Timed as fn is,
    it is the host's cost of a call with exactly these buffers in and out, whatever kernels
    compute them: the least any implementation of fn's call can take on that host."""
    outs = jax.eval_shape(fn, *args)

    def floor(*a):
        t = functools.reduce(jnp.add, [x.reshape(-1)[0].astype(jnp.float32) for x in a])
        return jax.tree.map(lambda o: jnp.full(o.shape, t, o.dtype), outs)

    return jax.jit(floor)


def measure_call_floor(groups: int) -> dict:
    """The host's floor for a lone call's wall time: back-to-back calls (as `measure` times
    every point) of a jitted one-kernel program on a 1024-element array, three inputs in turn
    (new addresses every call, as the points' `Cycle`). A point timed by its wall cannot run
    below this on the host that measured it, whatever its kernels take."""
    xs = [jnp.full((1024,), float(i), jnp.float32) for i in range(3)]
    f = jax.jit(lambda x: x + 1.0)
    it = iter(range(1 << 30))
    t = measure(lambda: f(xs[next(it) % 3]), warmup=3, groups=groups, inner=10)
    return {"program": "jax.jit(lambda x: x + 1.0) on f32[1024], 3 inputs in turn", **t}


def torch_time(fn: Callable[[], Any], reps: int, warmup: int = 2) -> dict:
    """Median microseconds of `fn`: CUDA events around each call (perf_counter on a CPU)."""
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
    t = torch_time(lambda: bufs[1].copy_(bufs[0]), 10)
    out["torch_copy"] = {"bytes_per_op": 8 * n, "GBps": 8 * n / (t["median_us"] * 1e-6) / 1e9,
                         **t}
    bufs.clear()
    m = 8192
    mats = [torch.randn(m, m, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    t = torch_time(lambda: mats[0] @ mats[1], 10)
    out["torch_matmul_bf16"] = {"n": m, "TFLOPs": 2 * m ** 3 / (t["median_us"] * 1e-6) / 1e12,
                                **t}
    mats.clear()
    torch.cuda.empty_cache()
    return out


# Device kernel time from a profiler trace ----------------------------------------------------


def _trace_events(call: Callable[[], Any], calls: int) -> list[dict]:
    """The perfetto trace events of `calls` pipelined calls (CUPTI on a GPU)."""
    d = tempfile.mkdtemp(prefix="dsa-bench-prof-")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        out = None
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
    paths = [os.path.join(root, f) for root, _, files in os.walk(d) for f in files
             if f.startswith("perfetto_trace")]
    if not paths:
        raise RuntimeError(f"no perfetto trace under {d}")
    with gzip.open(paths[0]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def trace_names(ev: list[dict]) -> tuple[dict, dict, set]:
    """A trace's process names {pid: name}, thread names {(pid, tid): name} and the pids of
    its devices."""
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in ev
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in ev
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    dev = {pid for pid, name in procs.items() if "GPU" in name or "/device:" in name}
    return procs, threads, dev


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """Time covered by the union of [start, end) spans."""
    spans = sorted(spans)
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    return busy + cur_e - cur_s


def profile(call: Callable[[], Any], calls: int, *, reset: Callable[[], None] | None = None,
            top: int = 25) -> dict:
    """Device kernels of `calls` pipelined calls, from a JAX profiler trace (two untimed calls
    first; `reset` before those and before the traced ones): per kernel name its time and
    launches per call, the total kernel time per call (`kernel_us_per_step`), and the span
    from the first kernel's start to the last one's end. `{"error": ...}` where the trace holds
    no device kernels (a CPU: not traced at all, a CPU trace records none)."""
    if jax.default_backend() == "cpu":
        return {"error": "no device kernels on a CPU backend"}
    if reset is not None:
        jax.block_until_ready(reset())
    for _ in range(2):
        jax.block_until_ready(call())
    if reset is not None:
        jax.block_until_ready(reset())
    ev = _trace_events(call, calls)
    procs, threads, dev = trace_names(ev)
    dev_ev = [e for e in ev if e.get("ph") == "X" and e.get("pid") in dev]
    by_thread: dict = {}
    for e in dev_ev:
        tname = threads.get((e["pid"], e.get("tid")), "")
        by_thread[tname] = by_thread.get(tname, 0.0) + float(e.get("dur", 0.0))
    has_streams = any("Stream" in t for t in by_thread)
    kern: dict = {}
    spans, modules, counted = [], [], []
    for e in dev_ev:
        tname = threads.get((e["pid"], e.get("tid")), "")
        dur = float(e.get("dur", 0.0))
        if ("Stream" in tname if has_streams else
                not any(w in tname for w in ("Module", "Ops", "Step", "Launch"))):
            k = kern.setdefault(e.get("name", "?"), [0.0, 0])
            k[0] += dur
            k[1] += 1
            spans.append((float(e["ts"]), float(e["ts"]) + dur))
            counted.append(e)
        elif "Module" in tname:
            modules.append(dur)
    if not spans:
        return {"error": "no device kernel events in the trace",
                "processes": sorted(procs.values()), "threads": sorted(set(threads.values()))}
    rows = sorted(kern.items(), key=lambda kv: -kv[1][0])
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    per_call = round(len(counted) / calls)
    in_order = sorted(counted, key=lambda e: float(e["ts"]))
    return {
        # the first traced call's launches in issue order (the same name may launch twice)
        "first_call": [{"name": e.get("name", "?")[:160], "us": float(e.get("dur", 0.0))}
                       for e in in_order[:per_call]],
        "steps": calls,
        "kernel_us_per_step": sum(v[0] for v in kern.values()) / calls,
        "kernel_busy_us_per_step": _busy_us(spans) / calls,
        "first_to_last_kernel_us_per_step": (last - first) / calls,
        "launches_per_step": sum(v[1] for v in kern.values()) / calls,
        "module_us_per_step": (sum(modules) / calls) if modules else None,
        "device_threads_us_per_step": {k: v / calls for k, v in by_thread.items()},
        "top_kernels": [{"name": n[:160], "us_per_step": v[0] / calls,
                         "launches_per_step": v[1] / calls} for n, v in rows[:top]],
    }


def profile_step(runner, steps: int, top: int = 25) -> dict:
    """`profile` of a runner (a callable with `reset()`: a step on a state set back)."""
    return profile(runner, steps, reset=runner.reset, top=top)


def kernel_us(call: Callable[[], Any], calls: int = 20) -> float | None:
    """Device kernel time per call (CUPTI trace; no dispatch or gaps); None where the backend
    records no kernels (a CPU)."""
    return profile(call, calls, top=0).get("kernel_us_per_step")


# The machine ---------------------------------------------------------------------------------


def machine_info() -> dict:
    """Host, versions, device and the XLA environment of this run."""
    info: dict = {"hostname": socket.gethostname(), "python": platform.python_version(),
                  "jax": jax.__version__, "backend": jax.default_backend()}
    for dist in ("jaxlib", "triton", "torch", "transformers", "numpy", "jax-cuda13-plugin",
                 "jax-cuda12-plugin"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    dev = jax.devices()[0]
    info["device"] = dev.device_kind
    info["device_count"] = jax.device_count()
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.sm,clocks.max.sm,clocks.mem,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if q.returncode == 0:
            info["nvidia_smi"] = q.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass  # no nvidia-smi on this machine
    for var in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS", "JAX_PLATFORMS"):
        if os.environ.get(var):
            info[var] = os.environ[var]
    return info
