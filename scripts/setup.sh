#!/usr/bin/env bash
# Installs what the project needs, once, into a virtualenv outside the checkout, and prints
# its python. Re-running it after the lock file changes reinstalls; otherwise it returns at once.
#   EAGLE3_VENV  where the virtualenv lives (default ~/.venvs/eagle3-extract)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${EAGLE3_VENV:-$HOME/.venvs/eagle3-extract}
lock="$root/requirements/cpu-lock.txt"
stamp="$venv/.installed-$(sha256sum "$lock" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing the CPU stack into $venv (first time: a few minutes)" >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # --no-deps: SGLang's declared requirements pull ~11 GB of CUDA-only packages; the lock
  # holds exactly what its CPU path imports, so pip must not resolve anything on top.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$lock" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
echo "$venv/bin/python"
