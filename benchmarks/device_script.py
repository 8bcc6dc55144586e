"""What the device scripts (benchmarks/h200_*.py) share around their measurements: their common
options, the command line and header their results record, writing the results JSON as it
grows, and a section run whose failure is recorded while the others still run.

jax is imported inside the functions: some scripts set its flags (host devices, the Mosaic
ptxas dump) before it loads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable


def json_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser (described by its docstring's first line) with `--out` (the results
    JSON's path, required) and `--smoke` (a CPU run at tiny shapes on the xla path)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, xla")
    return ap


def sweep_parser(smoke_help: str, budget_s: float, budget_help: str
                 ) -> argparse.ArgumentParser:
    """A sweep script's parser with `--out` (a folder: $OUT, else the working folder),
    `--smoke` and `--budget-s` (the script's time budget, `budget_s` by default)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    ap.add_argument("--budget-s", type=float, default=budget_s, help=budget_help)
    return ap


def results_path(folder: str, name: str) -> str:
    """`folder/name`, the folder made if missing."""
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


def index_config(smoke: bool):
    """The selection sweeps' config: GLM-5.3's (`shapes.glm53_flash()`), or at `smoke` a tiny
    indexer (3 heads of 12, 112 pools, top 20) that runs interpreted on a CPU in seconds."""
    from dsa_jax import shapes

    if not smoke:
        return shapes.glm53_flash()
    return shapes.glm53_flash(max_context=448, index_n_heads=3, index_head_dim=12,
                              index_topk=80)


def command(script: str, argv: list[str] | None = None) -> str:
    """How the script ran, as its results record it: `PYTHONPATH=. python3 benchmarks/<script>`
    and its arguments (`argv`, else the process's)."""
    return f"PYTHONPATH=. python3 benchmarks/{script} " + " ".join(
        sys.argv[1:] if argv is None else argv)


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def header(script: str, argv: list[str] | None = None, *, backend: bool = True) -> dict:
    """The results' first fields: command, date, jax_version, backend (unless not asked for),
    device (the first device's kind)."""
    import jax

    head = {"command": command(script, argv), "date": utc_now(), "jax_version": jax.__version__}
    if backend:
        head["backend"] = jax.default_backend()
    head["device"] = str(jax.devices()[0].device_kind)
    return head


def write_json(res: dict, path: str) -> None:
    """All of `res` to `path` (its folder made if missing), rewritten after each step so that a
    run cut short keeps what it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


def run_section(res: dict, name: str, fn: Callable[[], object]) -> None:
    """`fn()`, one section of a script: a failure is recorded in `res["errors"]` (section,
    error, traceback) and the script goes on with its other sections; the section's seconds go
    to `res["section_s"][name]`."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # recorded; the other sections still run
        res["errors"].append({"section": name, "error": f"{type(e).__name__}: {e}"[:500],
                              "traceback": traceback.format_exc()[-3000:]})
    res.setdefault("section_s", {})[name] = time.perf_counter() - t0
