#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: the fused forward's tests and an A/B against the staged path
# with the kernel's inside profile; when the fused forward is not slower than FUSED_MAX_QWEN3_MS on qwen3,
# also the whole suite twice, the Python GPU tests and the benchmark with the same-run baseline (JSON + PNG
# to $OUT). Prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 POUNCE_PEER_TIMEOUT_S=20
nccl_lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
[ -d /opt/torch/.venv/bin ] && export PATH="/opt/torch/.venv/bin:$PATH"
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
timeout 200 ./build/tests/pounce_gpu_tests \
  --gtest_filter='FusedForward.*:StagedForward.CudaGraph*:StagedForward.Missing*:StagedForward.OutOfRange*' \
  > "$out/fused_tests.log" 2>&1
echo "fused tests rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$out/fused_tests.log" | tr '\n' ' ')"
for preset in qwen3-30b-a3b deepseek-v3; do
  POUNCE_PROFILE_STAGES=1 timeout 120 ./build/pounce run --preset "$preset" --tokens 8192 --check-tokens 8 \
    --iters 3 --wgrad-dtype bf16 2>&1 | grep "profile rank 0 fused forward inside" | tail -2
done
tools/gpu_fused_check.sh "" "qwen3-30b-a3b gpt-oss-120b deepseek-v3" 2>&1 | tee "$out/ab.txt"
qwen3=$(awk '$1 == "qwen3-30b-a3b" && $2 == "fused" {print $3}' "$out/ab.txt")
if awk -v t="${qwen3:-99}" -v m="${FUSED_MAX_QWEN3_MS:-1.6}" 'BEGIN {exit !(t <= m)}'; then
  tools/gpu_session.sh 2>&1 | tail -3
  tests/python/run_gpu.sh install gpu 2>&1 | tail -4
  ./build/pounce bench --preset qwen3-30b-a3b gpt-oss-120b deepseek-v3 --tokens 8192 --impl fused fused-all \
    --iters 10 --out "$out/bench_ep2.json" > "$out/bench.log" 2>&1
  echo "bench rc=$?"
  tail -22 "$out/bench.log"
else
  echo "fused qwen3 forward ${qwen3:-?} ms > ${FUSED_MAX_QWEN3_MS:-1.6}: suite and benchmark skipped"
fi
