#!/usr/bin/env bash
# An offline install for GPU nodes that cannot reach a package registry: build a wheelhouse where the
# registry is reachable, for the node's Python and platform; carry the directory to the node; install
# it there with --no-index (pip reads only the wheelhouse).
#
#   bash scripts/wheelhouse.sh build --python 3.12 --platform manylinux_2_28_x86_64 [--extra NAME]... DIR
#   bash scripts/wheelhouse.sh install DIR [--target SITE] [--python PYTHON] [--lock NAME]... [--keep-installed]
#
# --extra gpu (the default) is requirements/gpu-lock.txt: SGLang 0.5.17, its kernels, Ray and the job's
# config library on a node whose image has python, torch and the scientific stack; --extra acceptance
# adds requirements/gpu-acceptance-lock.txt (SpecForge and what the acceptance benchmark trains with).
# --platform is the newest manylinux tag the node's glibc runs (`ldd --version` there: glibc 2.28 ->
# manylinux_2_28_x86_64); the wheels may be built for it or any older tag. Every lock pins exact
# versions and is installed with --no-deps: pip resolves nothing on the node, the image's torch stays.
#
# DIR gets the wheels, locks/NAME.txt (the locks it was built from), SHA256SUMS and wheelhouse.txt (the
# python and platform). install checks the checksums and the node's python version first, then
# installs the locks (all, or those --lock names) into PYTHON's environment or, with --target, into the
# directory SITE (put it first on PYTHONPATH). --keep-installed leaves out every package PYTHON (with
# SITE on its path) already has, whatever its version: the node's own packages win.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

usage() {
  sed -n '6,7p' "$0" | sed 's/^# //' >&2
  exit 2
}

die() {
  echo "error: $*" >&2
  exit 2
}

lock_file() {  # extra -> the lock that holds it
  case $1 in
    gpu) echo "$root/requirements/gpu-lock.txt" ;;
    acceptance) echo "$root/requirements/gpu-acceptance-lock.txt" ;;
    *) die "unknown --extra '$1' (known: gpu, acceptance)" ;;
  esac
}

platform_args() {  # manylinux_2_28_x86_64 -> --platform for it and every older manylinux tag
  local tag=$1 minor arch m
  if [[ $tag =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    minor=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]}
    for ((m = minor; m >= 5; m--)); do echo "--platform=manylinux_2_${m}_$arch"; done
    if [ "$minor" -ge 17 ]; then echo "--platform=manylinux2014_$arch"; fi
    if [ "$minor" -ge 12 ]; then echo "--platform=manylinux2010_$arch"; fi
    echo "--platform=manylinux1_$arch"
  else
    echo "--platform=$tag"
  fi
}

requirements() {  # lock file -> its requirement lines
  grep -vE '^\s*(#|$)' "$1"
}

build() {
  local python_version="" platform="" dir="" extras=()
  while [ $# -gt 0 ]; do
    case $1 in
      --python) python_version=${2:?}; shift 2 ;;
      --platform) platform=${2:?}; shift 2 ;;
      --extra) extras+=("${2:?}"); shift 2 ;;
      -*) usage ;;
      *) [ -z "$dir" ] || usage; dir=$1; shift ;;
    esac
  done
  [ -n "$python_version" ] && [ -n "$platform" ] && [ -n "$dir" ] || usage
  [[ $python_version =~ ^3\.[0-9]+$ ]] || die "--python $python_version: give the node's MAJOR.MINOR, e.g. 3.12"
  [ ${#extras[@]} -gt 0 ] || extras=(gpu)
  mkdir -p "$dir/locks"
  local extra lock platforms started=$SECONDS
  mapfile -t platforms < <(platform_args "$platform")
  for extra in "${extras[@]}"; do
    lock=$(lock_file "$extra")
    echo "wheelhouse: downloading $(requirements "$lock" | wc -l) pinned wheels of $(basename "$lock") for" \
      "python $python_version, $platform" >&2
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$python_version" --implementation cp "${platforms[@]}" -d "$dir" -r "$lock"
    cp "$lock" "$dir/locks/$extra.txt"
  done
  printf 'python=%s\nplatform=%s\nlocks=%s\n' "$python_version" "$platform" "$(cd "$dir/locks" && ls | sed 's/\.txt$//' | xargs)" \
    > "$dir/wheelhouse.txt"
  (cd "$dir" && sha256sum -- *.whl > SHA256SUMS)
  echo "wheelhouse: $dir holds $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1)," \
    "built in $((SECONDS - started)) s; on the node: bash scripts/wheelhouse.sh install DIR" >&2
}

install() {
  local dir="" target="" python=python3 keep=0 locks=()
  while [ $# -gt 0 ]; do
    case $1 in
      --target) target=${2:?}; shift 2 ;;
      --python) python=${2:?}; shift 2 ;;
      --lock) locks+=("${2:?}"); shift 2 ;;
      --keep-installed) keep=1; shift ;;
      -*) usage ;;
      *) [ -z "$dir" ] || usage; dir=$1; shift ;;
    esac
  done
  [ -n "$dir" ] || usage
  [ -f "$dir/wheelhouse.txt" ] || die "$dir is not a wheelhouse (no wheelhouse.txt): build one with scripts/wheelhouse.sh build"
  (cd "$dir" && sha256sum --quiet -c SHA256SUMS) || die "$dir: a wheel does not match SHA256SUMS; carry the wheelhouse again"
  local built node
  built=$(sed -n 's/^python=//p' "$dir/wheelhouse.txt")
  node=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$built" = "$node" ] || die "$dir was built for python $built but $python is $node: build it with --python $node"
  if [ ${#locks[@]} -eq 0 ]; then
    mapfile -t locks < <(cd "$dir/locks" && ls | sed 's/\.txt$//')
  fi
  local pythonpath=${PYTHONPATH:-}
  if [ -n "$target" ]; then
    mkdir -p "$target"
    target=$(cd "$target" && pwd)
    pythonpath=$target${pythonpath:+:$pythonpath}
  fi
  local lock wanted=() line name
  for lock in "${locks[@]}"; do
    [ -f "$dir/locks/$lock.txt" ] || die "$dir has no lock '$lock' (it has: $(sed -n 's/^locks=//p' "$dir/wheelhouse.txt"))"
    while read -r line; do
      name=${line%%==*}
      if [ "$keep" = 1 ] && PYTHONPATH=$pythonpath "$python" -c \
          "import importlib.metadata, sys; importlib.metadata.version(sys.argv[1])" "$name" 2>/dev/null; then
        echo "wheelhouse: keeping the installed $name" >&2
        continue
      fi
      wanted+=("$line")
    done < <(requirements "$dir/locks/$lock.txt")
  done
  [ ${#wanted[@]} -gt 0 ] || { echo "wheelhouse: nothing to install" >&2; return 0; }
  local into=()
  if [ -n "$target" ]; then into=(--upgrade --target "$target"); fi
  echo "wheelhouse: installing ${#wanted[@]} packages from $dir into ${target:-the environment of $python}" >&2
  # --no-compile: the first import writes the bytecode it needs; compiling all of SGLang here costs minutes.
  "$python" -m pip install -q --disable-pip-version-check --no-index --find-links "$dir" --no-deps --no-compile \
    --no-cache-dir "${into[@]}" "${wanted[@]}" 2>&1 | { grep -v "Target directory .* already exists" || true; } >&2
}

case "${1:-}" in
  build) shift; build "$@" ;;
  install) shift; install "$@" ;;
  *) usage ;;
esac
