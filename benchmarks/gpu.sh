#!/usr/bin/env bash
# Runs benchmarks on a lent GPU machine through the device tool. First stage SGLang 0.5.17 + Ray
# there with ../shared/gpu/prepare-carry.sh (four back-to-back calls), then, carrying [".whl"]
# (omegaconf + antlr4 wheels for the machine's python 3.12):
#   bash benchmarks/gpu.sh throughput --shape llama8b --samples 384 --memory-dir /dev/shm --fp8 --set extract.last_hidden_state=none
#   bash benchmarks/gpu.sh tp_compare --shape small --tp-size 2
#   bash benchmarks/gpu.sh acceptance --work /root/acceptance --gguf /root/acccache/SmolLM2-135M-Instruct.Q4_1.gguf
#     (after benchmarks/acceptance_carry.sh's folders, which also bring omegaconf: no .whl needed)
# Each run's full log and JSON go to $OUT; the output shows the machine and the result table.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/root/sglsite:$PWD RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
if [ "${1:-}" = acceptance ] && [ ! -f /root/sglsite/.acceptance-installed ]; then
  echo "stage SpecForge and SmolLM2 first: bash benchmarks/acceptance_carry.sh prepare prints the calls"; exit 1
fi
[ -d /root/sglsite/omegaconf ] || python3 -m pip install -q --no-index --no-deps --target /root/sglsite .whl/*.whl
out=${OUT:-/tmp/eagle3-bench}
mkdir -p "$out"
benchmark=$1
shift
name="$benchmark-$(date +%H%M%S)"
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs), $(nproc) CPUs," \
  "$(free -g | awk '/Mem:/ {print $2}') GiB RAM, /dev/shm $(df -h --output=size /dev/shm | tail -1 | xargs)," \
  "disk free $(df -h --output=avail . | tail -1 | xargs)"
status=0
python3 -m "benchmarks.$benchmark" --device cuda --out "$out/$name.json" "$@" >"$out/$name.out" 2>"$out/$name.log" \
  || status=$?
tail -40 "$out/$name.out"
[ "$status" -eq 0 ] || tail -60 "$out/$name.log"
exit "$status"
