#!/usr/bin/env bash
# On a GPU machine without a package registry, after `python3 -m benchmarks.gpu.stage receive` put the
# carried files in place (docs/benchmarks.md lists the calls):
#
#   bash benchmarks/gpu/node.sh install WHEELHOUSE SITE [JIT_CACHE]   the wheelhouse's GPU lock into SITE, then
#        its acceptance lock (if built with --extra acceptance) leaving out what the image already has; a
#        JIT cache tarball (flashinfer, tvm-ffi, sglang, triton; made by save-jit-cache) unpacked into $HOME;
#        then an import check that prints the versions
#   bash benchmarks/gpu/node.sh run SITE BENCHMARK [ARGS...]           python3 -m benchmarks.BENCHMARK --device cuda
#        ARGS with SITE first on the path; its log and JSON go to $OUT, the output shows the machine and the
#        result table
#   bash benchmarks/gpu/node.sh start SITE ARGS...                     the acceptance benchmark with ARGS (--work DIR
#        ...) in a background process of its own session, every stage in order; returns at once (its log:
#        DIR/background/log.txt)
#   bash benchmarks/gpu/node.sh status SITE WORK [--wait-s S]          where that run stands (waiting up to S seconds
#        for it to end); its step records so far and log tail are copied into $OUT, its results once it ended
#   bash benchmarks/gpu/node.sh save-jit-cache FILE                    the warm JIT caches of $HOME into FILE, for
#        the next fresh machine (the first Kimi-K2.5 forward on a fresh H200 compiled for 428 s; 102 s with one);
#        over 15 MiB it is left in parts FILE.part-aa, -ab, ... (a call brings back files of at most 16 MiB):
#        `cat FILE.part-* > FILE` puts it together
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python3}
jit_dirs=(.cache/flashinfer .cache/tvm-ffi .cache/sglang .triton)

usage() {
  sed -n '5,20p' "$0" | sed 's/^# //' >&2
  exit 2
}

install() {
  local wheelhouse=${1:?} site=${2:?} jit_cache=${3:-}
  bash "$root/scripts/wheelhouse.sh" install "$wheelhouse" --target "$site" --python "$python" --lock gpu
  if [ -f "$wheelhouse/locks/acceptance.txt" ]; then
    bash "$root/scripts/wheelhouse.sh" install "$wheelhouse" --target "$site" --python "$python" --lock acceptance \
      --keep-installed
  fi
  # pip stamps every file it installs with the install's time, so the ninja builds behind flashinfer's and
  # tvm-ffi's JIT kernels would find each cached kernel older than the headers it was compiled from and
  # compile it again (2026-12-04: 118 s in the first CUDA graph, with the kernels in the cache). The site's
  # files get one old time instead: a cached kernel is then newer than its sources, as on the machine that built it.
  find "$site" -exec touch -h -d @946684800 {} +
  if [ -n "$jit_cache" ]; then
    tar xzf "$jit_cache" -C "$HOME"
    echo "node: JIT caches from $jit_cache in $HOME"
  fi
  PYTHONPATH=$site "$python" - "$wheelhouse" <<'EOF'
import importlib
import importlib.metadata as metadata
import pathlib
import sys

modules = ["torch", "sglang", "sgl_kernel", "flashinfer", "ray", "omegaconf", "gguf"]
if (pathlib.Path(sys.argv[1]) / "locks" / "acceptance.txt").is_file():
    modules += ["specforge.cli", "accelerate", "datasets"]
for module in modules:
    importlib.import_module(module)  # a failure names the module and what it missed
found = {}
for name in ("torch", "sglang", "sglang-kernel", "flashinfer-python", "transformers", "ray", "specforge"):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print("node:", found, "GPUs:", importlib.import_module("torch").cuda.device_count())
EOF
}

environment() {
  export PYTHONPATH=${1:?}:$root RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
}

machine() {
  echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs), $(nproc) CPUs," \
    "$(free -g | awk '/Mem:/ {print $2}') GiB RAM, /dev/shm $(df -h --output=size /dev/shm | tail -1 | xargs)," \
    "disk free $(df -h --output=avail "$root" | tail -1 | xargs)"
}

run() {
  local site=${1:?} benchmark=${2:?}
  shift 2
  local out=${OUT:?set OUT to the directory for the log and results}
  mkdir -p "$out"
  environment "$site"
  local name
  name="$benchmark-$(date +%H%M%S)"
  machine
  local status=0
  (cd "$root" && "$python" -m "benchmarks.$benchmark" --device cuda --out "$out/$name.json" "$@") \
    >"$out/$name.out" 2>"$out/$name.log" || status=$?
  tail -70 "$out/$name.out"
  [ "$status" -eq 0 ] || tail -60 "$out/$name.log"
  return "$status"
}

start() {
  local site=${1:?}
  shift
  environment "$site"
  machine
  (cd "$root" && "$python" -m benchmarks.acceptance.background start --device cuda "$@")
}

status() {
  local site=${1:?} work=${2:?}
  shift 2
  environment "$site"
  (cd "$root" && "$python" -m benchmarks.acceptance.background status --work "$work" ${OUT:+--collect "$OUT"} "$@")
}

save_jit_cache() {
  local file=${1:?} found=() dir
  for dir in "${jit_dirs[@]}"; do
    if [ -d "$HOME/$dir" ]; then found+=("$dir"); fi
  done
  [ ${#found[@]} -gt 0 ] || { echo "error: no JIT cache under $HOME yet: run a benchmark first" >&2; exit 1; }
  tar czf "$file" -C "$HOME" "${found[@]}"
  if [ "$(stat -c %s "$file")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15M "$file" "$file.part-"
    rm "$file"
    echo "node: the JIT caches are over 15 MiB: in parts; put them together with: cat $(basename "$file").part-* > $(basename "$file")"
    ls -la "$file".part-*
  else
    ls -la "$file"
  fi
}

case "${1:-}" in
  install) shift; install "$@" ;;
  run) shift; run "$@" ;;
  start) shift; start "$@" ;;
  status) shift; status "$@" ;;
  save-jit-cache) shift; save_jit_cache "$@" ;;
  *) usage ;;
esac
