#!/usr/bin/env bash
# Lint and the CPU test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check dsa_jax tests benchmarks
exec .venv/bin/python -m pytest -q --durations=15 "$@"
