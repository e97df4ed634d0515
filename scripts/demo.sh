#!/usr/bin/env bash
# Installs what is missing, then runs the extraction job on the embedded demo
# (tiny random model + synthetic data, local Ray on loopback). Extra key=value args pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bash scripts/setup.sh)
exec "$python" -m jobs.extract "$@"
