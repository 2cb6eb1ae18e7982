#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: the fused-kernel tests, then `pounce run` forward and
# forward+backward medians of the fused and the staged path per preset (no baseline: quick A/B).
#   tools/gpu_fused_check.sh [gtest filter] [presets] [tokens]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export POUNCE_PEER_TIMEOUT_S="${POUNCE_PEER_TIMEOUT_S:-20}"
nccl_lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
filter="${1:-FusedForward.*:StagedForward.*}"
presets="${2:-qwen3-30b-a3b gpt-oss-120b deepseek-v3}"
tokens="${3:-8192}"
if [ -n "$filter" ]; then
  timeout 300 ./build/tests/pounce_gpu_tests --gtest_filter="$filter" > /tmp/gtest.log 2>&1
  echo "gtest rc=$?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|error|Expected|Which is|differ" /tmp/gtest.log | head -40
fi
printf '%-16s %-7s %10s %10s\n' preset kernel forward_ms fwd+bwd_ms
for preset in $presets; do
  for kernel in fused staged; do
    line=$(timeout 120 ./build/pounce run --preset "$preset" --tokens "$tokens" --kernel "$kernel" \
             --backward-kernel "$kernel" --check-tokens 8 --iters 10 --wgrad-dtype bf16 2>&1)
    fwd=$(echo "$line" | awk '$1 == "forward" {print $2}')
    tot=$(echo "$line" | awk '$1 == "forward+backward" {print $2}')
    printf '%-16s %-7s %10s %10s\n' "$preset" "$kernel" "$fwd" "$tot"
    [ -z "$fwd" ] && echo "$line" | tail -5
  done
done
# COMM_SMS="8 16 24": the fused forward per communication-CTA count (and MINIBATCH rows, default heuristic).
for preset in ${SWEEP_PRESETS:-}; do
  for sms in ${COMM_SMS:-}; do
    for mb in ${MINIBATCH:-0}; do
      line=$(timeout 120 ./build/pounce run --preset "$preset" --tokens "$tokens" --kernel fused --comm-sms "$sms" \
               --minibatch "$mb" --check-tokens 8 --iters 10 --wgrad-dtype bf16 2>&1)
      printf '%-16s comm %3s mb %6s forward %s\n' "$preset" "$sms" "$mb" "$(echo "$line" | awk '$1 == "forward" {print $2}')"
    done
  done
done
# PROFILE_PRESETS: per-stage ms of one fused forward (POUNCE_PROFILE_STAGES, rank 0).
for preset in ${PROFILE_PRESETS:-}; do
  POUNCE_PROFILE_STAGES=1 timeout 120 ./build/pounce run --preset "$preset" --tokens "$tokens" --kernel fused \
    --check-tokens 8 --iters 3 --wgrad-dtype bf16 2>&1 | grep "profile rank 0 forward" | tail -3
done
