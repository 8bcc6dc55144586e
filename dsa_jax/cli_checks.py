"""The `dsa-jax` command's argument checks: every bad input is found before any work and
reported as one line naming the argument and the reason (`CliError`; `cli.main` prints it
and exits with status 2)."""

from __future__ import annotations

import argparse
import os
import re
import tempfile

from dsa_jax.config import ConfigError, DsaConfig
from dsa_jax.errors import CliError

# convert's serving arguments and the config fields they set.
SERVING_ARGS = {"max_context": "--max-context", "block_size": "--block-size",
                "param_dtype": "--param-dtype", "tp_degree": "--tp-degree"}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is a `CliError` (one line) instead of usage + exit."""

    def error(self, message):
        raise CliError(message)


def one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _about(arg: str, value, message: str) -> CliError:
    """`arg value: message`, without the path twice when the message starts with it."""
    for prefix in (os.fspath(value), os.path.abspath(os.fspath(value))):
        if message.startswith(prefix + ": "):
            message = message[len(prefix) + 2:]
    return CliError(f"{arg} {value}: {message}")


def _at_least(args: argparse.Namespace, low: int, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < low:
            flag = "--" + name.replace("_", "-")
            what = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise CliError(f"{flag} must be {what}, got {value}")


def _writable_folder(arg: str, path: str) -> None:
    """Create `path` (a folder) if needed and write a probe file in it."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CliError(f"{arg} {path}: cannot create the folder ({e.strerror or e})") from e
    try:
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        raise CliError(f"{arg} {path}: cannot write there ({e.strerror or e})") from e


def check_run_args(args: argparse.Namespace) -> DsaConfig:
    """`dsa-jax run`: counts, the config, the implementation, the checkpoint, the request
    sizes and the output folder, in that order. Returns the config (with `--layers`)."""
    from dsa_jax.implementation import ImplementationError, resolve

    _at_least(args, 1, "num_seqs", "prompt_len", "steps", "layers")
    _at_least(args, 2, "vocab")
    _at_least(args, 0, "speculate", "show", "seed")
    from dsa_jax.shapes import load_config, shipped_configs

    try:
        dtype = {"param_dtype": args.param_dtype} if args.param_dtype else {}
        cfg = load_config(args.config, implementation=args.implementation, **dtype)
    except FileNotFoundError as e:
        raise CliError(f"--config {args.config}: no such file, and not a shipped config (those "
                       f"are {', '.join(shipped_configs())})") from e
    except ConfigError as e:
        raise _about("--config", args.config, str(e)) from e
    if args.layers is not None:
        cfg = cfg.replace(indexer_types=tuple("full" if i % 2 == 0 else "shared"
                                              for i in range(args.layers)))
    try:
        resolve(cfg.implementation)  # an implementation this machine cannot run: named here
    except ImplementationError as e:
        raise CliError(f"--implementation {args.implementation}: {e}") from e
    if args.checkpoint:
        _check_weights_checkpoint(args.checkpoint, cfg)
    if args.speculate > cfg.max_verify - 1:
        raise CliError(f"--speculate {args.speculate}: drafts need {args.speculate + 1} verify "
                       f"rows; max_verify is {cfg.max_verify}, so at most "
                       f"{cfg.max_verify - 1} drafts")
    need = args.prompt_len + args.steps + args.speculate
    if need > cfg.max_context:
        raise CliError(f"--prompt-len {args.prompt_len} + --steps {args.steps} + --speculate "
                       f"{args.speculate} = {need} tokens exceeds max_context "
                       f"{cfg.max_context} of the config")
    _writable_folder("--out", args.out)
    return cfg


def _check_weights_checkpoint(path: str, cfg: DsaConfig) -> None:
    from dsa_jax.checkpoint import CheckpointError, weights_info

    try:
        info = weights_info(path, cfg)
    except CheckpointError as e:
        raise _about("--checkpoint", path, str(e)) from e
    saved = ["full" if hi else "shared" for hi in info["has_indexer"]]
    if saved != list(cfg.indexer_types):
        raise CliError(f"--checkpoint {path}: {len(saved)} layer(s) ({','.join(saved)}), but "
                       f"the model has {len(cfg.indexer_types)} "
                       f"({','.join(cfg.indexer_types)}); use --layers or another config")


def check_convert_args(args: argparse.Namespace) -> tuple[DsaConfig, list[int] | None]:
    """`dsa-jax convert`: the source, its config, the layers, the rank and the destination.
    Returns the config and the layer ids (None: all)."""
    from dsa_jax.checkpoint import CheckpointError, check_destination

    if not os.path.exists(args.src):
        raise CliError(f"src {args.src}: no such file or folder")
    hf_config = args.hf_config or (args.src if os.path.isdir(args.src)
                                   else os.path.dirname(os.path.abspath(args.src)))
    serving = {name: getattr(args, name) for name in SERVING_ARGS}
    try:
        cfg = DsaConfig.from_hf_config(hf_config, **serving)
    except ConfigError as e:
        flags = [f"{flag} {serving[name]}" for name, flag in SERVING_ARGS.items()
                 if re.search(rf"\b{name}\b", str(e))]
        if flags:
            raise CliError(f"{' '.join(flags)}: {e}") from e
        raise _about("--hf-config", hf_config, str(e)) from e
    layers = None
    if args.layers:
        layers = []
        for tok in args.layers.split(","):
            if not re.fullmatch(r"\s*\d+\s*", tok):
                raise CliError(f"--layers '{args.layers}': '{tok}' is not a layer id "
                               f"(comma-separated integers >= 0)")
            layers.append(int(tok))
    if not 0 <= args.tp_rank < cfg.tp_degree:
        raise CliError(f"--tp-rank {args.tp_rank} is outside [0, {cfg.tp_degree}) "
                       f"(--tp-degree)")
    dst = os.path.abspath(args.dst)
    if os.path.lexists(dst) and not args.overwrite:
        raise CliError(f"dst {args.dst} already exists; pass --overwrite to replace it")
    try:
        check_destination(dst, args.overwrite)
    except CheckpointError as e:
        raise CliError(f"dst {e}") from e
    parent = os.path.dirname(dst)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CliError(f"dst {args.dst}: cannot create the folder ({e.strerror or e})") from e
    return cfg, layers
