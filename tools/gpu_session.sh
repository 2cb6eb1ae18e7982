#!/usr/bin/env bash
# One call on the GPU machine: build what is missing (the carried build folder usually has it), run the
# gpu tests twice, the benchmark, and print a short table last. Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nccl_lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
[ -d /opt/torch/.venv/bin ] && export PATH="/opt/torch/.venv/bin:$PATH"
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
build="${POUNCE_BUILD_DIR:-build}"

tests="$build/tests/pounce_gpu_tests"
if [ ! -x "$tests" ]; then
  echo "no $tests: build on the CPU machine (./tools/setup.sh) and carry the build folder" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpus.txt"

summary=()
for pass in 1 2; do
  "$tests" --gtest_output="json:$out/gpu_tests_$pass.json" ${POUNCE_GTEST_FILTER:+--gtest_filter=$POUNCE_GTEST_FILTER} \
    >"$out/gpu_tests_$pass.log" 2>&1
  rc=$?
  summary+=("gpu tests pass $pass: rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/gpu_tests_$pass.log" | tr '\n' ' ')")
done
grep -E "FAILED|Failure|error" "$out/gpu_tests_1.log" | head -30
if [ -n "${POUNCE_BENCH_ARGS:-}" ]; then
  "$build/pounce" bench $POUNCE_BENCH_ARGS --out "$out/bench.json" >"$out/bench.log" 2>&1
  summary+=("bench rc=$?")
  tail -25 "$out/bench.log"
fi
printf '%s\n' "${summary[@]}"
