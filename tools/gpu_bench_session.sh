#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: the closing call of a session. The whole gpu suite (its 4- and
# 8-rank cases run where that many GPUs are visible), then the benchmark on every visible GPU against the
# same-run PyTorch baseline (EP = the GPU count, 8192 tokens per rank, forward and forward+backward, both
# backward paths: JSON + PNG to $OUT, named bench_ep<N>), then, while the call's time allows (DEADLINE_S, 540
# unless set; BENCH_TIMEOUT_S bounds the first benchmark, 240 s), the forward at 16384 tokens per rank and on
# one GPU (where there are more). SUITE_RUNS runs the suite that many times (1), SANITIZE=1 adds
# tools/gpu_sanitize.sh after it. A short table last. On nvidia-h200-x4 / -x8 this is issue #7's call as it
# stands.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
start=$(date +%s)
left() { echo $(( ${DEADLINE_S:-540} - ($(date +%s) - start) )); }
ranks=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
summary=("GPUs: $ranks")
presets="${BENCH_PRESETS:-qwen3-30b-a3b gpt-oss-120b deepseek-v3}"
for run in $(seq "${SUITE_RUNS:-1}"); do
  summary+=("gpu suite run $run: $(gpu_tests "$out/gpu_suite_$run.log" 260)")
done
if [ "${SANITIZE:-0}" = 1 ]; then
  OUT="$out" tools/gpu_sanitize.sh >"$out/sanitize.txt" 2>&1
  summary+=("compute-sanitizer (small one-rank cases): rc=$? $(tr '\n' ' ' <"$out/sanitize.txt")")
fi
bench() {  # name, timeout, extra arguments
  local name=$1 limit=$2
  shift 2
  timeout "$limit" ./build/pounce bench --preset $presets --iters 10 --out "$out/$name.json" "$@" \
    >"$out/$name.log" 2>&1
  summary+=("$name: rc=$?")
}
bench "bench_ep$ranks" "${BENCH_TIMEOUT_S:-240}" --tokens 8192 --impl fused fused-staged
[ "$(left)" -gt 100 ] && bench "bench_ep${ranks}_16384_forward" 95 --tokens 16384 --impl fused --pass forward
[ "$ranks" -gt 1 ] && [ "$(left)" -gt 70 ] &&
  CUDA_VISIBLE_DEVICES=0 bench bench_ep1_forward 65 --ranks 1 --tokens 8192 --impl fused --pass forward
for log in "$out"/bench_*.log; do
  echo "== $(basename "$log")"
  grep -E "^(impl|fused|fused-all|fused-staged|staged|baseline) " "$log"
done
printf '%s\n' "${summary[@]}"  # last: the tool shows the tail of the output
exit 0
