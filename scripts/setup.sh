#!/usr/bin/env bash
# Installs the locked packages the project needs, once, into a virtualenv outside the checkout, shared
# by every checkout; then this checkout's own thin virtualenv, .venv/ in it, which sees the shared
# packages behind its own and holds this checkout, editable (the eagle3-* commands, running this
# checkout's code); prints that python. Two checkouts never touch each other's .venv, and neither
# writes the project into the shared one. Re-running it after a lock file or pyproject.toml changes
# reinstalls what changed; otherwise it returns at once. Setups run one at a time (a lock beside the shared
# virtualenv). With .venv activated, `pip` is its own.
#   bash scripts/setup.sh                 the main environment (SGLang 0.5.23, CPU)
#   bash scripts/setup.sh sglang-0.5.17   SGLang 0.5.17 overlaid on the main environment
#   EAGLE3_VENV  where the shared virtualenv lives (default ~/.venvs/eagle3-extract)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
main_venv=${EAGLE3_VENV:-$HOME/.venvs/eagle3-extract}
overlay=${1:-}

site_of() {  # venv -> its site-packages
  "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

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
    echo "$fallback" > "$(site_of "$venv")/zz_eagle3_main_environment.pth"
  fi
  rm -f "$venv"/.installed-*
  touch "$stamp"
}

install_checkout() {  # this checkout's .venv: the shared packages behind it, the project editable in it
  local venv=$root/.venv shared_site
  shared_site=$(site_of "$main_venv")
  local stamp="$venv/.project-$({ echo "$root"; echo "$shared_site"; ls "$main_venv"/.installed-*;
    cat "$root/pyproject.toml"; } | sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && [ -x "$venv/bin/eagle3-extract" ] && [ -x "$venv/bin/pip" ] && return
  echo "setup: installing the project from $root into $venv (editable)" >&2
  [ -x "$venv/bin/python" ] || "$main_venv/bin/python" -m venv --without-pip "$venv"
  echo "$shared_site" > "$(site_of "$venv")/zz_eagle3_shared_environment.pth"
  # pip and setuptools come from the shared packages (--no-build-isolation): nothing is downloaded.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory\|^Not uninstalling\|^Can't uninstall" || true; } >&2
  # The shared environment's commands (ray, pytest, ...) beside this one's python, as in any virtualenv.
  local command
  for command in "$main_venv"/bin/*; do
    [ -f "$command" ] && [ -x "$command" ] || continue
    case "$(basename "$command")" in activate*|python*|pip*|eagle3-*) continue ;; esac
    [ -e "$venv/bin/$(basename "$command")" ] || ln -s "$command" "$venv/bin/"
  done
  # pip of this virtualenv (pip's own code is the shared one's): with it activated, `pip` installs here.
  for command in pip pip3; do
    printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n' > "$venv/bin/$command"
    chmod +x "$venv/bin/$command"
  done
  rm -f "$venv"/.project-*
  touch "$stamp"
}

# One setup at a time on this machine (two demos started at once): the second waits, then finds it all done.
mkdir -p "$(dirname "$main_venv")"
exec 9>"$main_venv.setup-lock"
flock -n 9 || { echo "setup: waiting for another setup (scripts/setup.sh) to finish" >&2; flock 9; }
install_locked "$main_venv" "$root/requirements/cpu-lock.txt"
install_checkout
case "$overlay" in
  "") echo "$root/.venv/bin/python" ;;
  sglang-0.5.17)
    install_locked "$main_venv-$overlay" "$root/requirements/$overlay-overlay.txt" "$(site_of "$main_venv")"
    echo "$main_venv-$overlay/bin/python" ;;
  *) echo "setup: unknown environment '$overlay' (known: sglang-0.5.17)" >&2; exit 2 ;;
esac
