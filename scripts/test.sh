#!/usr/bin/env bash
# Lint and the CPU test suite, on two pytest-xdist workers (CI's machine has 2 cores).
# `worksteal`: an idle worker takes queued tests from the other, so the few minute-long tests
# do not leave one worker waiting at the end.
# The default suite is CI's (every guarantee on tiny shapes, every kernel against its twin, HF
# parity, the notebook, the wheel, the CLI); `--long` adds the tests marked long (layer-level
# interpret-mode runs, mesh sweeps, the soak, full property runs). Extra arguments go to
# pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check dsa_jax tests benchmarks
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=15 "$@"
