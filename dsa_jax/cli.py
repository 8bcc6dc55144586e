"""The `dsa-jax` command. `dsa-jax` alone is `dsa-jax run`: the main job on configs/tiny.json."""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.config import DsaConfig
from dsa_jax.layer import decode, prefill
from dsa_jax.state import init_state
from dsa_jax.weights import init_random_weights

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "tiny.json")


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


def cmd_run(args: argparse.Namespace) -> int:
    cfg = DsaConfig.from_json(args.config, implementation=args.implementation)
    if args.prompt_len + args.steps > cfg.max_context:
        print(f"error: prompt length {args.prompt_len} + steps {args.steps} exceeds max_context "
              f"{cfg.max_context}", file=sys.stderr)
        return 2
    key = jax.random.key(args.seed)
    wkey, xkey = jax.random.split(key)
    weights = init_random_weights(cfg, wkey)
    state = init_state(cfg, args.num_seqs)
    total = args.prompt_len + args.steps
    x = jax.random.normal(xkey, (args.num_seqs, total, cfg.hidden_size), jnp.float32)
    print(f"dsa-jax run: {os.path.basename(args.config)}  D={cfg.hidden_size} H={cfg.num_heads} "
          f"C={cfg.kv_lora_rank} topk={cfg.index_topk} kpool={cfg.index_kpool} "
          f"cache={cfg.cache_dtype} backend={jax.default_backend()} "
          f"sequences={args.num_seqs}")
    t0 = time.perf_counter()
    y, state, sel = prefill(cfg, weights, state, x[:, :args.prompt_len])
    jax.block_until_ready(y)
    print(f"prefill {args.prompt_len} tokens: {1e3 * (time.perf_counter() - t0):.1f} ms "
          f"(includes compile)")
    print(f"{'step':>4} {'pos':>5} {'ms':>8}  pools chosen by sequence 0 (selection order) | tail")
    times = []
    for step in range(args.steps):
        t = args.prompt_len + step
        t1 = time.perf_counter()
        y, state, sel = decode(cfg, weights, state, x[:, t])
        jax.block_until_ready(y)
        ms = 1e3 * (time.perf_counter() - t1)
        times.append(ms)
        pools, tail = chosen_pools(np.asarray(sel[0]), cfg.index_kpool)
        print(f"{step:>4} {t:>5} {ms:>8.2f}  {_fmt_pools(pools)} | {tail}")
    if len(times) > 1:
        print(f"decode: median {np.median(times[1:]):.2f} ms/step after the first "
              f"(first step {times[0]:.1f} ms includes compile); |y| = "
              f"{float(jnp.linalg.norm(y)):.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsa-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="prefill and decode with random weights, showing the "
                                     "pools each step selects (the default)")
    run.add_argument("--config", default=DEFAULT_CONFIG, help="a configs/*.json file")
    run.add_argument("--num-seqs", type=int, default=2)
    run.add_argument("--prompt-len", type=int, default=100)
    run.add_argument("--steps", type=int, default=12)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--implementation", default="auto",
                     choices=["auto", "xla", "pallas", "pallas-interpret"])
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
