"""The bench JSON: its version, the fields every point carries, number formatting, file I/O.

Schema 1 (unchanged since the first run, so every file in benchmarks/results/ stays readable):
a run is one JSON object with `schema_version`, `command`, `argv`, `smoke`, `date`, `machine`,
`jax_version`, `config`, `plan`, `ceilings`, `points`, `errors`, `skipped`, `levers`,
`baselines`, optional `breakdown` and `group_seconds`. A point has at least `POINT_KEYS`;
a timed point also `impl`, `time_over_floor`, `roofline`, `xla_us`, `ratio_vs_xla`, `hf_key`,
`hf_us`, `ratio_vs_hf`, `impls` (per implementation: `median_us`, `p10_us`, `p90_us`, ... or
`error`); a memory point `value_bytes` and `value_MiB`; a serving-loop point (group `loop`)
its time per token or step per layer as `median_us`, beside the figures benchmarks/loop.py
names (`LIFTED`). A run also records `commit` (the checkout's `git rev-parse --short HEAD`,
else its `--note`; runs before it have none).
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys

SCHEMA_VERSION = 1
POINT_KEYS = ("name", "median_us", "floor_us", "target", "met")
RATIO_KEYS = ("xla_us", "hf_us", "ratio_vs_xla", "ratio_vs_hf")


def fmt_us(us) -> str:
    """Microseconds as the tables show them: us below 1 ms, ms above; '-' for none."""
    if us is None:
        return "-"
    if us >= 10_000:
        return f"{us / 1000:.1f} ms"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} us"


def fmt_x(r, digits: int = 2) -> str:
    return "-" if r is None else f"{r:.{digits}f}x"


def ratio(a, b):
    """a / b, or None when either is missing or b is 0."""
    return None if a is None or b is None or b == 0 else a / b


def _number_or_none(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                         and math.isfinite(v))


def point_problems(point: dict) -> list[str]:
    """What a point lacks against the schema (empty: it is well formed)."""
    name = point.get("name", "?")
    out = [f"{name}: no {k!r}" for k in POINT_KEYS + RATIO_KEYS if k not in point]
    if not (isinstance(point.get("name"), str) and point.get("name")):
        out.append(f"{name}: name is not a non-empty string")
    if not (isinstance(point.get("target"), str) and point.get("target")):
        out.append(f"{name}: target is not a non-empty string")
    if not isinstance(point.get("met"), bool):
        out.append(f"{name}: met is not a bool")
    for k in ("median_us", "floor_us") + RATIO_KEYS:
        if not _number_or_none(point.get(k)):
            out.append(f"{name}: {k} = {point.get(k)!r} is not a finite number or null")
    return out


def result_problems(result: dict) -> list[str]:
    """What a run's JSON lacks against the schema (empty: it is well formed)."""
    out = [f"no {k!r}" for k in ("schema_version", "command", "date", "machine", "ceilings",
                                 "points") if k not in result]
    if result.get("schema_version") != SCHEMA_VERSION:
        out.append(f"schema_version {result.get('schema_version')!r}, expected "
                   f"{SCHEMA_VERSION}")
    for p in result.get("points", []):
        out += point_problems(p)
    return out


def json_default(o):
    """numpy scalars as Python numbers; anything else not JSON as its text."""
    item = getattr(o, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return str(o)


def write_json(path: str, obj) -> None:
    """Write `obj` to `path` through a temporary file, so a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=json_default)
    os.replace(tmp, path)


def load_runs(results_dir: str) -> list[tuple[str, dict]]:
    """Every bench run (a JSON object with a `points` list) in `results_dir`, by file name."""
    out = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"render: skipping {path}: {e}", file=sys.stderr)
            continue
        if isinstance(data, dict) and isinstance(data.get("points"), list):
            out.append((path, data))
    return out
