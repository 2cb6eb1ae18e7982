#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: the CTA-pair GEMM experiment (pair_gemm_kernel.cuh) in one
# call. The pair test, then the grouped GEMM bench and the staged forward (which calls the standalone GEMMs)
# with and without POUNCE_GEMM_PAIRS=1.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
POUNCE_TEST_GEMM_PAIRS=1 timeout 120 ./build/tests/pounce_gpu_tests --gtest_filter='GroupedGemm*:GroupedGateUp*' 2>&1 |
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|differ" | head -20
for pairs in 0 1; do
  echo "== POUNCE_GEMM_PAIRS=$pairs"
  POUNCE_GEMM_PAIRS=$pairs timeout 120 ./build/bench/pounce_gemm_bench 2>&1 | grep -E "gate_up|down|case" | head -12
  for preset in deepseek-v3 gpt-oss-120b qwen3-30b-a3b; do
    echo "$preset staged forward $(POUNCE_GEMM_PAIRS=$pairs timeout 60 ./build/pounce run --preset $preset \
      --tokens 8192 --kernel staged --check-tokens 8 --iters 10 2>&1 | awk '$1 == "forward" {print $2}') ms"
  done
done
