#!/usr/bin/env bash
# Creates .venv (if missing) and installs dsa_jax into it, with the extras named in $1 (e.g. "test").
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
