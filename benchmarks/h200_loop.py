"""H200: the serving loop on the device (issue 15), one call.

    PYTHONPATH=. python3 benchmarks/h200_loop.py --out benchmarks/results/h200-loop.json
    PYTHONPATH=. python3 benchmarks/h200_loop.py --smoke --out /tmp/h200-loop.json  (CPU, tiny)

Checks first, bitwise (`==`), with implementation "pallas" (xla under --smoke): the scanned
model == the unrolled stack (tiny 4-layer model, and 8 GLM-5.3-Flash layers at a short
context); the on-device loop == the per-step Python loop (greedy and top-p sampling);
speculative tokens == plain tokens (n-gram drafter, draft-model drafter, greedy and sampled);
public `decode_k` == serial `decode`s. Then the points (GLM-5.3-Flash block shapes, 8 layers
alternating full/shared, 16K context, bf16 weights, fp8 cache, vocabulary 256, caches filled
with random values up to the context):
- loop-b1-l8, loop-b64-l8: N=32 tokens per dispatch (`serve.run`, one host read each): per
  token and per layer wall time, and the same layers' kernel time from a profiler trace;
- spec-b1-l8-k3: tokens/s with 3 drafts a round at a stated acceptance (a scripted drafter
  that proposes the right token with probability `--acceptance`), against plain decoding;
- public-decode-b1: `dsa_jax.decode` as the README calls it, synced every call, against the
  device step (16 steps of `layer.step` in one `lax.scan`, per step);
- scan-vs-unrolled-b1-l8: one forward of the scanned model against the unrolled stack;
- engine-b64-l8: `Engine.step` at 64 sequences (2K prompts) against its kernel time;
- compile: `serve.run` compiled once across two contexts; compile seconds per model depth.
Writes the JSON after every section (a run cut short keeps what it measured); `--only` runs
some sections. The short table is printed last.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from benchmarks.device_script import header, json_parser, run_section, write_json
from benchmarks.harness import CompileLog
from benchmarks.loop_checks import (
    FORWARD_JITS,
    LOOP_VARIANTS,
    ScriptedDrafter,
    check_decode_k,
    check_loops,
    check_scan_equals_unrolled,
    check_written_rows,
    copy_tree,
    device_kernels,
    memcpy_share,
    model,
    random_serving,
    wall_us,
)
from benchmarks.workloads import random_caches
from dsa_jax import bitwise_jit, layer, serve
from dsa_jax.checkpoint import expected_weights
from dsa_jax.engine import Engine
from dsa_jax.model import (
    ModelConfig,
    ModelWeights,
    forward,
    init_model_state,
    stack_weights,
    unfold_state,
)
from dsa_jax.shapes import glm53_flash, tiny

SECTIONS = ("checks", "loop", "spec", "public", "scan", "engine", "compile", "bigpool")
ALTERNATING8 = ("full", "shared") * 4


@dataclasses.dataclass(frozen=True)
class Setup:
    smoke: bool
    check_cfg: dsa_jax.DsaConfig  # the tiny model of the checks
    glm_check_cfg: dsa_jax.DsaConfig | None  # GLM shapes, short context (scan == unrolled)
    bench_cfg: dsa_jax.DsaConfig  # the timed model
    vocab: int
    n: int  # tokens per dispatch
    big_batch: int
    reps: int
    acceptance: float
    loop_variants: tuple[str, ...] = ("default",)
    hlo_dir: str | None = None  # where the B=1 loop programs' optimized HLO is written
    copied: bool = False  # the checks also under `Program(weights_in_place=False)`


def make_setup(args) -> Setup:
    if args.smoke:  # one small 2-layer model everywhere, so the sections share programs
        small = tiny(implementation="xla", max_context=64, indexer_types=("full", "shared"))
        return Setup(True, small, None, small, 64, 2, 3, 1, args.acceptance,
                     tuple(args.loop_variants), _hlo_dir(args), args.copied_weights)
    impl, co = "pallas", args.colaunch == "on"
    return Setup(False, tiny(implementation=impl, indexer_types=("full", "shared") * 2),
                 glm53_flash(implementation=impl, max_context=1024, indexer_types=ALTERNATING8,
                             colaunch=co),
                 glm53_flash(implementation=impl, indexer_types=ALTERNATING8, colaunch=co),
                 args.vocab,
                 args.tokens, 64, args.reps, args.acceptance, tuple(args.loop_variants),
                 _hlo_dir(args), args.copied_weights)


def _hlo_dir(args) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(args.out)), "loop-hlo")


def section_checks(s: Setup, res: dict) -> None:
    checks = res["checks"]
    checks["scan_equals_unrolled[tiny]"] = check_scan_equals_unrolled(s.check_cfg, s.vocab)
    if s.copied:  # the same checks under `Program(weights_in_place=False)`'s options
        checks["scan_equals_unrolled[tiny,copied]"] = check_scan_equals_unrolled(
            s.check_cfg, s.vocab, in_place=False)
        checks.update({f"{k}[copied]": v for k, v in check_loops(
            s.check_cfg, s.vocab, ("sample",) if s.smoke else ("greedy", "sample"),
            in_place=False).items()})
        if s.glm_check_cfg is not None:
            checks["scan_equals_unrolled[glm8,ctx1024,copied]"] = check_scan_equals_unrolled(
                s.glm_check_cfg, s.vocab, in_place=False)
    # Under --smoke the greedy loop checks run only through the draft model (their twins
    # are in the CPU tests); on the device, everything.
    checks.update(check_loops(s.check_cfg, s.vocab, ("sample",) if s.smoke else
                              ("greedy", "sample")))
    if not s.smoke:  # on the CPU: tests/test_serving_paths.py
        checks["decode_k_equals_serial_decodes"] = check_decode_k(
            s.check_cfg.replace(indexer_types=("full",)))
    if s.glm_check_cfg is not None:
        checks["scan_equals_unrolled[glm8,ctx1024]"] = check_scan_equals_unrolled(
            s.glm_check_cfg, s.vocab)


# ------------------------------------------------------------------------------ points

def _num_layers(cfg) -> int:
    return len(cfg.indexer_types)


def section_loop(s: Setup, res: dict) -> None:
    """Per batch: every variant's program from the same state; its first dispatch's tokens
    against the default program's (bitwise), then wall and kernel time per token per layer
    (each call continues the sequences)."""
    cfg = s.bench_cfg
    mcfg, _, stacked = model(cfg, s.vocab)
    prog = serve.Program(mcfg)  # weights in place
    copied = serve.Program(mcfg, weights_in_place=False)
    on_xla = serve.Program(dataclasses.replace(mcfg, dsa=mcfg.dsa.replace(gemm="xla")))
    nl, ctx = _num_layers(cfg), cfg.max_context
    variants = {k: LOOP_VARIANTS[k] for k in s.loop_variants}
    for b in (1, s.big_batch):
        calls = s.reps + 7  # first, warm-up, timed, traced: every dispatch continues
        base = random_serving(prog, b, ctx - calls * s.n, jax.random.key(b))
        first_tokens = {}
        for vname, opts in variants.items():
            row = {"name": f"loop-b{b}-l{nl}" + ("" if vname == "default" else f"[{vname}]"),
                   "variant": vname, "compiler_options": opts, "batch": b, "layers": nl,
                   "context": ctx, "tokens_per_dispatch": s.n}
            # The default program is the point; the other variants are kept beside it.
            res["points" if vname == "default" else "variants"].append(row)
            try:
                t0 = time.perf_counter()
                p = {"default": prog, "gemm-xla": on_xla}.get(vname, copied)
                lowered = serve.run_jit(p).lower(p, stacked, None, base, s.n)
                fn = lowered.compile(compiler_options=opts) if opts else lowered.compile()
                row["compile_s"] = time.perf_counter() - t0
                if b == 1 and s.hlo_dir:  # why the weights are copied: read it afterwards
                    os.makedirs(s.hlo_dir, exist_ok=True)
                    with open(os.path.join(s.hlo_dir, f"loop-b1-{vname}.hlo.txt"), "w") as f:
                        f.write(fn.as_text())
                holder = {"sv": copy_tree(base)}
                holder["sv"], outs, _ = fn(stacked, None, holder["sv"])
                first_tokens[vname] = serve.emitted_tokens(jax.device_get(outs))
                if vname != "default" and "default" in first_tokens:
                    # Informational: gemm-xla sums its GEMMs in other orders (other bits).
                    row["tokens_equal_default"] = first_tokens[vname] == first_tokens["default"]

                def call(holder=holder, fn=fn):
                    holder["sv"], outs, _ = fn(stacked, None, holder["sv"])
                    return jax.device_get(outs.tokens)  # the serving loop's one host read

                wall = wall_us(call, s.reps)
                # Every kernel kind (not the top 12): the memcpy share counts only the listed
                # ones, and the launches per layer are read from the list.
                kern = device_kernels(call, 2, top=80)
                row.update({"dispatch_us": wall, "per_token_us": wall / s.n,
                            "us_per_token_per_layer": wall / s.n / nl})
                if kern:
                    row.update({"kernel_us_per_token_per_layer":
                                kern["kernel_us"] / s.n / nl,
                                "wall_over_kernel": wall / kern["kernel_us"],
                                "launches_per_token": kern["launches"] / s.n,
                                **memcpy_share(kern["top_kernels"], s.n),
                                "top_kernels": kern["top_kernels"]})
                del holder
            except Exception as e:  # recorded in the row; the other variants still run
                row["error"] = f"{type(e).__name__}: {e}"[:400]


def section_spec(s: Setup, res: dict) -> None:
    cfg = s.bench_cfg
    mcfg, _, stacked = model(cfg, s.vocab)
    nl, ctx, k = _num_layers(cfg), cfg.max_context, 3
    plain = serve.Program(mcfg)
    base = random_serving(plain, 1, ctx - 2 * s.n, jax.random.key(7))
    base = base._replace(slots=base.slots._replace(limit=jnp.full((1,), s.n, jnp.int32)))
    box = {}

    def run_plain():
        box["sv"], box["outs"], _ = serve.run(plain, stacked, None, copy_tree(base), s.n)
        return box["outs"].tokens

    plain_us = wall_us(run_plain, s.reps)
    want = serve.emitted_tokens(jax.device_get(box["outs"]))[0]
    right = np.zeros((1, ctx), np.int32)
    first = int(base.model.lengths[0]) + 1
    right[0, first:first + len(want)] = want
    spec = serve.Program(mcfg, speculate=k, drafter=ScriptedDrafter(s.vocab, s.acceptance))
    spec_base = base._replace(draft=jnp.asarray(right))

    def run_spec():
        box["sv"], box["outs"], box["iters"] = serve.run(spec, stacked, None,
                                                         copy_tree(spec_base), s.n)
        return box["outs"].tokens

    spec_us = wall_us(run_spec, s.reps)
    outs = jax.device_get(box["outs"])
    got = serve.emitted_tokens(outs)[0]
    drafted = int(outs.drafted.sum())
    accepted = int((np.maximum(outs.count - 1, 0) * (outs.drafted > 0)).sum())
    res["checks"]["speculative_equals_plain[scripted,timed model]"] = got == want
    res["points"].append({
        "name": f"spec-b1-l{nl}-k{k}", "layers": nl, "context": ctx, "drafts": k,
        "stated_acceptance": s.acceptance, "measured_acceptance": accepted / max(drafted, 1),
        "rounds": int(box["iters"]), "tokens": len(got),
        "tokens_per_s": len(got) / spec_us * 1e6,
        "plain_tokens_per_s": len(want) / plain_us * 1e6,
        "speedup": plain_us / spec_us * len(got) / max(len(want), 1)})


def section_public(s: Setup, res: dict) -> None:
    cfg = s.bench_cfg.replace(indexer_types=("full",))
    if s.smoke:  # room for every call below
        cfg = cfg.replace(max_context=512)
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(8))
    timed = 4 * s.reps + 10
    calls = 2 * (timed + 1) + 12 + 21 + 16 * (s.reps + 1)  # every step below appends a token
    st = dsa_jax.init_state(cfg, 1)
    k = jax.random.split(jax.random.key(9), 4)
    length = jnp.full((1,), cfg.max_context - calls - 40, jnp.int32)
    st = random_caches(st, k)._replace(
        # Two buffers: the step donates both, and reads the indexer's ring mark.
        lengths=length, index_lengths=length + 0)
    x = jax.random.normal(jax.random.key(10), (1, cfg.hidden_size))
    box = {"st": st}

    def readme_call():  # the README's call, synced by the caller
        y, box["st"], _ = dsa_jax.decode(cfg, weights, box["st"], x)
        return y

    public = wall_us(readme_call, timed)
    kern = device_kernels(readme_call, 10)
    # Where the call's time goes: its host checks alone (no device work), the same one
    # program dispatched bare and synced, and the README call pipelined (no sync per call).
    layout, n_new = layer.prepare_step(cfg, weights, box["st"], x, kind="decode")
    t0 = time.perf_counter()
    for _ in range(200):
        layer.prepare_step(cfg, weights, box["st"], x, kind="decode")
    prepare = (time.perf_counter() - t0) / 200 * 1e6
    n_dev = jnp.asarray(n_new)

    def bare_call():
        y, box["st"], _ = layer.layout_step(cfg, layout, weights, box["st"], x, n_dev, None)
        return y

    bare = wall_us(bare_call, timed)
    jax.block_until_ready(readme_call())
    t0 = time.perf_counter()
    for _ in range(20):
        y = readme_call()
    jax.block_until_ready(y)
    pipelined = (time.perf_counter() - t0) / 20 * 1e6
    steps = 16
    xs = jnp.zeros((steps, 1, cfg.max_verify, cfg.hidden_size)).at[:, :, 0].set(x)
    one = jnp.ones((1,), jnp.int32)

    @bitwise_jit
    def scan16(w, st, xs):
        def body(st, xr):
            y, st, _ = layer.step(cfg, w, st, xr, one)
            return st, y[:, 0]
        return jax.lax.scan(body, st, xs)

    def device_steps():
        box["st"], ys = scan16(weights, box["st"], xs)
        return ys

    scan_step = wall_us(device_steps, s.reps) / steps
    # The device step: the call's own kernel time where a trace has it (the bench's
    # definition), else a step of 16 in one lax.scan.
    device_step = kern["kernel_us"] if kern else scan_step
    row = {"name": "public-decode-b1", "context": cfg.max_context, "median_us": public,
           "device_step_us": device_step, "scan16_step_us": scan_step,
           "host_checks_us": prepare, "bare_step_synced_us": bare,
           "public_pipelined_us": pipelined,
           "public_over_device_step": public / device_step}
    if kern:
        row["launches"] = kern["launches"]
    res["points"].append(row)


def section_scan(s: Setup, res: dict) -> None:
    """One forward (B=1, a decode's padded rows): the scanned model, the same with XLA's
    dynamic-slice fusion (per-layer weight slices read in place by the GEMMs instead of
    copied), and the unrolled stack. Lengths grow by one a call (the same work each)."""
    cfg = s.bench_cfg
    mcfg, weights, stacked = model(cfg, s.vocab)
    nl, r = _num_layers(cfg), cfg.max_verify
    serving = random_serving(serve.Program(mcfg), 1, cfg.max_context - 16 * s.reps - 64,
                             jax.random.key(11))
    box = {"scanned": serving.model, "unrolled": tuple(unfold_state(mcfg, serving.model))}
    box["scanned-dsfusion"] = copy_tree(serving.model)
    tokens = jnp.zeros((1, r), jnp.int32)
    one = jnp.ones((1,), jnp.int32)
    scanned, unrolled = FORWARD_JITS
    forms = {"scanned": (scanned, stacked), "unrolled": (unrolled, weights)}
    if jax.default_backend() == "gpu":
        forms["scanned-dsfusion"] = (bitwise_jit(
            forward, static_argnums=0, donate_argnums=2,
            compiler_options={"xla_gpu_enable_dynamic_slice_fusion": True}), stacked)
    row = {"name": f"scan-vs-unrolled-b1-l{nl}", "layers": nl}
    for name, (fn, w) in forms.items():
        def call(name=name, fn=fn, w=w):
            logits, box[name], _ = fn(mcfg, w, box[name], tokens, one)
            return logits

        try:
            row[f"{name}_us"] = wall_us(call, s.reps)
            kern = device_kernels(call, 3)
            if kern:
                row[f"{name}_kernel_us"] = kern["kernel_us"]
                row[f"{name}_top_kernels"] = kern["top_kernels"]
        except Exception as e:  # recorded in the row; the other forms still run
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    res["points"].append(row)


def section_engine(s: Setup, res: dict) -> None:
    cfg = s.bench_cfg
    mcfg, _, stacked = model(cfg, s.vocab)
    nl, b = _num_layers(cfg), s.big_batch
    prompt = 12 if s.smoke else 2048
    eng = Engine(mcfg, stacked, max_seqs=b, num_blocks=b * cfg.blocks_per_seq,
                 prefill_chunk=8 if s.smoke else 512, tokens_per_dispatch=s.n)
    rng = np.random.default_rng(12)
    for _ in range(b):
        eng.submit(rng.integers(0, s.vocab, prompt).tolist(), s.n * (s.reps + 8))
    eng.step()  # admission, prefill, the first dispatch (compiles)
    before = eng.stats.tokens
    wall = wall_us(eng.step, s.reps)
    tokens_per_step = (eng.stats.tokens - before) / (s.reps + 1)
    kern = device_kernels(eng.step, 1)
    row = {"name": f"engine-b{b}-l{nl}", "batch": b, "layers": nl, "prompt": prompt,
           "tokens_per_dispatch": s.n, "step_us": wall, "per_step_per_layer_us": wall / s.n / nl,
           "tokens_per_s": tokens_per_step / wall * 1e6}
    if kern:
        row.update({"kernel_per_step_per_layer_us": kern["kernel_us"] / s.n / nl,
                    "wall_over_kernel": wall / kern["kernel_us"]})
    res["points"].append(row)


def section_compile(s: Setup, res: dict) -> None:
    cfg = s.bench_cfg
    mcfg, _, stacked = model(cfg, s.vocab)
    prog = serve.Program(mcfg)
    n = s.n + 1  # a dispatch length no other section compiles
    states = [random_serving(prog, 1, ctx - 2 * n, jax.random.key(ctx))
              for ctx in (cfg.max_context // 4, cfg.max_context)]
    log = CompileLog()
    mark = log.mark()
    for sv in states:
        jax.block_until_ready(serve.run(prog, stacked, None, sv, n))
    res["compile"]["run_compiles_across_two_contexts"] = log.since(mark)[0]
    seconds = {}
    for depth in (2,) if s.smoke else (2, 8, 16):
        dcfg = cfg.replace(indexer_types=("full", "shared") * (depth // 2))
        dm = ModelConfig(dcfg, vocab_size=s.vocab)
        layers = tuple(expected_weights(dcfg, kind == "full") for kind in dcfg.indexer_types)
        f32 = jax.ShapeDtypeStruct
        abstract = ModelWeights(f32((s.vocab, dcfg.hidden_size), jnp.float32),
                                f32((depth, dcfg.hidden_size), jnp.float32), layers,
                                f32((dcfg.hidden_size,), jnp.float32),
                                f32((s.vocab, dcfg.hidden_size), jnp.dtype(dcfg.param_dtype)))
        w = jax.eval_shape(lambda a, dm=dm: stack_weights(dm, a), abstract)
        sv = jax.eval_shape(lambda dm=dm: serve.Serving(
            init_model_state(dm, 1, dm.dsa.blocks_per_seq), serve.init_slots(dm, 1), None))
        t0 = time.perf_counter()
        prog = serve.Program(dm)
        serve.run_jit(prog).lower(prog, w, None, sv, s.n + 2).compile()  # not cached
        seconds[depth] = time.perf_counter() - t0
    res["compile"]["run_compile_s_by_depth"] = seconds


def section_bigpool(s: Setup, res: dict) -> None:
    """The timed model at 64 sequences (its stacked latent pool 4 GiB): do the scanned and the
    unrolled forward write the new tokens' latent rows alike in every layer?"""
    b = 2 if s.smoke else s.big_batch  # under --smoke: the checks' shapes, no new compile
    r = check_written_rows(s.bench_cfg, s.vocab, b)
    res["checks"][f"written_rows_equal[b{b},pool {r['pool_bytes']} B]"] = r["ok"]
    res["bigpool"] = r


# ------------------------------------------------------------------------------ main

def table(res: dict) -> str:
    lines = ["check                                             ok"]
    lines += [f"  {k:<48}{v}" for k, v in res["checks"].items()]
    lines.append("point                       per token/layer us  kernel us  wall/kernel")
    for p in res["points"] + res["variants"]:
        if "error" in p:
            lines.append(f"  {p['name']:<26}ERROR {p['error'][:70]}")
        elif p["name"].startswith(("loop", "engine")):
            wall = p.get("us_per_token_per_layer", p.get("per_step_per_layer_us"))
            kern = p.get("kernel_us_per_token_per_layer", p.get("kernel_per_step_per_layer_us"))
            extra = "".join(f"  {k}={p[k]}" for k in ("tokens_equal_default",
                                                       "memcpy_launches_per_token") if k in p)
            lines.append(f"  {p['name']:<26}{wall:>12.1f}{kern or float('nan'):>11.1f}"
                         f"{p.get('wall_over_kernel', float('nan')):>11.2f}{extra}")
        elif p["name"].startswith("spec"):
            lines.append(f"  {p['name']:<26}spec {p['tokens_per_s']:.0f} tok/s vs plain "
                         f"{p['plain_tokens_per_s']:.0f} at acceptance "
                         f"{p['measured_acceptance']:.2f}")
        elif p["name"].startswith("public"):
            lines.append(f"  {p['name']:<26}{p['median_us']:.0f} us vs device step "
                         f"{p['device_step_us']:.0f} us: {p['public_over_device_step']:.2f}x "
                         f"(checks {p['host_checks_us']:.0f} us, bare step synced "
                         f"{p['bare_step_synced_us']:.0f} us, pipelined "
                         f"{p['public_pipelined_us']:.0f} us)")
        else:
            forms = ", ".join(f"{k[:-3]} {v:.0f} us" for k, v in p.items()
                              if k.endswith("_us") and not k.endswith("kernel_us"))
            lines.append(f"  {p['name']:<26}{forms}")
    for k, v in res["compile"].items():
        lines.append(f"  {k}: {v}")
    if res["errors"]:
        lines.append(f"errors: {len(res['errors'])} (in the JSON)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = json_parser(__doc__)
    ap.add_argument("--only", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--copied-weights", action="store_true",
                    help="the checks also under Program(weights_in_place=False)'s options")
    ap.add_argument("--colaunch", default="on", choices=("on", "off"),
                    help="the GLM configs' colaunch (the top-k and q_b GEMM in one launch)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per dispatch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--loop-variants", nargs="*", choices=list(LOOP_VARIANTS),
                    default=list(LOOP_VARIANTS), help="compiler options of the loop section")
    args = ap.parse_args(argv)
    s = make_setup(args)
    res = {**header("h200_loop.py", argv),
           "setup": {"bench_layers": list(s.bench_cfg.indexer_types), "vocab": s.vocab,
                     "context": s.bench_cfg.max_context, "tokens_per_dispatch": s.n,
                     "implementation": s.bench_cfg.implementation,
                     "cache_dtype": s.bench_cfg.cache_dtype,
                     "param_dtype": s.bench_cfg.param_dtype},
           "checks": {}, "points": [], "variants": [], "compile": {}, "errors": []}
    sections = {"checks": section_checks, "loop": section_loop, "spec": section_spec,
                "public": section_public, "scan": section_scan, "engine": section_engine,
                "compile": section_compile, "bigpool": section_bigpool}
    for name in SECTIONS:
        if name not in args.only:
            continue
        run_section(res, name, lambda name=name: sections[name](s, res))
        write_json(res, args.out)
    print(table(res))
    ok = all(v is True for v in res["checks"].values())
    return 0 if ok and not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
