#!/usr/bin/env bash
# The main job on the shipped "tiny" config (dsa_jax/configs/tiny.json). Extra arguments go to dsa-jax.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dsa-jax "$@"
