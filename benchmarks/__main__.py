"""`python -m benchmarks` (from the repository root; `dsa-jax bench` runs the same): the
benchmark suite of the DSA block. `python -m benchmarks --help` lists the groups and options.

GLM-5.3-Flash shapes (`dsa_jax.shapes.glm53_flash()`: bf16 weights, fp8 latent cache), random
weights and inputs (never zeros), caches filled to the context directly. Timed: the layer step
(`jax.jit(dsa_jax.layer.step)`, implementation pallas and xla), the public `dsa_jax.decode`
call, the gather-attend and the selection alone, a prefill, context scaling and the compile
count, the state's memory, levers, a per-stage breakdown, the serving loop (the model's
device loop, speculative decoding, the engine's step), and the Hugging Face
`Glm5NextTextAttention` as a baseline; every point against a measured roofline or its kernel
time and its target (benchmarks/points.py). Writes one JSON per run (with the checkout's
commit); `python -m benchmarks.render` turns one run into BENCHMARKS.md. `--smoke` runs the
whole suite on the tiny config with few repetitions (CPU, seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import subprocess
import sys

from .points import GROUPS, full_plan, quick, smoke_plan

HERE = os.path.dirname(os.path.abspath(__file__))
# XLA's CPU backend at optimization level 0 compiles the smoke plan's programs in ~3/4 the time.
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
DEFAULT_RESULTS = os.path.join(HERE, "results")


def build_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark the DSA block (GLM-5.3-Flash shapes): the layer step with "
                    "implementation pallas and xla, the kernels alone, the selection, prefill, "
                    "context scaling, compile count, state memory, the serving loop, the "
                    "Hugging Face glm5_next block as a baseline, against a measured roofline. "
                    "Writes one JSON.",
        epilog="Exit status: 0 done (points that failed to run are recorded in the JSON), "
               "1 the ceilings could not be measured, 2 bad arguments, 3 the device was lost "
               "after an error (partial JSON written).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default=None,
                    help="a DsaConfig JSON file (default: dsa_jax.shapes.glm53_flash(); "
                         "ignored with --smoke)")
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
    ap.add_argument("--note", default="", help="free text stored in the JSON (the run's commit "
                    "where git cannot name it)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="skip the groups not yet started once this many seconds have passed "
                         "(0: no limit)")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--no-levers", action="store_true",
                    help="levers: byte counts only, no timed lever")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    ap.add_argument("--mem-fraction", default="0.45",
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION when not set (torch needs the rest: "
                         "HF 5.17 caches per-head keys and values, ~60 GB for 64 sequences "
                         "at 16K)")
    return ap


def _device_slug(device: str) -> str:
    slug = "-".join(s for s in "".join(c if c.isalnum() else "-"
                                       for c in device.lower()).split("-") if s)
    return next((card for card in ("h200", "h100") if card in slug), slug)


def git_commit(note: str) -> str:
    """The checkout's `git rev-parse --short HEAD` (with "+changes (note)" when the tree
    differs from it: a device's copy of the tree may carry an older .git), else `note` (a copy
    of the tree without its .git names its commit there)."""
    root = os.path.dirname(HERE)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=20)
        if head.returncode != 0 or not head.stdout.strip():
            return note
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=20)
        changes = "+changes" + (f" ({note})" if note else "")
        return head.stdout.strip() + (changes if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return note


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(raw)
    args.argv = raw
    only = {g for g in args.only.split(",") if g}
    skip = {g for g in args.skip.split(",") if g}
    unknown = (only | skip) - set(GROUPS)
    if unknown:
        print(f"{prog}: unknown group(s) {sorted(unknown)}; groups are {GROUPS}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", args.mem_fraction)
    if args.smoke and "jax" not in sys.modules:  # the smoke times nothing: compile it fast
        os.environ.setdefault("XLA_FLAGS", SMOKE_XLA_FLAGS)
    # HF's caches grow by concatenation: without expandable segments torch fragments its pool
    # between contexts and a 9000-token eager prefill no longer finds 20 GB in one piece.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # Imported only now: the settings above must be in place before jax (or torch) starts.
    import jax

    from dsa_jax.config import DsaConfig
    from dsa_jax.shapes import glm53_flash, tiny

    from .harness import log, machine_info
    from .suite import FLOOR_RULE, TIMING_METHOD, TP_NOTE, Suite

    if args.smoke:
        cfg = tiny(implementation="xla")
        plan = smoke_plan(cfg)
    else:
        cfg = glm53_flash() if args.config is None else DsaConfig.from_json(args.config)
        plan = quick(full_plan(cfg)) if args.quick else full_plan(cfg)
    now = datetime.datetime.now(datetime.UTC)
    info = machine_info()
    out_dir = args.out or os.environ.get("OUT") or DEFAULT_RESULTS
    name = args.name or (f"{'smoke' if args.smoke else _device_slug(info['device'])}-bench-"
                         f"{now.strftime('%Y%m%d-%H%M%S')}.json")
    command = " ".join([prog] + [shlex.quote(a) for a in raw])
    suite = Suite(args, cfg, plan, os.path.join(out_dir, name), command)
    suite.result.update(
        date=now.isoformat(), machine=info, jax_version=jax.__version__, note=args.note,
        commit=git_commit(args.note),
        config=dataclasses.asdict(cfg), plan=dataclasses.asdict(plan),
        timing_method=TIMING_METHOD, tp_note=TP_NOTE, floor_rule=FLOOR_RULE)
    log(f"[bench] {info.get('device')} jax {jax.__version__} -> {suite.out_path}")
    return suite.run([g for g in GROUPS if (not only or g in only) and g not in skip])


if __name__ == "__main__":
    sys.exit(main())
