#!/usr/bin/env bash
# Installs what is missing, then runs the test suite (real SGLang on CPU, real local Ray, real files).
#   bash scripts/test.sh           the suite CI runs: SGLang 0.5.23, then the release-sensitive tests on 0.5.17
#   bash scripts/test.sh --all     the same plus the tests marked `extended` (second real-process cases of
#                                  claims the suite already makes, benchmark smoke runs): about 10 minutes more
#   bash scripts/test.sh ARGS      pytest ARGS on the main environment only (no marker filter)
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bash scripts/setup.sh)
select=(-m "not extended")
if [ "${1:-}" = --all ]; then
  select=()
  shift
elif [ $# -gt 0 ]; then
  exec "$python" -m pytest "$@"
fi
# Two processes (pytest-xdist), each with its own Ray cluster, a test file per process at a time
# (module fixtures stay shared), the longest files first (tests/conftest.py orders them; xdist's own
# reorder, by the number of tests in a file, would undo that). Most of a test is an actor's start-up
# (SGLang's import alone is 12-15 s of one core); a third process only makes the two cores take turns.
parallel=(-n 2 --dist loadfile --no-loadscope-reorder)
EAGLE3_EXPECT_SGLANG=0.5.23 "$python" -m pytest "${parallel[@]}" "${select[@]}"
python_0517=$(bash scripts/setup.sh sglang-0.5.17)
# On 0.5.17, only the parts where the releases differ: the capture and final-state taps (parity
# with HF), the deepseek_v2 layer rule (its three cases), the Kimi-K2.5 wrapper (its states, its
# INT4 experts, the drafter check through it), SGLang's parser of a serving command, its JIT kernels
# built here for the H200 (benchmarks/gpu/jit_prebuild.py), the host copy's kernel compiled by its
# Triton. The rest runs on 0.5.23 above.
EAGLE3_EXPECT_SGLANG=0.5.17 exec "$python_0517" -m pytest "${parallel[@]}" \
  "tests/extractor/test_parity.py::test_aux_and_final_states_match_hf[llama-default]" \
  "tests/extractor/test_parity.py::test_aux_and_final_states_match_hf[qwen3-default]" \
  tests/extractor/test_parity.py::test_pre_norm_final_state_matches_hf \
  tests/extractor/test_deepseek.py::test_deepseek_matches_hf \
  tests/extractor/test_deepseek.py::test_deepseek_pre_norm_final_state_matches_hf \
  "tests/extractor/test_kimi.py::test_kimi_layout_stores_the_bare_models_states_bit_for_bit[1]" \
  tests/extractor/test_kimi.py::test_kimi_k25_reduced_shape_gets_sglangs_int4_moe_path \
  tests/extractor/test_kimi.py::test_check_drafter_through_the_wrapper \
  tests/extractor/test_serving.py::test_sglang_parses_the_command_and_refuses_what_it_refuses \
  tests/benchmarks/test_jit_prebuild.py \
  tests/extractor/test_host_copy.py::test_the_kernel_copy_compiles_for_the_h200
