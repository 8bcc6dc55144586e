"""H200: what the host pays per call of the public `dsa_jax.decode` (issue 15,
public-decode-b1), side by side in one process.

    PYTHONPATH=. python3 benchmarks/h200_dispatch.py --out $OUT/dispatch/h200-dispatch.json
    PYTHONPATH=. python3 benchmarks/h200_dispatch.py --smoke --out /tmp/h200-dispatch.json

One GLM-5.3-Flash "full" block, 16K context, batch 1, pallas (tiny shapes and xla under
--smoke). Checks first, bitwise (`==`) from copies of one state: the public decode, the old
program (`layer.layout_step`: config and layout static, the whole state donated), the new one
(`layer.dispatch_step`: both bound, only the changing fields donated) and each compiled
variant give the same y, sel and state. Then, in `--rounds` interleaved rounds (the host's
speed drifts), per-call wall time synced after every call (`synced_us`) and back to back
(`pipelined_us`, `benchmarks.harness.measure` with `--inner` calls a group) of:
- public: the README's call as the bench's public-decode-b1 times it
  (`benchmarks.measures.time_public_decode`: a rewind before every call, so every timed call
  runs the full host check); public-loop: the same call in a loop, no rewind (as
  `h200_loop.py` times it: the checks within the slack, a state of its own);
  public-out-loop: the same with `out=` the previous y and sel; the host checks alone
  (`measures.host_checks_us`, within the slack) and the full check of lengths and tables
  (`full_check_us`, what a call after a rewind runs);
- old, new: the bare programs; new-cb-off: the new one compiled with XLA's command buffers
  off (`compiler_options`); new-hold3: new, the last 3 calls' outputs kept alive;
  new-outbuf: `dispatch_step(..., out=)`, y and sel written into donated buffers, so no
  buffer of the program changes its address between calls; new-copyout (an experiment): y
  and sel kept in the program's own donated buffers, fresh copies returned;
- trivial-N-{plain,outs,donated}: one-kernel programs of N = 1, 8, 21, 40 small arguments
  returning one array / every argument / every argument donated (the runtime's cost per
  argument, output and donation); chain-30-{fresh,donated}: 30 kernels in a row whose
  output is a new buffer every call, or the donated argument (does a command buffer pay for
  output addresses that change?).
And from profiler traces: the step's device kernel time (`device_step_us`, the bench's
definition) and the host-side events per call of synced calls of public, new, each variant
and the chain programs (`host_events_*`: where the host spends a call, e.g.
`command_buffer::update`, `cuGraphLaunch`). The JSON is written after every section.
"""

from __future__ import annotations

import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from benchmarks.device_script import header, json_parser, run_section, write_json
from benchmarks.harness import host_events, host_time_us, measure, profile
from benchmarks.loop_checks import copy_tree, wall_us
from benchmarks.measures import host_checks_us, time_public_decode
from benchmarks.workloads import random_state
from dsa_jax import layer, mirror
from dsa_jax.bitwise import BITWISE_OPTIONS
from dsa_jax.shapes import glm53_flash, tiny
from dsa_jax.state import DsaState
from dsa_jax.step_checks import check_numbers

TRIVIAL_ARGS = (1, 8, 21, 40)
CB_OFF = {"xla_gpu_enable_command_buffer": ""}


def setup(smoke: bool):
    if smoke:
        cfg = tiny(implementation="xla", max_context=512, indexer_types=("full",))
    else:
        cfg = glm53_flash(implementation="pallas", indexer_types=("full",))
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(8))
    # A pool boundary well below the ceiling (room for a round of public-loop calls): every
    # reset is a rewind the ring allows.
    start = (cfg.max_context - 400) // cfg.index_kpool * cfg.index_kpool
    state = random_state(cfg, 1, start, 1100)
    x = jax.random.normal(jax.random.key(10), (1, cfg.hidden_size))  # [1, D]
    return cfg, weights, state, x, start


class Bare:
    """A program called bare (no checks) on a donated state, set back to `start` by reset."""

    def __init__(self, cfg, weights, state, x, start, call):
        self.cfg, self.weights, self.state, self.x, self.start = cfg, weights, state, x, start
        self.layout, n_new = layer.prepare_step(cfg, weights, state, x, kind="decode")
        self.n_new = jnp.asarray(n_new)  # [1]
        self.call = call
        self.out = None

    def __call__(self):
        y, self.state, sel = self.call(self.cfg, self.layout, self.weights, self.state, self.x,
                                       self.n_new, None)
        self.out = (y, sel)
        return y

    def reset(self):
        b = self.state.lengths.shape[0]
        self.state = dsa_jax.rewind(self.cfg, self.state, np.full((b,), self.start, np.int32))
        return self.state


