#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: where the time of the GEMM-bound presets goes. Optionally the
# gpu tests named by TESTS (a gtest filter) first; then the standalone GEMM bench (cases matching each word of
# GEMM_FILTERS, full grid) and the stage profile (POUNCE_PROFILE_STAGES=1) of forward and backward for the
# presets in PROFILE_PRESETS and the kernel paths in PROFILE_KERNELS. Logs to $OUT; the results last.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
if [ -n "${TESTS:-}" ]; then
  timeout 300 ./build/tests/pounce_gpu_tests --gtest_filter="$TESTS" >"$out/tests.log" 2>&1
  echo "== tests rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure|error" "$out/tests.log" | head -20
fi
for filter in ${GEMM_FILTERS:-ep2 gpt-oss qwen3}; do
  timeout 150 ./build/bench/pounce_gemm_bench "$filter" | grep -v "^| case" >>"$out/gemm_bench.txt" 2>&1
done
for preset in ${PROFILE_PRESETS:-deepseek-v3 gpt-oss-120b}; do
  for kernel in ${PROFILE_KERNELS:-fused staged}; do
    POUNCE_PROFILE_STAGES=1 timeout 120 ./build/pounce run --preset "$preset" --tokens 8192 --kernel "$kernel" \
      --backward-kernel "$kernel" --check-tokens 8 --iters ${PROFILE_ITERS:-3} --wgrad-dtype bf16 \
      >"$out/profile_${preset}_${kernel}.log" 2>&1
    echo "== $preset $kernel rc=$?"
    grep -E "rank 0|^forward|^backward|PASS|FAIL" "$out/profile_${preset}_${kernel}.log" | tail -${PROFILE_LINES:-6}
  done
done
cat "$out/gemm_bench.txt"
