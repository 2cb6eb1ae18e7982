# shellcheck shell=bash
# Sourced by tools/gpu.sh: the environment of every run on the GPU machine, and the one place that names that
# machine's paths. Its PyTorch environment (python3, torchrun, pytest, cmake, ninja) comes first on PATH, and
# its NCCL 2.28.9 first on LD_LIBRARY_PATH: the device code is compiled against that version's headers
# (docs/design.md). NVLink multicast stays off; a bounded wait on a peer gives up after POUNCE_PEER_TIMEOUT_S.
gpu_env_venv=/opt/torch/.venv
gpu_env_nccl=$gpu_env_venv/lib/python3.12/site-packages/nvidia/nccl

export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export POUNCE_PEER_TIMEOUT_S="${POUNCE_PEER_TIMEOUT_S:-20}"
export PYTHONUNBUFFERED=1
if [ -d "$gpu_env_venv/bin" ]; then
  export PATH="$gpu_env_venv/bin:$PATH"
fi
if [ -d "$gpu_env_nccl/lib" ]; then
  export LD_LIBRARY_PATH="$gpu_env_nccl/lib:${LD_LIBRARY_PATH:-}"
  export POUNCE_NCCL_ROOT="${POUNCE_NCCL_ROOT:-$gpu_env_nccl}"  # what setup.py and a build here link against
fi
if [ -d /usr/local/cuda/bin ]; then
  export PATH="$PATH:/usr/local/cuda/bin"  # nvcc, compute-sanitizer, ncu
fi
unset gpu_env_venv gpu_env_nccl
