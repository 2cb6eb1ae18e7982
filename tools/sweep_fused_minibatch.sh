#!/usr/bin/env bash
# GPU machine: fused forward + fused backward per minibatch rows (both passes), 8192 tokens per rank.
#   SWEEP_PRESETS="deepseek-v3" MINIBATCH="1024 2048 4096" tools/sweep_fused_minibatch.sh
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 POUNCE_PEER_TIMEOUT_S=20
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}
for preset in $SWEEP_PRESETS; do
  for mb in $MINIBATCH; do
    line=$(timeout 120 ./build/pounce run --preset "$preset" --tokens 8192 --kernel fused --backward-kernel fused \
             --minibatch "$mb" --check-tokens 8 --iters 10 --wgrad-dtype bf16 2>&1)
    printf '%-14s minibatch %6s fwd %s fwd+bwd %s\n' "$preset" "$mb" "$(echo "$line" | awk '$1 == "forward" {print $2}')" \
      "$(echo "$line" | awk '$1 == "forward+backward" {print $2}')"
  done
done
