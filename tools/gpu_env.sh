# Sourced by the GPU-machine scripts (repo root): the environment every GPU run here needs. NVLink multicast
# stays off (FACTS.md), bounded waits give up after POUNCE_PEER_TIMEOUT_S (20 s unless set), and the NCCL and
# Python of the machine's PyTorch environment are found first.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export POUNCE_PEER_TIMEOUT_S="${POUNCE_PEER_TIMEOUT_S:-20}"
gpu_env_nccl_lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
[ -d "$gpu_env_nccl_lib" ] && export LD_LIBRARY_PATH="$gpu_env_nccl_lib:${LD_LIBRARY_PATH:-}"
[ -d /opt/torch/.venv/bin ] && export PATH="/opt/torch/.venv/bin:$PATH"
unset gpu_env_nccl_lib

# Runs a gpu test binary: gpu_tests LOG LIMIT_S [BINARY [gtest arguments...]] (BINARY defaults to
# ./build/tests/pounce_gpu_tests), output in LOG; prints the failures on stderr, then one line on stdout: the
# exit status and gtest's PASSED/FAILED/SKIPPED counts, for a script's summary.
gpu_tests() {
  local log=$1 limit=$2 binary=${3:-./build/tests/pounce_gpu_tests}
  shift $(($# < 3 ? $# : 3))
  timeout "$limit" "$binary" "$@" >"$log" 2>&1
  local rc=$?
  grep -E "^\[  FAILED|Failure" "$log" | head -12 >&2
  echo "rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$log" | tr '\n' ' ')"
}
