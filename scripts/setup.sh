#!/usr/bin/env bash
# Installs what the project needs, once, into a virtualenv outside the checkout, then the project
# itself (editable: the venv gets the eagle3-* commands, running this checkout's code), and prints
# its python. Re-running it after a lock file or pyproject.toml changes, or from another checkout,
# reinstalls what changed; otherwise it returns at once.
#   bash scripts/setup.sh                 the main environment (SGLang 0.5.23, CPU)
#   bash scripts/setup.sh sglang-0.5.17   SGLang 0.5.17 overlaid on the main environment
#   EAGLE3_VENV  where the main virtualenv lives (default ~/.venvs/eagle3-extract)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
main_venv=${EAGLE3_VENV:-$HOME/.venvs/eagle3-extract}
overlay=${1:-}

install_locked() {  # venv lock [fallback-site-packages]
  local venv=$1 lock=$2 fallback=${3:-}
  local stamp="$venv/.installed-$(cat "$lock" | sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && return
  echo "setup: installing $(basename "$lock") into $venv (first time: a few minutes)" >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # --no-deps: SGLang's declared requirements pull ~11 GB of CUDA-only packages; the lock
  # holds exactly what its CPU path imports, so pip must not resolve anything on top.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$lock" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  if [ -n "$fallback" ]; then
    # Everything the overlay does not pin comes from the main environment, behind its own packages.
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$fallback" > "$site/zz_eagle3_main_environment.pth"
  fi
  rm -f "$venv"/.installed-*
  touch "$stamp"
}

install_project() {  # venv: this checkout, editable, without its dependencies (the lock holds them)
  local venv=$1
  local stamp="$venv/.project-$({ echo "$root"; cat "$root/pyproject.toml"; } | sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && [ -x "$venv/bin/eagle3-extract" ] && return
  echo "setup: installing the project from $root into $venv (editable)" >&2
  # --no-build-isolation: setuptools comes from the lock, so nothing is downloaded.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  rm -f "$venv"/.project-*
  touch "$stamp"
}

install_locked "$main_venv" "$root/requirements/cpu-lock.txt"
install_project "$main_venv"
case "$overlay" in
  "") echo "$main_venv/bin/python" ;;
  sglang-0.5.17)
    main_site=$("$main_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    install_locked "$main_venv-$overlay" "$root/requirements/$overlay-overlay.txt" "$main_site"
    echo "$main_venv-$overlay/bin/python" ;;
  *) echo "setup: unknown environment '$overlay' (known: sglang-0.5.17)" >&2; exit 2 ;;
esac
