#!/usr/bin/env bash
# Creates .venv (if missing) and installs dsa_jax into it, with the extras named in $1 (e.g.
# "test"). Skips pip when the venv is current: the same pyproject.toml and extras as at its
# last install (a stamp in .venv), the package installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv and installing dsa_jax${extras:+[$extras]} (first run: a few minutes)"
  python3 -m venv .venv
fi
stamp=.venv/.dsa_jax-setup  # "<pyproject hash> <extras>" of the last install
hash=$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ]; then
  read -r had_hash had_extras < "$stamp" || true
  # the same pyproject.toml, and the extras asked for installed then (none asked: any)
  if [ "$had_hash" = "$hash" ] && { [ -z "$extras" ] || [ "${had_extras:-}" = "$extras" ]; } \
      && (cd / && "$OLDPWD/.venv/bin/python" -c "import importlib.util as u, sys
sys.exit(u.find_spec('dsa_jax') is None)") 2>/dev/null; then
    exit 0
  fi
fi
want="$hash $extras"
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
echo "setup: pip install -e '$spec' into .venv: jax, flax, orbax, matplotlib${extras:+ and the extras} (a minute or two where they download) ..."
start=$SECONDS
# --no-compile: pip would byte-compile every installed file (torch's thousands: half the
# install's time); Python compiles the modules a run imports, once, as it imports them.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e "$spec"
echo "setup: installed in $((SECONDS - start)) s"
echo "$want" > "$stamp"
