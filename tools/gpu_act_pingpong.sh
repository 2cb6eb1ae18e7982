#!/usr/bin/env bash
# Experiment call: ping-pong activation backward. Suite once, the GEMM bench's activation-backward cases (both
# schedules interleaved), then the layer fwd+bwd with POUNCE_ACTIVATION_BACKWARD_TILES alternating.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
timeout 200 ./build/tests/pounce_gpu_tests >/tmp/suite.log 2>&1; echo "suite rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|Failure" /tmp/suite.log | head -12
CUDA_VISIBLE_DEVICES=0 timeout 120 ./build/bench/pounce_gemm_bench "bwd act" 2>&1 | grep -E "^\| [a-z]"
for preset in gpt-oss-120b deepseek-v3 qwen3-30b-a3b; do
  rounds="cooperative pingpong cooperative pingpong"
  [ "$preset" = deepseek-v3 ] && rounds="cooperative pingpong"
  for tiles in $rounds; do
    r=$(POUNCE_ACTIVATION_BACKWARD_TILES=$tiles timeout 90 ./build/pounce run --preset $preset --tokens 8192 \
      --check-tokens 8 --iters 10 2>&1 | awk '$1 == "forward" || $1 == "forward+backward" {printf "%s %s  ", $1, $2} /error|FAIL/')
    echo "$preset $tiles: $r"
  done
done
