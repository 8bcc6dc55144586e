"""H200: the device kernels of the bench's prefill-9000 and decode-b1 steps, listed per kernel
(the two points whose targets are kernel time, or a step paced by its kernels): where the
next lever of each must come from.

    PYTHONPATH=. python3 benchmarks/h200_profile.py --out $OUT/h200-profile.json [--top 40]
        [--gemm xla] [--steps prefill-9000] [--hlo $OUT/hlo]
    PYTHONPATH=. python3 benchmarks/h200_profile.py --smoke --out /tmp/h200-profile.json

Each step is the bench's own (`benchmarks.workloads.StepRunner`, as `measures.prefill` and
`measures.step` build them: GLM-5.3-Flash, pallas): the prompt of 9000 tokens from an empty
context, and one decode row at context 16384. Per step: its wall time (median of back-to-back
calls, `harness.measure`) and a profiler trace's kernels (`harness.profile_step`): total,
launches, and the `--top` largest by time with their launches.
"""

from __future__ import annotations

import os

import jax

from benchmarks.device_script import header, json_parser, run_section, write_json
from benchmarks.harness import measure, profile_step
from benchmarks.points import full_plan, smoke_plan
from benchmarks.workloads import StepRunner, random_hf_tensors, random_weights
from dsa_jax import layer
from dsa_jax.shapes import glm53_flash, tiny


def steps(cfg, plan, weights) -> dict:
    """name -> (runner, traced steps, timed groups)."""
    s = plan.prefill_tokens
    return {
        f"prefill-{s}": (StepRunner(cfg, weights, 1, s, s, 0, 500), 3, plan.long_groups),
        # the rows the bench's decode runs (`measures.run_step`): 1 under row-invariant GEMMs
        "decode-b1-k1-tp1": (StepRunner(cfg, weights, 1, 1, layer.decode_rows(cfg, "decode"),
                                        plan.ctx - plan.inner, 3000), plan.inner - 2,
                             plan.groups)}


def main(argv: list[str] | None = None) -> int:
    ap = json_parser(__doc__)
    ap.add_argument("--top", type=int, default=40, help="kernels listed per step")
    ap.add_argument("--gemm", default="auto", help="the config's gemm (a side by side)")
    ap.add_argument("--colaunch", default="on", choices=("on", "off"),
                    help="the config's colaunch (the top-k and q_b GEMM in one launch)")
    ap.add_argument("--steps", nargs="*", default=None, help="step names (default: all)")
    ap.add_argument("--hlo", default=None,
                    help="a folder: each step's optimized HLO as <step>.hlo.txt (which ops each "
                         "fusion of the kernel list holds)")
    args = ap.parse_args(argv)
    cfg = (tiny() if args.smoke else glm53_flash()).replace(
        implementation="xla" if args.smoke else "pallas", gemm=args.gemm,
        colaunch=args.colaunch == "on")
    plan = (smoke_plan if args.smoke else full_plan)(cfg)
    weights = random_weights(cfg, random_hf_tensors(cfg, 0), 1)
    res = {**header("h200_profile.py", argv), "rows": [], "errors": []}
    for name, (runner, traced, groups) in steps(cfg, plan, weights).items():
        if args.steps is not None and name not in args.steps:
            continue
        def one(name=name, runner=runner, traced=traced, groups=groups):
            jax.block_until_ready(runner())
            t = measure(runner, warmup=1, groups=groups, inner=1, reset=runner.reset)
            prof = profile_step(runner, traced, top=args.top)
            res["rows"].append({"step": name, "wall_us": t["median_us"],
                                "kernel_us": prof.get("kernel_us_per_step"),
                                "launches": prof.get("launches_per_step"),
                                "top": prof.get("top_kernels"),
                                "first_call": prof.get("first_call"), "error": prof.get("error")})
            print(name, {k: v for k, v in res["rows"][-1].items()
                         if k not in ("top", "first_call")}, flush=True)
            for k in res["rows"][-1]["top"] or []:
                print(f"   {k['us_per_step']:9.2f} {k['launches_per_step']:5.1f} {k['name'][:90]}")
            write_json(res, args.out)
            if args.hlo:
                os.makedirs(args.hlo, exist_ok=True)
                text = runner.step.lower(runner.cfg, runner.weights, runner.state, runner.xs[0],
                                         runner.n_new, None, **runner.kwargs).compile().as_text()
                with open(os.path.join(args.hlo, f"{name}.hlo.txt"), "w") as f:
                    f.write(text)
        run_section(res, name, one)
    write_json(res, args.out)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
