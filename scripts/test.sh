#!/usr/bin/env bash
# Lint and the CPU test suite, on two pytest-xdist workers (a 2-core machine like CI: 23.5
# minutes against 27-31 in one process). Extra arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check dsa_jax tests benchmarks
exec .venv/bin/python -m pytest -q -n 2 --durations=15 "$@"
