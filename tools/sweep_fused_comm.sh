#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: the fused forward + fused backward per communication-CTA
# count and combine (both passes take both settings), 8192 tokens per rank; backward = fwd+bwd - fwd.
#   SWEEP_PRESETS="deepseek-v3" COMBINES="scatter push" COMM_SMS="4 12 20" tools/sweep_fused_comm.sh
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 POUNCE_PEER_TIMEOUT_S=20
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}
for preset in $SWEEP_PRESETS; do
  for combine in $COMBINES; do
    for sms in $COMM_SMS; do
      line=$(POUNCE_FUSED_COMBINE=$combine timeout 120 ./build/pounce run --preset "$preset" --tokens 8192 \
               --kernel fused --backward-kernel fused --comm-sms "$sms" --check-tokens 8 --iters 10 \
               --wgrad-dtype bf16 2>&1)
      printf '%-14s %-8s comm %3s fwd %s fwd+bwd %s\n' "$preset" "$combine" "$sms" \
        "$(echo "$line" | awk '$1 == "forward" {print $2}')" "$(echo "$line" | awk '$1 == "forward+backward" {print $2}')"
    done
  done
done
