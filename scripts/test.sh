#!/usr/bin/env bash
# Installs what is missing, then runs the test suite (real SGLang on CPU, real local Ray, real files).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bash scripts/setup.sh)
exec "$python" -m pytest "$@"
