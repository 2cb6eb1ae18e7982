#!/usr/bin/env bash
# Launch the PyTorch expert-parallel MoE baseline (torch_moe.py) on NPROC GPUs of this host
# (default: every visible GPU). All arguments go to torch_moe.py, e.g.
#   bench/baselines/run_baseline.sh --check
#   bench/baselines/run_baseline.sh --preset qwen3-30b-a3b,deepseek-v3 --tokens 8192 --json out.json
# Environment: NPROC (ranks), PYTHON (interpreter; default python3 — tools/gpu_env.sh puts the GPU
# machine's torch first on PATH), POUNCE_COMMIT (recorded when the tree has no git metadata).
set -euo pipefail
cd "$(dirname "$0")/../.."

# NVLink SHARP / multicast stay off (Pounce never uses NVLink multicast).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"

PY="${PYTHON:-python3}"
if [ -z "${NPROC:-}" ]; then
  NPROC="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
  [ "${NPROC:-0}" -ge 1 ] || NPROC=1
fi
if [ -z "${POUNCE_COMMIT:-}" ]; then
  POUNCE_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
fi
export POUNCE_COMMIT

exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
  bench/baselines/torch_moe.py "$@"