def compiled_call(cfg, layout, weights, state, x, n_new, options):
    """`layer.public_program` compiled with the library's `BITWISE_OPTIONS` and `options`,
    called as `layer.dispatch_step`."""
    prog = layer.public_program(cfg, layout)
    moving = tuple(getattr(state, f) for f in layer.MOVING_FIELDS)
    exe = prog.lower(weights, state.kv_scale, state.block_tables, moving, x, n_new,
                     None).compile(compiler_options={**BITWISE_OPTIONS, **options})

    def call(cfg, layout, weights, state, x, n_new, shared_sel):
        y, moving, sel = exe(weights, state.kv_scale, state.block_tables,
                             tuple(getattr(state, f) for f in layer.MOVING_FIELDS), x, n_new,
                             shared_sel)
        return y, state._replace(**dict(zip(layer.MOVING_FIELDS, moving, strict=True))), sel

    return call


def outbuf_call(cfg, layout, weights, state, x, n_new):
    """`layer.dispatch_step` with `out`: y and sel written into donated buffers (the previous
    call's y and sel), so every buffer the program touches keeps its address from call to
    call and XLA skips `command_buffer::update` (round 2: the same program built here by hand,
    `h200-dispatch-20261201-002013.json`)."""
    b = state.lengths.shape[0]
    box = {"bufs": (jnp.zeros((b, cfg.hidden_size), jnp.float32),
                    jnp.zeros((b, cfg.sel_width), jnp.int32))}

    def call(cfg, layout, weights, state, x, n_new, shared_sel):
        y, state, sel = layer.dispatch_step(cfg, layout, weights, state, x, n_new, shared_sel,
                                            out=box["bufs"])
        box["bufs"] = (y, sel)
        return y, state, sel

    return call


def copyout_call(cfg, layout, weights, state, x, n_new):
    """Experiment, not a library path: the program writes y and sel into buffers it keeps
    (donated back every call, so their addresses never change) and returns fresh copies of
    them. Does XLA leave the copies out of the command buffer (then no update per call and
    no `out=` needed), or update the graph for their new addresses?"""

    def run(weights, kv_scale, block_tables, moving, x, n_new, y_buf, sel_buf):
        st = DsaState(moving[0], kv_scale, block_tables, *moving[1:])
        y, st, sel = layer.layout_step(cfg, layout, weights, st, x, n_new, None)
        return y, tuple(getattr(st, f) for f in layer.MOVING_FIELDS), sel, y, sel

    f = jax.jit(run, donate_argnums=(3, 6, 7), keep_unused=True,
                compiler_options=BITWISE_OPTIONS)
    b = state.lengths.shape[0]
    box = {"bufs": (jnp.zeros((b, cfg.hidden_size), jnp.float32),
                    jnp.zeros((b, cfg.sel_width), jnp.int32))}

    def call(cfg, layout, weights, state, x, n_new, shared_sel):
        moving = tuple(getattr(state, f) for f in layer.MOVING_FIELDS)
        y_keep, moving, sel_keep, y, sel = f(weights, state.kv_scale, state.block_tables,
                                             moving, x, n_new, *box["bufs"])
        box["bufs"] = (y_keep, sel_keep)
        return y, DsaState(moving[0], state.kv_scale, state.block_tables, *moving[1:]), sel

    return call


class Hold(Bare):
    """`Bare`, keeping the outputs of the last `keep` calls alive (another allocation
    pattern for the runtime's fresh output buffers)."""

    def __init__(self, *args, keep: int = 3):
        super().__init__(*args)
        self.kept = collections.deque(maxlen=keep)

    def __call__(self):
        y = super().__call__()
        self.kept.append(self.out)
        return y


