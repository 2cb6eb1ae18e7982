#!/usr/bin/env bash
# Nsight Compute (machine clocks) on the weight-gradient and activation-backward GEMMs: what holds them.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,l1tex__m_l1tex2xbar_write_bytes.sum.per_second,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio
run() {  # case filter, kernel regex
  echo "== ncu $1 / $2"
  timeout 120 ncu --clock-control none -k "regex:$2" --launch-skip 3 --launch-count 1 --metrics $M \
    ./build/bench/pounce_gemm_bench "$1" 2>&1 | grep -E "^\s+(gpu__|sm__|lts__|dram__|l1tex__|smsp__)" | awk '{print $1, $(NF)}'
}
run "gpt-oss-120b routed wgrad" weight_grad_pingpong
run "gpt-oss-120b routed wgrad" "grouped_gemm_kernel"
run "deepseek-v3 routed wgrad" weight_grad_pingpong
run "gpt-oss-120b routed bwd act" activation_backward_pingpong
run "gpt-oss-120b bwd d_x" "grouped_gemm_kernel"
