#!/usr/bin/env bash
# One GPU call (repo root, build folder carried): the gpu suite, the fused forward's inside profile, the
# benchmark with the same-run baseline (JSON + PNG to $OUT), the suite again, compute-sanitizer memcheck on the
# small fused case and the Python GPU tests; a short table last. Every step has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
summary=()
suite() {  # pass number
  summary+=("gpu suite pass $1: $(gpu_tests "$out/gpu_tests_$1.log" 150 "" --gtest_output="json:$out/gpu_tests_$1.json")")
}
suite 1
for preset in qwen3-30b-a3b deepseek-v3; do
  POUNCE_PROFILE_STAGES=1 timeout 60 ./build/pounce run --preset "$preset" --tokens 8192 --check-tokens 8 --iters 3 \
    --wgrad-dtype bf16 2>&1 | grep "profile rank 0 forward\|profile rank 0 fused forward inside" | tail -2
done
timeout "${BENCH_TIMEOUT_S:-220}" ./build/pounce bench --preset ${BENCH_PRESETS:-qwen3-30b-a3b gpt-oss-120b deepseek-v3} \
  --tokens 8192 --impl fused fused-staged --iters 10 --out "$out/bench_ep2.json" >"$out/bench.log" 2>&1
summary+=("bench rc=$?")
suite 2
SANITIZE_TOOLS="${SANITIZE_TOOLS:-memcheck}" SANITIZE_TIMEOUT_S=90 OUT="$out" tools/gpu_sanitize.sh \
  'FusedBackward.OneRankSmall' 2>&1 | tail -3
if [ -z "${SKIP_PYTHON:-}" ]; then
  OUT="$out/python" timeout 150 tests/python/run_gpu.sh install gpu 2>&1 | tail -4
fi
printf '%s\n' "${summary[@]}"
tail -16 "$out/bench.log"
