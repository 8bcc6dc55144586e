"""The `dsa-jax` command. `dsa-jax` alone is `dsa-jax run`: the main job on the shipped "tiny"
config (dsa_jax/configs/tiny.json)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import jax
import numpy as np

from dsa_jax.checkpoint_io import CheckpointError
from dsa_jax.cli_checks import CliError, OneLineParser, check_convert_args, check_run_args, one_line
from dsa_jax.config import PARAM_DTYPES
from dsa_jax.fp8 import FP8
from dsa_jax.shapes import shipped_configs
from dsa_jax.weights import WeightError

DEFAULT_CONFIG = "tiny"


def chosen_pools(sel_row: np.ndarray, kpool: int) -> tuple[list[int], list[int]]:
    """One selection row `[W]` -> (pools in selection order, tail tokens)."""
    tokens = [int(t) for t in sel_row if t >= 0]
    pools, tail = [], []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t % kpool == 0 and tokens[i:i + kpool] == list(range(t, t + kpool)):
            pools.append(t // kpool)
            i += kpool
        else:
            tail.append(t)
            i += 1
    return pools, tail


def _fmt_pools(pools: list[int], limit: int = 12) -> str:
    shown = ",".join(str(p) for p in pools[:limit])
    return shown + (f",... ({len(pools)} pools)" if len(pools) > limit else f" ({len(pools)})")


def selection_map(selections: list[np.ndarray], first_pos: int, kpool: int) -> np.ndarray:
    """Layer-0 selection rows of consecutive positions -> `[steps, pools]` 0/1/2 image
    (1: the pool was chosen, 2: a tail token of the incomplete pool)."""
    last = first_pos + len(selections)
    image = np.zeros((len(selections), last // kpool + 1), np.uint8)
    for i, row in enumerate(selections):
        pools, tail = chosen_pools(row, kpool)
        image[i, pools] = 1
        for t in tail:
            image[i, t // kpool] = 2
    return image


def save_selection_png(image: np.ndarray, first_pos: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    ax.imshow(image, aspect="auto", interpolation="nearest", origin="lower",
              cmap=ListedColormap(["#f4f4f4", "#1f5fa8", "#e07b39"]), vmin=0, vmax=2,
              extent=(-0.5, image.shape[1] - 0.5, first_pos - 0.5, first_pos + len(image) - 0.5))
    ax.set_xlabel("pool index (KP tokens each)")
    ax.set_ylabel("query position")
    ax.set_title(title + "\nblue: selected pools, orange: visible tail", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@contextlib.contextmanager
def compile_seconds():
    """Within the block, a one-element list summing the seconds jax spends tracing, lowering
    and compiling (its `jax.monitoring` duration events), so tokens/s can leave them out."""
    total = [0.0]

    def listen(event: str, seconds: float, **_):
        if event.startswith("/jax/core/compile/"):
            total[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield total
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dsa_jax.engine import Engine, EngineError, ModelConfig, init_model

    cfg = check_run_args(args)
    mcfg = ModelConfig(cfg, vocab_size=args.vocab)
    key = jax.random.key(args.seed)
    layers = None
    if args.checkpoint:
        from dsa_jax.checkpoint import restore_weights

        try:
            layers = tuple(restore_weights(args.checkpoint, cfg))
        except CheckpointError as err:  # e.g. a checksum mismatch: found only when reading
            raise CliError(f"--checkpoint {args.checkpoint}: {err}") from err
    weights = init_model(mcfg, key, layers)
    need = args.prompt_len + args.steps + args.speculate
    blocks = args.num_seqs * -(-need // cfg.block_size)
    try:
        engine = Engine(mcfg, weights, max_seqs=args.num_seqs, num_blocks=blocks,
                        speculate=args.speculate, record_selections=True)
        rng = np.random.default_rng(args.seed)
        # Prompts with repeats, so the n-gram drafter finds continuations.
        motif = rng.integers(0, mcfg.vocab_size, size=(args.num_seqs, 8))
        prompts = [list(np.resize(np.concatenate([m, rng.integers(0, mcfg.vocab_size, 3)]),
                                  args.prompt_len)) for m in motif]
        reqs = [engine.submit([int(t) for t in p], args.steps) for p in prompts]
    except EngineError as err:
        raise CliError(str(err)) from err
    print(f"dsa-jax run: {os.path.basename(args.config)}  layers={mcfg.num_layers} "
          f"({','.join(cfg.indexer_types)})  D={cfg.hidden_size} H={cfg.num_heads} "
          f"C={cfg.kv_lora_rank} topk={cfg.index_topk} kpool={cfg.index_kpool} "
          f"cache={cfg.cache_dtype} backend={jax.default_backend()} "
          f"sequences={args.num_seqs} prompt={args.prompt_len} new={args.steps} "
          f"drafts<={args.speculate}")
    layer_bytes = sum(a.nbytes for a in jax.tree.leaves(weights.layers))
    print(f"weights of the {mcfg.num_layers} DSA layers: {layer_bytes / 2 ** 20:.1f} MiB "
          f"({cfg.param_dtype}{' blocks + fp32 scales' if cfg.param_dtype == FP8 else ''}; "
          f"{layer_bytes / mcfg.num_layers / 2 ** 20:.1f} MiB a layer)")
    print("compiling the prefill and the serving loop, then generating ...", flush=True)
    t0 = time.perf_counter()
    with compile_seconds() as compiling, tqdm(total=args.num_seqs * args.steps, unit="tok",
                                              desc="generating", disable=args.quiet) as bar:
        engine.run_until_done(bar)
    seconds = time.perf_counter() - t0
    st = engine.stats
    steady = max(seconds - compiling[0], 1e-9)
    print(f"{st.tokens} tokens in {seconds:.2f} s: compiling {compiling[0]:.2f} s, generating "
          f"{steady:.2f} s ({st.tokens / steady:.1f} tok/s); {st.steps} decode steps; drafts "
          f"accepted {st.accepted}/{st.drafted} ({100 * st.acceptance:.0f}%)")
    req = reqs[0]
    first = len(req.prompt)
    print(f"sequence 0 generated: {req.output[:24]}{' ...' if len(req.output) > 24 else ''}")
    print(f"{'pos':>5}  pools chosen by layer 0 for sequence 0 (selection order) | tail")
    for i, row in enumerate(req.selections[:args.show]):
        pools, tail = chosen_pools(row, cfg.index_kpool)
        print(f"{first + i:>5}  {_fmt_pools(pools)} | {tail}")
    png = os.path.join(args.out, "selection_map.png")
    save_selection_png(selection_map(req.selections, first, cfg.index_kpool), first, png,
                       f"dsa-jax run: layer 0, sequence 0 ({os.path.basename(args.config)})")
    print(f"selection map written to {png}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from dsa_jax.checkpoint import convert_hf_checkpoint

    cfg, layers = check_convert_args(args)
    try:
        done = convert_hf_checkpoint(args.src, args.dst, cfg, layers, tp_rank=args.tp_rank,
                                     overwrite=args.overwrite)
    except (CheckpointError, WeightError) as err:
        raise CliError(str(err)) from err
    print(f"converted layers {done} of {args.src} -> {os.path.abspath(args.dst)} "
          f"(folded, {cfg.param_dtype}, tp rank {args.tp_rank}/{cfg.tp_degree})")
    return 0


def cmd_bench(argv: list[str]) -> int:
    """`dsa-jax bench`: the benchmark harness is the repository's `benchmarks/` package, which
    is not installed with dsa_jax; run it from the checkout this package was installed from."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "benchmarks", "__main__.py")):
        print("dsa-jax bench: the benchmark harness is not part of the installed package; "
              "from a checkout of the dsa_jax repository run `python -m benchmarks`",
              file=sys.stderr)
        return 2
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.__main__ import main as bench_main

    return bench_main(argv, prog="dsa-jax bench")


