#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: the small one-rank cases under compute-sanitizer (issue #5:
# "compute-sanitizer clean on a small shape"): memcheck, racecheck and synccheck over the fused forward and
# backward kernels and the stage kernels. Prints one line per tool; exit status non-zero on any finding.
#   tools/gpu_sanitize.sh [gtest filter]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export POUNCE_PEER_TIMEOUT_S="${POUNCE_PEER_TIMEOUT_S:-300}"  # the tools slow every spin-wait down
nccl_lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$sanitizer" ] || { echo "no compute-sanitizer on this machine"; exit 1; }
filter="${1:-FusedBackward.OneRankSmall:FusedBackward.OneRankSmallRoutedOnly:StagedForward.OneRankSmall}"
out="${OUT:-/tmp}"
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  timeout "${SANITIZE_TIMEOUT_S:-150}" "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 20 \
    ./build/tests/pounce_gpu_tests --gtest_filter="$filter" > "$out/sanitize_$tool.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  echo "$tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) ' "$out/sanitize_$tool.log" | tr '\n' ' ')"
done
exit $status
