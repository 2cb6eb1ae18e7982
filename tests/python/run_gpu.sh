#!/usr/bin/env bash
# The Python side on a GPU machine, in one call: build and install the module offline, run the Python
# tests (CPU backend with torch, then the GPU tests under torchrun), train the example. Logs and the
# example's JSON/PNG go to $OUT (default /tmp/pounce_python). Steps: any of install cpu gpu train
# (default: all, in that order); NPROC ranks (default: every GPU, at most 2 for the example's figure).
#
#   tests/python/run_gpu.sh                  # everything
#   tests/python/run_gpu.sh install gpu      # rebuild, GPU tests only
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
venv=/opt/torch/.venv
[ -d "$venv/bin" ] && export PATH="$venv/bin:$PATH"
nccl_lib=$(python3 -c 'import glob, site; print(next(iter(glob.glob(site.getsitepackages()[0] + "/nvidia/nccl/lib")), ""))')
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/pounce_python}"
mkdir -p "$out"
nproc_gpus="${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(install cpu gpu train)
summary=()

run_step() {  # name, log, command...
  local name=$1 log=$2
  shift 2
  local start=$SECONDS
  "$@" >"$out/$log" 2>&1
  local rc=$?
  summary+=("$name: rc=$rc ($((SECONDS - start)) s) $(grep -E '(passed|failed|error)' "$out/$log" | tail -1)")
  [ $rc -ne 0 ] && tail -40 "$out/$log"
  return $rc
}

for step in "${steps[@]}"; do
  case "$step" in
    install)
      run_step install pip.log python3 -m pip install -v --no-build-isolation --no-deps . || break
      python3 -c 'import pounce; print("pounce", pounce.build_info())' | tee -a "$out/pip.log"
      ;;
    cpu)
      run_step "cpu tests" cpu_tests.log python3 -m pytest -q -rs -p no:cacheprovider tests/python \
        --ignore=tests/python/test_torch_gpu.py
      ;;
    gpu)
      run_step "gpu tests (${nproc_gpus} ranks)" gpu_tests.log torchrun --nproc-per-node="$nproc_gpus" \
        -m pytest -q -rs -p no:cacheprovider tests/python/test_torch_gpu.py
      ;;
    train)
      run_step "train_moe (${nproc_gpus} ranks)" train.log torchrun --nproc-per-node="$nproc_gpus" \
        examples/train_moe.py --steps 300 --out "$out"
      tail -3 "$out/train.log"
      ;;
    *) echo "unknown step '$step' (install cpu gpu train)" >&2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
