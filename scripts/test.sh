#!/usr/bin/env bash
# Installs what is missing, then runs the test suite (real SGLang on CPU, real local Ray, real files).
# Without arguments it also runs the parity and Kimi-K2.5 tests on SGLang 0.5.17, the other supported release.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bash scripts/setup.sh)
if [ $# -gt 0 ]; then
  exec "$python" -m pytest "$@"
fi
EAGLE3_EXPECT_SGLANG=0.5.23 "$python" -m pytest
python_0517=$(bash scripts/setup.sh sglang-0.5.17)
EAGLE3_EXPECT_SGLANG=0.5.17 exec "$python_0517" -m pytest tests/test_parity.py tests/test_deepseek.py tests/test_kimi.py
