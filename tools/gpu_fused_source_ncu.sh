#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: where the fused backward kernel's warps stall, per SASS
# instruction. Nsight Compute's warp-state sampling and source counters over one launch (one GPU, machine
# clocks), then the source page as CSV, reduced here to the header, the instructions with the most stall
# samples and the samples per opcode (tools/ncu_source_top.py). NCU_PRESET (gpt-oss-120b), NCU_KERNEL
# (fused_backward_kernel), NCU_TOP (60 instructions), NCU_REGIONS (LO-HI=LABEL words: SASS offset ranges to sum).
# The CSV comes back as $OUT/source.csv, so regions can also be summed here afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
export POUNCE_PEER_TIMEOUT_S=300  # replay passes slow every bounded wait down
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
kernel="${NCU_KERNEL:-fused_backward_kernel}"
report="$out/source_$kernel"
CUDA_VISIBLE_DEVICES=0 timeout 300 ncu --clock-control none -k "regex:$kernel" --launch-skip 2 --launch-count 1 \
  --section WarpStateStats --section SourceCounters -f -o "$report" ./build/pounce run \
  --preset "${NCU_PRESET:-gpt-oss-120b}" --tokens 8192 --ranks 1 --backward-kernel fused --iters 3 \
  --check-tokens 8 --wgrad-dtype bf16 >"$out/ncu_run.log" 2>&1
echo "ncu rc=$? ($(tail -1 "$out/ncu_run.log"))"
ncu -i "$report.ncu-rep" --page source --csv --print-source sass >"$out/source.csv" 2>"$out/source_err.log"
echo "source page rc=$? ($(wc -l <"$out/source.csv") lines) $(head -c 300 "$out/source_err.log")"
python3 tools/ncu_source_top.py "$out/source.csv" "${NCU_TOP:-60}" ${NCU_REGIONS:-}
