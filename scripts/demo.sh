#!/usr/bin/env bash
# The main job on the shipped "tiny" config (dsa_jax/configs/tiny.json). Extra arguments go to dsa-jax.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "scripts/demo.sh [OPTIONS]: the demo is \`dsa-jax run\` on the tiny config; its options:"
  exec .venv/bin/dsa-jax run --help
fi
exec .venv/bin/dsa-jax "$@"
