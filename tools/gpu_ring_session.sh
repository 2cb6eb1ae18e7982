#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: the macrobatch ring in one call. The ring tests first (fast
# signal), memcheck and racecheck on the smallest ring case, the whole gpu suite, forward and backward time
# with and without a ring (the smallest: ranks x tokens rows) on the presets, and with BENCH=1 the benchmark
# against the same-run PyTorch baseline (JSON + PNG to $OUT). A short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
summary=()
tests() {  # name, timeout, gtest filter
  summary+=("$1: $(gpu_tests "$out/$1.log" "$2" "" --gtest_filter="$3")")
}
tests ring_tests 150 '*Macrobatch*:*Ring*:StagedBackward.CudaGraph*'
# One GPU: the sanitizers see NCCL's own start-up probes as API errors on several ranks.
CUDA_VISIBLE_DEVICES=0 SANITIZE_TOOLS="memcheck racecheck" SANITIZE_TIMEOUT_S=150 OUT="$out" \
  tools/gpu_sanitize.sh 'FusedBackward.OneRankSmallRing' 2>&1 | tail -2
tests gpu_suite 200 '*'
if [ "${RING_PERF:-1}" = 1 ]; then
  tokens=8192
  ring=$((2 * tokens))
  for preset in ${RING_PRESETS:-qwen3-30b-a3b deepseek-v3}; do
    for kernel in ${RING_KERNELS:-fused staged}; do
      for macrobatch in 0 $ring; do
        line=$(timeout 90 ./build/pounce run --preset "$preset" --tokens $tokens --kernel $kernel \
          --backward-kernel $kernel --macrobatch $macrobatch --check-tokens 8 --iters 5 --wgrad-dtype bf16 2>&1 |
          awk '$1 == "forward" && NF == 5 {f=$2} $1 == "backward" && NF == 5 {b=$2} /PASS|FAIL/ {v=$0}
               END {printf "forward %s ms, backward %s ms | %s", f, b, substr(v, 1, 60)}')
        summary+=("$preset $kernel macrobatch=$macrobatch: $line")
      done
    done
  done
fi
if [ "${BENCH:-0}" = 1 ]; then
  timeout "${BENCH_TIMEOUT_S:-220}" ./build/pounce bench --preset ${BENCH_PRESETS:-qwen3-30b-a3b gpt-oss-120b deepseek-v3} \
    --tokens 8192 --impl fused fused-staged --iters 10 --out "$out/bench_ep2.json" >"$out/bench.log" 2>&1
  summary+=("bench rc=$?")
fi
printf '%s\n' "${summary[@]}"
[ "${BENCH:-0}" = 1 ] && tail -16 "$out/bench.log"
exit 0
