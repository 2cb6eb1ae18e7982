#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: the macrobatch ring in one call. The gpu suite (ring tests
# included), the ring tests again (determinism across processes), memcheck on the smallest ring case, then
# forward and backward time with and without a ring (the smallest: ranks x tokens rows) on the presets.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 POUNCE_PEER_TIMEOUT_S=20
nccl_lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
summary=()
timeout 200 ./build/tests/pounce_gpu_tests >"$out/gpu_tests.log" 2>&1
summary+=("gpu suite: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/gpu_tests.log" | tr '\n' ' ')")
grep -E "^\[  FAILED|Failure|error" "$out/gpu_tests.log" | head -20
timeout 100 ./build/tests/pounce_gpu_tests --gtest_filter='*Macrobatch*' >"$out/ring_tests.log" 2>&1
summary+=("ring tests again: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/ring_tests.log" | tr '\n' ' ')")
# One GPU: the sanitizers see NCCL's own start-up probes as API errors on several ranks.
CUDA_VISIBLE_DEVICES=0 SANITIZE_TOOLS="memcheck racecheck" SANITIZE_TIMEOUT_S=150 OUT="$out" \
  tools/gpu_sanitize.sh 'FusedBackward.OneRankSmallRing' 2>&1 | tail -2
[ "${RING_PERF:-1}" = 1 ] || { printf '%s\n' "${summary[@]}"; exit 0; }
tokens=8192
ring=$((2 * tokens))
for preset in ${RING_PRESETS:-qwen3-30b-a3b deepseek-v3}; do
  for kernel in fused staged; do
    for macrobatch in 0 $ring; do
      line=$(timeout 90 ./build/pounce run --preset "$preset" --tokens $tokens --kernel $kernel \
        --backward-kernel $kernel --macrobatch $macrobatch --check-tokens 8 --iters 5 --wgrad-dtype bf16 2>&1 |
        awk '$1 == "forward" && NF == 5 {f=$2} $1 == "backward" && NF == 5 {b=$2} /PASS|FAIL/ {v=$0}
             END {printf "forward %s ms, backward %s ms | %s", f, b, substr(v, 1, 60)}')
      summary+=("$preset $kernel macrobatch=$macrobatch: $line")
    done
  done
done
printf '%s\n' "${summary[@]}"
