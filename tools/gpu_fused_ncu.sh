#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: Nsight Compute (machine clocks) on the fused kernels themselves,
# one GPU (a cross-GPU barrier inside a kernel would not survive ncu's serialised replay): the SM clock, tensor
# pipe, L2 and DRAM traffic and the main stalls of one fused forward and one fused backward launch per preset in
# NCU_PRESETS. The question it answers: do the fused tiles run at the intake/power ceiling of the standalone
# GEMMs (docs/design.md "The ceiling"), or at a lower rate inside the kernel (gpt-oss's gate/up tiles take
# 36 us where 45 K blocks of 48 KB at 45 B/clk need ~25 us at 1.98 GHz)?
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
export POUNCE_PEER_TIMEOUT_S=300  # replay passes slow every bounded wait down
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio
for preset in ${NCU_PRESETS:-gpt-oss-120b deepseek-v3}; do
  for kernel in fused_forward_kernel fused_backward_kernel; do
    echo "== ncu $preset $kernel"
    CUDA_VISIBLE_DEVICES=0 timeout 240 ncu --clock-control none -k "regex:$kernel" --launch-skip 2 --launch-count 1 \
      --metrics $M ./build/pounce run --preset "$preset" --tokens 8192 --ranks 1 --backward-kernel fused \
      --iters 3 --check-tokens 8 --wgrad-dtype bf16 2>&1 | grep -E "^\s+(gpu__|sm__|lts__|dram__|l1tex__|smsp__)" |
      awk '{print $1, $(NF)}'
  done
done
