#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: where the grouped GEMMs' time goes, from Nsight Compute. For
# each gemm_bench case in NCU_CASES (';'-separated), one launch (the fifth: past the warm-up) is profiled with
# the speed-of-light, compute, memory and warp-state sections at the machine's own clocks; the lines that say
# where the time goes are printed, the whole reports go to $OUT. Then the stage profile of PROFILE_PRESETS.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
IFS=';' read -ra cases <<<"${NCU_CASES:-deepseek-v3 routed wgrad;deepseek-v3 routed bwd act;deepseek-v3 routed gate_up}"
i=0
for c in "${cases[@]}"; do
  i=$((i + 1))
  timeout 240 ncu --clock-control none --launch-skip 4 --launch-count 1 --kernel-name regex:grouped_gemm \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section InstructionStats \
    ./build/bench/pounce_gemm_bench "$c" >"$out/ncu_$i.txt" 2>&1
  echo "== $c rc=$?"
  grep -E "^\| |Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Issue Slots Busy|Executed Ipc Active|Stall|Warp Cycles Per Issued|Registers Per|Tensor|Pipe" "$out/ncu_$i.txt" | head -40
done
ncu --query-metrics 2>/dev/null | grep -i -E "gmma|tensor_op" | head -20
for preset in ${PROFILE_PRESETS:-}; do
  POUNCE_PROFILE_STAGES=1 timeout 120 ./build/pounce run --preset "$preset" --tokens 8192 --kernel fused \
    --backward-kernel staged --check-tokens 8 --iters 3 --wgrad-dtype bf16 >"$out/profile_$preset.log" 2>&1
  echo "== $preset rc=$?"
  grep -E "rank 0" "$out/profile_$preset.log" | tail -4
done
