#!/usr/bin/env bash
# The sweep behind the overlap heuristic (src/gpu/overlap.h, docs/design.md "Overlap"): `pounce run` per
# preset over communication SMs x expert chunks (chunks = ceil(tokens * k / minibatch)), forward and
# backward medians. Run on the GPU machine from the repo root with the build folder carried:
#   tools/sweep_overlap.sh "qwen3-30b-a3b gpt-oss-120b" 8192 > sweep.txt
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nccl_lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
presets="${1:-qwen3-30b-a3b gpt-oss-120b}"
tokens="${2:-8192}"
comm_sms_list="${COMM_SMS:-8 16 20 32}"
chunk_list="${CHUNKS:-1 2 4 8}"
topk_of() { case "$1" in gpt-oss-120b) echo 4 ;; mixtral-8x7b) echo 2 ;; *) echo 8 ;; esac; }
printf '%-16s %8s %6s %10s %10s %10s\n' preset comm_sms chunks forward_ms backward_ms total_ms
for preset in $presets; do
  k=$(topk_of "$preset")
  for chunks in $chunk_list; do
    minibatch=$(( (tokens * k + chunks - 1) / chunks ))
    minibatch=$(( (minibatch + 127) / 128 * 128 ))
    for sms in $comm_sms_list; do
      line=$(./build/pounce run --preset "$preset" --tokens "$tokens" --comm-sms "$sms" --minibatch "$minibatch" \
               --check-tokens 8 --iters 10 --wgrad-dtype bf16 2>&1)
      fwd=$(echo "$line" | awk '$1 == "forward" {print $2}')
      bwd=$(echo "$line" | awk '$1 == "backward" {print $2}')
      tot=$(echo "$line" | awk '$1 == "forward+backward" {print $2}')
      printf '%-16s %8s %6s %10s %10s %10s\n' "$preset" "$sms" "$chunks" "$fwd" "$bwd" "$tot"
    done
  done
done