# Subcommands that parse the rest of the command line themselves: a module with `main(argv)`,
# or a function of argv.
DELEGATED = {
    "bench": (cmd_bench, "time the block on this machine against its roofline (from a "
                         "checkout)"),
    "parity": ("dsa_jax.parity", "implementations vs reference (and HF), a pass/fail table"),
}


class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, where it has one (not None, not a flag's False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dsa-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="prefill and decode with random weights, showing the "
                                     "pools each step selects (the default)",
                         formatter_class=ShowDefaults)
    run.add_argument("--config", default=DEFAULT_CONFIG,
                     help=f"a shipped config by name ({', '.join(shipped_configs())}; default "
                          f"%(default)s) or a JSON file of DsaConfig fields")
    run.add_argument("--checkpoint", help="an orbax checkpoint of folded DSA layers "
                                          "(from `dsa-jax convert`); random layers otherwise")
    run.add_argument("--layers", type=int, help="DSA layers, alternating full/shared "
                                                "(default: the config's indexer_types)")
    run.add_argument("--vocab", type=int, default=256, help="vocabulary of the toy model")
    run.add_argument("--num-seqs", type=int, default=4, help="sequences served together")
    run.add_argument("--prompt-len", type=int, default=120, help="prompt tokens per sequence")
    run.add_argument("--steps", type=int, default=48, help="new tokens per sequence")
    run.add_argument("--speculate", "-k", type=int, default=3,
                     help="n-gram drafts verified per step (0: plain decoding)")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    run.add_argument("--param-dtype", choices=list(PARAM_DTYPES),
                     help="the layers' weights (default: the config's); float8_e4m3fn keeps "
                          "them as fp8 blocks with their scales (the config's weight_block)")
    run.add_argument("--implementation", default="auto",
                     choices=["auto", "xla", "pallas", "pallas-interpret"],
                     help="the kernels (pallas) or their jnp twins (xla); auto: pallas on a GPU")
    run.add_argument("--out", default="out", help="folder for the selection map PNG")
    run.add_argument("--show", type=int, default=8, help="selection rows to print")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)
    for name, (_, text) in DELEGATED.items():
        sub.add_parser(name, help=f"{text} (`dsa-jax {name} --help`)", add_help=False)
    conv = sub.add_parser("convert", help="an HF checkpoint's DSA layers -> an orbax checkpoint "
                                          "of folded weights",
                          formatter_class=ShowDefaults)
    conv.add_argument("src", help="safetensors file or (sharded) HF checkpoint folder")
    conv.add_argument("dst", help="orbax checkpoint folder to write")
    conv.add_argument("--hf-config", help="config.json (default: the one beside src)")
    conv.add_argument("--layers", help="comma-separated model layer ids (default: all)")
    conv.add_argument("--max-context", type=int, default=16384, help="longest sequence served")
    conv.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    conv.add_argument("--param-dtype", default="bfloat16", choices=list(PARAM_DTYPES),
                      help="dtype of the folded weights; float8_e4m3fn keeps an fp8 "
                           "checkpoint's blocks (weight_block_size of its config)")
    conv.add_argument("--tp-degree", type=int, default=1, help="tensor-parallel ranks")
    conv.add_argument("--tp-rank", type=int, default=0, help="the rank whose heads to keep")
    conv.add_argument("--overwrite", action="store_true", help="replace dst if it exists")
    conv.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    if argv[0] in DELEGATED:
        import importlib

        target = DELEGATED[argv[0]][0]
        if callable(target):
            return target(argv[1:])
        return importlib.import_module(target).main(argv[1:])
    prog = f"dsa-jax {argv[0]}" if argv and argv[0] in ("run", "convert") else "dsa-jax"
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except CliError as err:
        print(f"{prog}: error: {one_line(str(err))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
