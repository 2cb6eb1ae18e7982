#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: an A/B of environment settings in one call. Optionally the gpu
# suite first (SUITE=1); then, for each setting in AB (space-separated NAME=VALUE words, "-" for none), the
# stage profile (POUNCE_PROFILE_STAGES=1, fwd + bwd, kernel times and the fused tile profile) of each preset in
# AB_PRESETS and, unless BENCH=0, the benchmark (--impl fused, 8192 tokens per rank, same-run baseline; JSON to
# $OUT). A setting --flag=value goes to the profile's command line instead (pounce run options), a setting
# @DIR runs the binary of another build folder (carried too: DIR/pounce, DIR/tests/pounce_gpu_tests). The
# settings alternate per preset, so drift in the GPUs' clocks spreads over both. SUITE_BUILDS lists the build
# folders whose gpu suite runs (SUITE=1: build), a folder twice for two runs. BENCH_PASS (all)
# and BENCH_ARGS (e.g. --no-baseline) go to the benchmark. A short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
summary=()
suite_builds="${SUITE_BUILDS:-}"
[ "${SUITE:-0}" = 1 ] && [ -z "$suite_builds" ] && suite_builds=build
run=0
for dir in $suite_builds; do
  run=$((run + 1))
  summary+=("gpu suite $dir: $(gpu_tests "$out/gpu_suite_${run}_$dir.log" 260 "./$dir/tests/pounce_gpu_tests")")
done
for preset in ${AB_PRESETS:-gpt-oss-120b deepseek-v3}; do
  for setting in ${AB:--}; do
    name="${preset}_${setting//[^A-Za-z0-9]/_}"
    env_args=() cli_args=() binary=./build/pounce
    case "$setting" in
      -) ;;
      @*) binary="./${setting#@}/pounce" ;;  # @DIR: another build's binary
      --*) IFS=, read -ra cli_args <<<"${setting/=/,}" ;;  # --flag=value: a command-line option
      *) env_args=("$setting") ;;
    esac
    env "${env_args[@]}" POUNCE_PROFILE_STAGES=1 timeout 120 "$binary" run --preset "$preset" --tokens 8192 \
      --check-tokens 8 --iters 2 --wgrad-dtype bf16 "${cli_args[@]}" >"$out/profile_$name.log" 2>&1
    summary+=("profile $preset $setting: rc=$? $(grep -E 'rank 0 (forward|backward):' "$out/profile_$name.log" |
      tail -2 | tr '\n' ' ')")
    [ "${BENCH:-1}" = 1 ] || continue
    env "${env_args[@]}" timeout 150 "$binary" bench --preset "$preset" --iters 10 --tokens 8192 --impl fused \
      --pass "${BENCH_PASS:-all}" ${BENCH_ARGS:-} --out "$out/bench_$name.json" \
      >"$out/bench_$name.log" 2>&1
    summary+=("bench $preset $setting: rc=$? $(grep -E '^fused ' "$out/bench_$name.log" | awk '{print $2, $7, $9}' |
      tr '\n' ' ')")
  done
done
for log in "$out"/profile_*.log; do
  echo "== $(basename "$log")"
  grep -E "rank 0" "$log" | grep -E "fused|tile|waited|forward:|backward:" | head -${PROFILE_LINES:-40}
done
printf '%s\n' "${summary[@]}"
exit 0