def times(call, reset, groups: int, inner: int) -> dict:
    synced = measure(call, warmup=2, groups=groups, inner=1, reset=reset)
    piped = measure(call, warmup=1, groups=max(3, groups // inner), inner=inner, reset=reset)
    return {"synced_us": synced["median_us"], "synced_p10_us": synced["p10_us"],
            "synced_p90_us": synced["p90_us"], "pipelined_us": piped["median_us"]}


def trivial(n: int, kind: str):
    """A one-kernel program of n [4] f32 arguments (kind: plain -> one output, outs -> every
    argument + 1 out, donated -> the same with every argument donated)."""
    box = {"a": [jnp.full((4,), i, jnp.float32) for i in range(n)]}
    if kind == "plain":
        f = jax.jit(lambda *a: a[0] * 2)
    else:
        f = jax.jit(lambda *a: tuple(v + 1 for v in a),
                    donate_argnums=tuple(range(n)) if kind == "donated" else ())

    def call():
        out = f(*box["a"])
        if kind == "plain":
            return out
        if kind == "donated":
            box["a"] = list(out)
        return out[0]

    return call


def chain(kernels: int, donated: bool):
    """A program of `kernels` small kernels in a row (fences keep XLA from fusing them, so
    they land in one command buffer) on one [4096] f32 argument, its output a fresh buffer
    (its address changes from call to call) or the donated argument (the same address)."""

    def body(v):
        for _ in range(kernels):
            v = jax.lax.optimization_barrier(jnp.sin(v) * 1.0001)
        return v

    f = jax.jit(body, donate_argnums=(0,) if donated else ())
    box = {"v": jnp.linspace(0.0, 1.0, 4096, dtype=jnp.float32)}

    def call():
        out = f(box["v"])
        if donated:
            box["v"] = out
        return out

    return call


def equal_trees(a, b) -> bool:
    return all(bool((np.asarray(u) == np.asarray(v)).all())
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def section_checks(ctx, res):
    cfg, weights, state, x, start = ctx["setup"]
    layout, n_new = layer.prepare_step(cfg, weights, state, x, kind="decode")
    n_dev = jnp.asarray(n_new)
    outs = {}
    outs["public"] = dsa_jax.decode(cfg, weights, copy_tree(state), x)
    outs["old"] = layer.layout_step(cfg, layout, weights, copy_tree(state), x, n_dev, None)
    outs["new"] = layer.dispatch_step(cfg, layout, weights, copy_tree(state), x, n_dev, None)
    for name, opts in ctx["compiled"].items():
        st = copy_tree(state)
        try:  # an option this XLA refuses is recorded, the rest still run
            call = compiled_call(cfg, layout, weights, st, x, n_dev, opts)
        except Exception as e:
            res["errors"].append({"section": f"compile {name}", "options": opts,
                                  "error": f"{type(e).__name__}: {e}"[:500]})
            continue
        ctx["calls"][name] = call
        outs[name] = call(cfg, layout, weights, st, x, n_dev, None)
    for name, make in (("new-outbuf", outbuf_call), ("new-copyout", copyout_call)):
        st = copy_tree(state)
        ctx["calls"][name] = make(cfg, layout, weights, st, x, n_dev)
        outs[name] = ctx["calls"][name](cfg, layout, weights, st, x, n_dev, None)
    ref = outs["old"]
    for name, out in outs.items():
        if name != "old":
            res["checks"][f"{name} == old (y, state, sel)"] = equal_trees(out, ref)
    res["checks"]["finite"] = bool(np.isfinite(np.asarray(ref[0])).all())


def full_check_us(cfg, state) -> float:
    """Host time of the full check of lengths and tables (`step_checks.check_numbers`), what
    a call runs after a rewind (the bench's public-decode-b1 times those calls)."""
    numbers = mirror.host_numbers(state)
    n_new = np.ones(state.lengths.shape, np.int32)
    return host_time_us(lambda: check_numbers(cfg, numbers, n_new, True,
                                              state.latent.shape[0]), 200)


def section_times(ctx, res):
    cfg, weights, state, x, start = ctx["setup"]
    a = ctx["args"]
    groups, inner = a.groups, a.inner
    runners = {name: Bare(cfg, weights, random_state(cfg, 1, start, 1100), x, start, fn)
               for name, fn in [("old", layer.layout_step), ("new", layer.dispatch_step)]
               + list(ctx["calls"].items())}
    runners["new-hold3"] = Hold(cfg, weights, random_state(cfg, 1, start, 1100), x, start,
                                layer.dispatch_step)
    pub = {"state": random_state(cfg, 1, start, 1100)}

    def public_times():
        t, pub["state"] = time_public_decode(cfg, weights, pub["state"], x, start, warmup=2,
                                             groups=groups, inner=1)
        tp, pub["state"] = time_public_decode(cfg, weights, pub["state"], x, start, warmup=1,
                                              groups=max(3, groups // inner), inner=inner)
        return {"synced_us": t["median_us"], "synced_p10_us": t["p10_us"],
                "synced_p90_us": t["p90_us"], "pipelined_us": tp["median_us"]}

    def public_loop_times():  # consecutive calls, no rewind between them
        # A state of its own each round: a rewind of a round's calls would leave the ring's
        # mark too far ahead for the next steps.
        loop = {"state": random_state(cfg, 1, start, 1100)}

        def call():
            y, loop["state"], _ = dsa_jax.decode(cfg, weights, loop["state"], x)
            return y

        synced = wall_us(call, groups)
        piped = measure(call, warmup=1, groups=max(3, groups // inner), inner=inner)
        return {"synced_us": synced, "pipelined_us": piped["median_us"]}

    def public_out_loop_times():  # as public-loop, each call given the last y and sel as out
        loop = {"state": random_state(cfg, 1, start, 1100),
                "out": (jnp.zeros((1, cfg.hidden_size)), jnp.zeros((1, cfg.sel_width),
                                                                   jnp.int32))}

        def call():
            y, loop["state"], sel = dsa_jax.decode(cfg, weights, loop["state"], x,
                                                   out=loop["out"])
            loop["out"] = (y, sel)
            return y

        synced = wall_us(call, groups)
        piped = measure(call, warmup=1, groups=max(3, groups // inner), inner=inner)
        return {"synced_us": synced, "pipelined_us": piped["median_us"]}

    triv = {f"trivial-{n}-{k}": trivial(n, k) for n in TRIVIAL_ARGS
            for k in ("plain", "outs", "donated")}
    triv.update({f"chain-30-{'donated' if d else 'fresh'}": chain(30, d) for d in (False, True)})
    for r in range(a.rounds):
        rnd = {"round": r, "public": public_times(), "public-loop": public_loop_times(),
               "public-out-loop": public_out_loop_times(),
               "host_checks_us": host_checks_us(cfg, weights, pub["state"], x, 200),
               "full_check_us": full_check_us(cfg, pub["state"])}
        for name, run in runners.items():
            rnd[name] = times(run, run.reset, groups, inner)
        for name, call in triv.items():
            rnd[name] = times(call, None, groups, inner)
        res["rounds"].append(rnd)
        write_json(res, a.out)
    scalars = ("host_checks_us", "full_check_us")
    names = [k for k in res["rounds"][0] if k not in ("round",) + scalars]
    res["median"] = {n: {m: float(np.median([rd[n][m] for rd in res["rounds"]]))
                         for m in res["rounds"][0][n]} for n in names}
    for n in scalars:
        res["median"][n] = float(np.median([rd[n] for rd in res["rounds"]]))
    ctx["public_state"] = pub


def section_profile(ctx, res):
    cfg, weights, state, x, start = ctx["setup"]
    box = {"state": random_state(cfg, 1, start, 1100)}

    def readme_call():
        y, box["state"], _ = dsa_jax.decode(cfg, weights, box["state"], x)
        return y

    def reset():
        box["state"] = dsa_jax.rewind(cfg, box["state"], np.full((1,), start, np.int32))
        return box["state"]

    p = profile(readme_call, 10, reset=reset, top=40)
    res["profile"] = p
    if "kernel_us_per_step" in p:
        res["device_step_us"] = p["kernel_us_per_step"]
    reset()
    res["host_events_public_synced"] = host_events(readme_call, 10)
    variants = {"new": layer.dispatch_step, **ctx["calls"]}
    for name, fn in variants.items():
        run = Bare(cfg, weights, random_state(cfg, 1, start, 1100), x, start, fn)
        jax.block_until_ready(run())
        res[f"host_events_{name}_synced"] = host_events(run, 10)
    for d in (False, True):
        call = chain(30, d)
        jax.block_until_ready(call())
        res[f"host_events_chain-30-{'donated' if d else 'fresh'}_synced"] = host_events(call, 10)


def table(res) -> str:
    med = res.get("median", {})
    dev = res.get("device_step_us")
    lines = [f"device step (kernel time): {dev}"]
    for name, m in med.items():
        if isinstance(m, dict):
            ratio = f"  {m['synced_us'] / dev:.2f}x device" if dev else ""
            lines.append(f"{name:24s} synced {m['synced_us']:8.1f} us  pipelined "
                         f"{m['pipelined_us']:8.1f} us{ratio}")
        else:
            lines.append(f"{name:24s} {m:8.1f} us")
    lines.append(f"checks: {res['checks']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = json_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=150, help="synced calls per measurement")
    ap.add_argument("--inner", type=int, default=8, help="back-to-back calls per group")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rounds, a.groups, a.inner = 1, 6, 3
    ctx = {"args": a, "setup": setup(a.smoke), "calls": {},
           "compiled": {"new-compiled": {}} if a.smoke else
           {"new-compiled": {}, "new-cb-off": CB_OFF}}
    res = {**header("h200_dispatch.py", argv),
           "config": {"context": ctx["setup"][0].max_context, "start": ctx["setup"][4],
                      "implementation": ctx["setup"][0].implementation},
           "checks": {}, "rounds": [], "errors": []}
    for name, fn in [("checks", section_checks), ("times", section_times),
                     ("profile", section_profile)]:
        run_section(res, name, lambda fn=fn: fn(ctx, res))
        write_json(res, a.out)
    print(table(res))
    ok = all(v is True for v in res["checks"].values())
    return 0 if ok and not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
