"""H200: is the batch-1 decode step bound by kernel launches? The same jitted step
(benchmarks.workloads.STEP, GLM-5.3-Flash shapes, context 16K) timed under XLA's
command-buffer (CUDA graph) settings, each in a fresh process (XLA reads its flags once).

    PYTHONPATH=. python3 benchmarks/h200_launch.py [--shapes TPxBxK,...] [FLAG_SET ...]
    (default: VARIANTS on SHAPES; with --shapes the Pallas step only, beside the same step fed
    one input block every call)

Writes $OUT/h200-launch.json (or ./h200-launch.json). Per variant, implementation and shape:
`step_us` (median of back-to-back steps, benchmarks.harness.measure, as the bench's decode
points),
`kernel_us` (device kernel time per step from a profiler trace), `idle_us` = step - kernel,
and `dispatch_us`, the host time to enqueue one step. Rows `trivial`: a one-kernel program with
the step's 20 argument buffers (the bare cost of a call). Rows with `layers_in_program`: 4
layers in one program (as inside a model's step); their figures are per layer.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

# XLA_FLAGS added per flag set: none (XLA's default capture set); command buffers off; every
# kernel kind captured however short the run, loops and conditionals included.
_ALL = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
        "CONDITIONAL --xla_gpu_graph_min_graph_size=1")
FLAGS = {"default": "", "off": "--xla_gpu_enable_command_buffer=", "all-loops-min1": _ALL}
# Run 1 had also "all-min1" (the same without WHILE,CONDITIONAL); run 2 alternated default and
# all-loops-min1 twice; run 3 (the default order) adds the trivial-program rows.
VARIANTS = ["default", "off", "default"]
SHAPES = [(1, 1, 1), (8, 1, 1), (1, 1, 3)]  # (tp degree, sequences, rows per sequence)


def _shapes(text: str) -> list[tuple[int, int, int]]:
    """'1x64x1,1x1x1' -> [(1, 64, 1), (1, 1, 1)] (tp degree, sequences, rows per sequence)."""
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",")]


def _dispatch_us(r, n: int, reps: int = 15) -> tuple[float, float]:
    """Host seconds per call to enqueue n back-to-back steps (no block), and per call until
    the last one has finished; medians over reps, in us. When the first is close to the step
    time the host, not the GPU, sets the pace."""
    import time

    import jax
    import numpy as np

    host, total = [], []
    for _ in range(reps):
        r.reset()
        jax.block_until_ready(r.state)
        t0 = time.perf_counter()
        for _ in range(n):
            out = r()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        host.append((t1 - t0) / n * 1e6)
        total.append((t2 - t0) / n * 1e6)
    return float(np.median(host)), float(np.median(total))


def child(variant: str, shapes=None) -> list[dict]:
    import jax

    from benchmarks.harness import measure, profile_step
    from benchmarks.points import full_plan
    from benchmarks.workloads import StepRunner, random_hf_tensors, random_weights
    from dsa_jax.shapes import glm53_flash

    cfg0 = glm53_flash()
    plan = full_plan(cfg0)
    hf = random_hf_tensors(cfg0, 0)
    rows = []
    for tp, b, k in shapes or SHAPES:
        weights = random_weights(cfg0, hf, tp)
        # With --shapes, the Pallas step only, and "pallas-same-x": one input block every
        # call (the bench cycles 3): whether a new input address per call (a command-buffer
        # update) costs the host.
        for impl in ("pallas", "pallas-same-x") if shapes else ("xla", "pallas"):
            cfg = cfg0.replace(implementation=impl.split("-")[0], tp_degree=tp)
            row = {"variant": variant, "impl": impl, "tp": tp, "batch": b, "k": k}
            try:
                r = StepRunner(cfg, weights, b, k, cfg.max_verify, plan.ctx - plan.inner * k,
                               3000 + tp + k, n_inputs=1 if impl.endswith("same-x") else 3)
                jax.block_until_ready(r())
                row["dispatch_us"], row["dispatch_then_wait_us"] = _dispatch_us(r, plan.inner)
                t = measure(r, warmup=3, groups=plan.groups, inner=plan.inner, reset=r.reset)
                row["step_us"] = t["median_us"]
                row["step_p10_us"], row["step_p90_us"] = t["p10_us"], t["p90_us"]
                # Traced steps stay within the context the runner starts `plan.inner` steps
                # below (as the bench's): 20 ran 10 past max_context, whose rows then go
                # past their promise (NaN), and traced too much kernel time (call 3, 20261202).
                prof = profile_step(r, max(1, plan.inner - 2), top=0)
                row["kernel_us"] = prof.get("kernel_us_per_step")
                row["launches"] = prof.get("launches_per_step")
                row["idle_us"] = row["step_us"] - (row["kernel_us"] or 0.0)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        rows.append(_trivial_row(variant, cfg0.replace(tp_degree=tp), weights, b, plan))
        if variant.startswith("default") and k == 1:
            for impl in ("pallas",) if shapes else ("xla", "pallas"):
                rows.append(_layers_row(variant, cfg0.replace(implementation=impl,
                                                              tp_degree=tp), b, plan))
    return rows


class _Layers:
    """`n` DSA layers in one jitted program, each with its own weights and donated state, all
    fed the same input rows: what one layer costs inside a model's step, where the host
    dispatches once per step, not once per layer."""

    def __init__(self, cfg, b, plan, n):
        import jax
        import numpy as np

        from benchmarks.workloads import random_hf_tensors, random_state, random_weights, step_rows
        from dsa_jax import layer

        self.n, self.b, self.start = n, b, plan.ctx - plan.inner
        self.weights = [random_weights(cfg, random_hf_tensors(cfg, 10 + i), cfg.tp_degree)
                        for i in range(n)]
        self.states = [random_state(cfg, b, self.start, 20 + i) for i in range(n)]
        self.x = step_rows(cfg, b, 1, cfg.max_verify, 5, n_inputs=1)[0]  # [B, max_verify, D]
        self.n_new = jax.device_put(np.ones((b,), np.int32))

        def program(weights, states, x, n_new):
            ys, new = [], []
            for w, st in zip(weights, states, strict=True):
                y, st, _ = layer.step(cfg, w, st, x, n_new, None)
                ys.append(y)
                new.append(st)
            return ys, new

        self.f = jax.jit(program, donate_argnums=(1,))

    def __call__(self):
        ys, self.states = self.f(self.weights, self.states, self.x, self.n_new)
        return ys

    @property
    def state(self):
        return self.states

    def reset(self):
        from benchmarks.workloads import rewound

        self.states = [rewound(st, self.start) for st in self.states]
        return self.states


def _layers_row(variant, cfg, b, plan, n: int = 4) -> dict:
    import jax

    from benchmarks.harness import measure, profile_step

    row = {"variant": variant, "impl": cfg.implementation, "tp": cfg.tp_degree, "batch": b,
           "k": 1, "layers_in_program": n}
    try:
        t = _Layers(cfg, b, plan, n)
        jax.block_until_ready(t())
        m = measure(t, warmup=3, groups=plan.groups, inner=plan.inner, reset=t.reset)
        row["program_us"] = m["median_us"]
        row["step_us"] = m["median_us"] / n
        row["step_p10_us"], row["step_p90_us"] = m["p10_us"] / n, m["p90_us"] / n
        row["dispatch_us"] = _dispatch_us(t, plan.inner)[0] / n
        kern = profile_step(t, 10, top=0).get("kernel_us_per_step")
        row["kernel_us"] = None if kern is None else kern / n
        row["idle_us"] = row["step_us"] - (row["kernel_us"] or 0.0)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(json.dumps(row), flush=True)
    return row


class _Trivial:
    """A one-kernel jitted program with the step's arguments (weights, donated state, x,
    n_new) and outputs: what dispatching the step costs the host before any of its kernels."""

    def __init__(self, cfg, weights, b, plan):
        import jax

        from benchmarks.workloads import StepRunner

        self.r = StepRunner(cfg, weights, b, 1, cfg.max_verify, plan.ctx - plan.inner, 7)
        self.f = jax.jit(lambda w, st, x, n: (x * 2, st, n + 1), donate_argnums=(1,))

    def __call__(self):
        y, self.r.state, _ = self.f(self.r.weights, self.r.state, self.r.xs[0], self.r.n_new)
        return y

    def reset(self):
        return self.r.reset()

    @property
    def state(self):
        return self.r.state


def _trivial_row(variant, cfg, weights, b, plan) -> dict:
    import jax

    row = {"variant": variant, "impl": "trivial", "tp": cfg.tp_degree, "batch": b, "k": 1,
           "args": len(jax.tree.leaves((weights, None)))}
    try:
        t = _Trivial(cfg, weights, b, plan)
        row["args"] += len(jax.tree.leaves(t.state)) + 2
        jax.block_until_ready(t())
        row["dispatch_us"], row["dispatch_then_wait_us"] = _dispatch_us(t, plan.inner)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--child":
        rows = child(sys.argv[2], _shapes(sys.argv[3]) if len(sys.argv) == 4 else None)
        print("ROWS " + json.dumps(rows), flush=True)
        return 0
    import jax

    args = sys.argv[1:]
    shapes = None  # --shapes TPxBxK,...: these shapes (and the same-x rows) instead of SHAPES
    if args[:1] == ["--shapes"]:
        shapes, args = args[1], args[2:]
    variants = args or VARIANTS
    unknown = set(variants) - set(FLAGS)
    if unknown:
        print(f"h200_launch: unknown flag set(s) {sorted(unknown)}; known: {sorted(FLAGS)}",
              file=sys.stderr)
        return 2
    out = os.path.join(os.environ.get("OUT", "."), "h200-launch.json")
    res = {"command": " ".join(["PYTHONPATH=. python3 benchmarks/h200_launch.py"] + sys.argv[1:]),
           "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "jax_version": jax.__version__, "base_xla_flags": os.environ.get("XLA_FLAGS", ""),
           "variants": variants, "flags": FLAGS, "results": [], "errors": []}
    for i, flag_set in enumerate(variants):
        name, flags = f"{flag_set}-{i}", FLAGS[flag_set]
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        p = subprocess.run([sys.executable, __file__, "--child", name,
                            *([shapes] if shapes else [])], env=env,
                           capture_output=True, text=True, timeout=400)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ROWS ")]
        if p.returncode or not lines:
            res["errors"].append({"variant": name, "rc": p.returncode,
                                  "stderr": p.stderr[-1500:]})
        else:
            res["results"] += json.loads(lines[-1][5:])
        print(name, p.returncode, p.stdout[-1500:], flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
