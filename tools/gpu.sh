#!/usr/bin/env bash
# The one entry point for the GPU machine's jobs: tools/gpu.sh <job> [options] (`tools/gpu.sh help` lists them),
# run there from the repository root with the build folder carried. The environment is tools/gpu_env.sh's;
# the binaries are $POUNCE_BUILD_DIR's (build unless set). Every step's log and JSON go to $OUT
# (/tmp/pounce_out unless set), named after the step; every summary is computed from that JSON (gtest's
# --gtest_output, pounce's --json and --out records) by tools/gpu_report.py, never from the text logs, and a
# table of the steps comes last, as the device tool shows the end of the output.
# shellcheck source-path=SCRIPTDIR/..
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
. tools/gpu_env.sh
out="${OUT:-/tmp/pounce_out}"
build="${POUNCE_BUILD_DIR:-build}"
presets=(qwen3-30b-a3b gpt-oss-120b deepseek-v3)
run_id="$(date +%s)-$$"  # tells this call's steps from earlier ones in $out/steps.jsonl
deadline=0               # epoch seconds every step must end by; 0: none
failed=0
num_gpus=0

usage() {
  cat <<'EOF'
tools/gpu.sh <job> [options]        on the GPU machine; logs and JSON in $OUT (/tmp/pounce_out)
  suite [N] [gtest args]            the gpu gtest binary N times (2), each with --gtest_output=json; the
                                    pass/fail and bitwise-check summary and whether the runs agree
  bench [pounce bench args]         pounce bench, records in $OUT/bench.json
  ab A B [--rounds N] [-- bench args]
                                    pounce bench in alternating processes (A B, then B A, N rounds, 2) of two
                                    settings, each a word list: NAME=VALUE words are the environment, @DIR
                                    runs DIR/pounce (another build folder, carried too), other words are
                                    pounce bench arguments, '-' nothing; B/A time ratios from the records
  profile [PRESET...] [-- run args] pounce run under POUNCE_PROFILE_STAGES=1 per preset, output kept
  ncu [fused [PRESET...] | source [PRESET [KERNEL]] | gemm [CASE...]]
                                    Nsight Compute on one GPU: metrics of the fused kernels (default) or of
                                    pounce_gemm_bench cases' GEMMs (fp8:CASE for an FP8 one), or the warp-stall samples per SASS
                                    instruction of one fused kernel; read from ncu's CSV by tools/ncu_top.py
  sanitize [FILTER] [--tools LIST] [--limit S]
                                    compute-sanitizer (memcheck racecheck synccheck initcheck) on the one-GPU
                                    suite's cases; racecheck one small case per kernel family
                                    (S seconds per tool, 240)
  python [install] [cpu] [gpu] [train]
                                    pip install offline (--no-build-isolation), the Python tests, the GPU
                                    ones under torchrun on >1 GPU, examples/train_moe.py (default: all)
  close [--deadline S] [-- bench args]
                                    a session's closing call: build what $POUNCE_BUILD_DIR lacks, suite
                                    twice, pounce bench on every visible GPU for the three presets at 8192
                                    tokens per rank, all within S seconds (560)
  help                              this list
EOF
}

die() {
  echo "gpu.sh: $*" >&2
  exit 2
}

# ---- shared helpers -------------------------------------------------------------------------------------

need_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 ||
    die "no nvidia-smi here: the jobs run on the GPU machine (the device tool's run), not on this one"
  num_gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  [ "$num_gpus" -gt 0 ] || die "nvidia-smi sees no GPU here"
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,power.limit --format=csv >"$out/gpus.csv" 2>&1
}

have_binary() {
  [ -x "$1" ] && return 0
  echo "gpu.sh: no $1: build on the CPU machine (tools/setup.sh) and carry the build folder (tools/gpu.sh" \
    "close builds what is missing with the GPU image's tools: see its build logs)"
  failed=1
  return 1
}

need_binary() {
  have_binary "$1" || exit 2
}

# has_opt OPTION ARGS...: whether ARGS hold OPTION (alone or as OPTION=VALUE).
has_opt() {
  local option=$1 arg
  shift
  for arg; do
    [[ "$arg" == "$option" || "$arg" == "$option="* ]] && return 0
  done
  return 1
}

record() {  # NAME RC SECONDS LIMIT: one line of $out/steps.jsonl (RC null: not run)
  printf '{"run": "%s", "name": "%s", "rc": %s, "seconds": %d, "limit_s": %d}\n' "$run_id" "$1" "$2" "$3" "$4" \
    >>"$out/steps.jsonl"
}

# step NAME LIMIT_S COMMAND...: runs COMMAND within LIMIT_S (and the deadline), output in $out/NAME.log; the
# command writes its JSON, if any, to $out/NAME.json (or pytest XML to $out/NAME.xml, NAME_rank<R>.xml).
step() {
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if [ "$deadline" -gt 0 ]; then
    local left=$((deadline - $(date +%s) - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 30 ]; then
      echo "gpu.sh: $name skipped: the deadline is too close"
      record "$name" null 0 0
      failed=1
      return 125
    fi
  fi
  rm -f "$out/$name.log" "$out/$name.json" "$out/$name.xml" "$out/$name"_rank*.xml
  echo "gpu.sh: $name (at most $limit s): $(printf '%q ' "$@")"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  record "$name" "$rc" "$((SECONDS - start))" "$limit"
  if [ "$rc" -ne 0 ]; then
    failed=1
    echo "gpu.sh: $name: exit status $rc; the end of $name.log:"
    tail -n 15 "$out/$name.log"
  fi
  return "$rc"
}

# bench_step NAME LIMIT_S [pounce bench args]: pounce bench (the binary $bench_bin, the environment words
# $bench_env), its records in $out/NAME.json.
bench_env=()
bench_bin=""
ab_args=()
bench_step() {
  local name=$1 limit=$2
  shift 2
  has_opt --out "$@" && die "gpu.sh writes the records to \$OUT/<step>.json: leave --out out"
  local prefix=()
  [ ${#bench_env[@]} -gt 0 ] && prefix=(env "${bench_env[@]}")
  step "$name" "$limit" "${prefix[@]}" "${bench_bin:-$build/pounce}" bench "$@" --out "$out/$name.json"
}

report() {
  python3 tools/gpu_report.py "$@"
}

# suite RUNS LIMIT_S [gtest args]: the gpu tests RUNS times, then what their JSON reports say.
suite() {
  local runs=$1 limit=$2 i
  shift 2
  local reports=()
  for i in $(seq "$runs"); do
    step "suite_$i" "$limit" "$build/tests/pounce_gpu_tests" --gtest_output="json:$out/suite_$i.json" "$@"
    reports+=("$out/suite_$i.json")
  done
  report gtest "${reports[@]}"
}

# ---- jobs -----------------------------------------------------------------------------------------------

job_suite() {  # [N] [gtest args]
  local runs=2
  if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
    runs=$1
    shift
  fi
  need_gpu
  need_binary "$build/tests/pounce_gpu_tests"
  suite "$runs" 300 "$@"
}

job_bench() {  # [pounce bench args]
  need_gpu
  need_binary "$build/pounce"
  bench_step bench 590 "$@"
  report bench "$out/bench.json"
}

# ab_setting SETTING: bench_env, bench_bin and ab_args from a setting's words.
ab_setting() {
  local words word
  read -ra words <<<"$1"
  bench_env=() bench_bin="$build/pounce" ab_args=()
  for word in "${words[@]}"; do
    case "$word" in
      -) ;;
      @*) bench_bin="${word#@}/pounce" ;;
      [A-Za-z_]*=*) bench_env+=("$word") ;;
      *) ab_args+=("$word") ;;
    esac
  done
}

job_ab() {  # A B [--rounds N] [-- pounce bench args]
  [ $# -ge 2 ] || die "ab needs two settings: tools/gpu.sh ab 'A' 'B' [--rounds N] [-- pounce bench args]"
  local a=$1 b=$2 rounds=2 round side setting
  shift 2
  while [ $# -gt 0 ]; do
    case "$1" in
      --rounds) rounds=${2:?--rounds needs a number}; shift 2 ;;
      --) shift; break ;;
      *) die "ab: unknown option '$1' (bench arguments go after --)" ;;
    esac
  done
  local args=("$@")
  has_opt --preset "${args[@]}" || args+=(--preset "${presets[@]}")
  has_opt --tokens "${args[@]}" || args+=(--tokens 8192)
  has_opt --iters "${args[@]}" || args+=(--iters 10)
  has_opt --no-baseline "${args[@]}" || args+=(--no-baseline)
  has_opt --plot-script "${args[@]}" || args+=(--plot-script "")
  need_gpu
  for setting in "$a" "$b"; do
    ab_setting "$setting"
    need_binary "$bench_bin"
  done
  for round in $(seq "$rounds"); do
    local order=(A B)
    [ $((round % 2)) -eq 0 ] && order=(B A)  # A B B A ...: a drift in the clocks weighs on both alike
    for side in "${order[@]}"; do
      if [ "$side" = A ]; then ab_setting "$a"; else ab_setting "$b"; fi
      bench_step "ab_r${round}_$side" 300 "${ab_args[@]}" "${args[@]}"
    done
  done
  bench_env=() bench_bin=""
  report ab "$out" "$a" "$b"
}

job_profile() {  # [PRESET...] [-- pounce run args]
  local chosen=() preset
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    chosen+=("$1")
    shift
  done
  [ "${1:-}" = -- ] && shift
  [ ${#chosen[@]} -eq 0 ] && chosen=("${presets[@]}")
  local args=("$@")
  has_opt --tokens "${args[@]}" || args+=(--tokens 8192)
  has_opt --check-tokens "${args[@]}" || args+=(--check-tokens 8)
  has_opt --iters "${args[@]}" || args+=(--iters 3)
  has_opt --wgrad-dtype "${args[@]}" || args+=(--wgrad-dtype bf16)
  need_gpu
  need_binary "$build/pounce"
  local reports=()
  for preset in "${chosen[@]}"; do
    step "profile_$preset" 180 env POUNCE_PROFILE_STAGES=1 "$build/pounce" run --preset "$preset" "${args[@]}" \
      --json "$out/profile_$preset.json"
    reports+=("$out/profile_$preset.json")
  done
  echo "the stage and tile profiles (stderr of each run) are in $out/profile_<preset>.log"
  report run "${reports[@]}"
}

# What ncu collects per kernel launch: time and clock, the tensor pipe, L2 and DRAM traffic, the main stalls.
ncu_metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,l1tex__m_l1tex2xbar_write_bytes.sum.per_second,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio

# ncu_step NAME KERNEL_REGEX LAUNCH_SKIP PAGE [ncu options] -- COMMAND...: one launch of the kernel
# profiled, the report in $out/NAME.ncu-rep and its PAGE (raw: the metrics; source: per SASS instruction) as
# CSV in $out/NAME.csv.
ncu_step() {
  local name=$1 kernel=$2 skip=$3 page=$4
  shift 4
  local options=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    options+=("$1")
    shift
  done
  shift
  step "$name" 300 ncu --clock-control none -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
    "${options[@]}" -f -o "$out/$name" "$@" || return
  local print=()
  [ "$page" = source ] && print=(--print-source sass)
  ncu -i "$out/$name.ncu-rep" --page "$page" --csv "${print[@]}" >"$out/$name.csv" 2>>"$out/$name.log"
}

job_ncu() {  # [fused [PRESET...] | source [PRESET [KERNEL]] | gemm [CASE...]]
  local what=${1:-fused} i
  [ $# -gt 0 ] && shift
  need_gpu
  command -v ncu >/dev/null 2>&1 || die "no ncu (Nsight Compute) on this machine"
  # One GPU: a cross-GPU barrier inside a kernel would not survive ncu's serialised replay; the replay passes
  # slow every bounded wait down.
  export CUDA_VISIBLE_DEVICES=0 POUNCE_PEER_TIMEOUT_S=300
  local run=("$build/pounce" run --tokens 8192 --ranks 1 --backward-kernel fused --iters 3 --check-tokens 8
    --wgrad-dtype bf16)
  local csvs=()
  case "$what" in
    fused)
      need_binary "$build/pounce"
      local chosen=("$@") preset kernel
      [ ${#chosen[@]} -eq 0 ] && chosen=(gpt-oss-120b deepseek-v3)
      for preset in "${chosen[@]}"; do
        for kernel in fused_forward_kernel fused_backward_kernel; do
          ncu_step "ncu_${preset}_${kernel%_kernel}" "$kernel" 2 raw --metrics "$ncu_metrics" -- \
            "${run[@]}" --preset "$preset"
          csvs+=("$out/ncu_${preset}_${kernel%_kernel}.csv")
        done
      done
      python3 tools/ncu_top.py metrics --only "$ncu_metrics" "${csvs[@]}"
      ;;
    source)
      need_binary "$build/pounce"
      local preset=${1:-gpt-oss-120b} kernel=${2:-fused_backward_kernel}
      ncu_step ncu_source "$kernel" 2 source --section WarpStateStats --section SourceCounters -- \
        "${run[@]}" --preset "$preset"
      python3 tools/ncu_top.py source "$out/ncu_source.csv" 60
      ;;
    gemm)
      need_binary "$build/bench/pounce_gemm_bench"
      local cases=("$@")
      [ ${#cases[@]} -eq 0 ] && cases=("deepseek-v3 routed wgrad" "deepseek-v3 routed bwd act" "deepseek-v3 routed gate_up")
      for i in "${!cases[@]}"; do
        echo "ncu_gemm_$i: ${cases[$i]}"
        # fp8:NAME is an FP8 case of `pounce_gemm_bench --fp8` (its bf16 twin's launches are not profiled).
        local bench_args=("${cases[$i]}") kernels="grouped_gemm|weight_grad|activation_backward"
        if [[ ${cases[$i]} == fp8:* ]]; then
          bench_args=(--fp8 "${cases[$i]#fp8:}")
          kernels="fp8_grouped_gemm"
        fi
        ncu_step "ncu_gemm_$i" "$kernels" 4 raw --metrics "$ncu_metrics" -- \
          "$build/bench/pounce_gemm_bench" "${bench_args[@]}"
        csvs+=("$out/ncu_gemm_$i.csv")
      done
      python3 tools/ncu_top.py metrics --only "$ncu_metrics" "${csvs[@]}"
      ;;
    *) die "ncu: '$what' is none of fused, source, gemm" ;;
  esac
}

# The one-GPU suite under compute-sanitizer's four tools. Left out: the tests that need two GPUs (they skip
# anyway), the injected-fault and timeout tests (their failures are the point, and the tools slow every
# spin-wait past its bound), the largest shapes and all but one shard of the fuzz (the same kernels run on
# the smaller ones; racecheck multiplies a kernel's time many times). POUNCE_SANITIZE_FILTER or a FILTER
# argument replaces the default.
sanitize_filter='-*TwoRanks*:*FourAndEight*:Faults.MissingPeer*:Faults.RanksDisagreeing*'
sanitize_filter+=':Faults.InjectedFailure*:*LargeTopEight*:GroupedGemm.ManyGroupsMoreTilesThanSms'
sanitize_filter+=':ProcessGroup.*:FusedForward.EqualsStagedBitwise:FusedBackward.EqualsStagedBitwise'
for shard in 1 2 3 4 5; do  # the fuzz's first shard: 20 cases
  sanitize_filter+=":Shards/GpuFuzz.FusedEqualsStagedAndReference/$shard"
done

# racecheck runs a kernel some hundred times slower (a small staged backward test: 55 s, against 0.1 s), so it
# takes one small case of each kernel family: staged and fused forward and backward, the ring, every
# standalone GEMM kind in BF16 and FP8, the quantizers, the finish kernel's NaN fill.
racecheck_filter='StagedForward.OneRankSmall:FusedBackward.OneRankSmall:FusedBackward.OneRankSmallRing'
racecheck_filter+=':GroupedGemm.EmptyGroupsEdgeTileAndPoisonedTail:GroupedGateUp.SwiGLUClampEdgeTileEmptyGroup'
racecheck_filter+=':GroupedActivationBackward.SwiGLUPartialTileEmptyGroup:GroupedGemmTransposed.KSplitOverTwoTensorsPartialTile'
racecheck_filter+=':GroupedWeightGrad.OneCtaTakesTurnsOverUnevenTiles:Fp8GroupedGemm.PairSumsBothKRanges'
racecheck_filter+=':Fp8GroupedGateUp.SwiGluWithAPartialScaleBlock:Fp8GroupedWeightGrad.StoreF32'
racecheck_filter+=':Fp8Quantize.LaneGroupRowsMatchTheCpu:Fp8Quantize.TokenAxisColumnsMatchTheCpu'
racecheck_filter+=':Faults.FailingCallsLeaveNaNInEveryOutput'

job_sanitize() {  # [FILTER] [--tools LIST] [--limit S]
  local filter=${POUNCE_SANITIZE_FILTER:-} tool_filter
  local tools="memcheck racecheck synccheck initcheck" tool limit=240
  while [ $# -gt 0 ]; do
    case "$1" in
      --tools) tools=${2:?--tools needs a list}; shift 2 ;;
      --limit) limit=${2:?--limit needs seconds}; shift 2 ;;
      *) filter=$1; shift ;;
    esac
  done
  need_gpu
  need_binary "$build/tests/pounce_gpu_tests"
  command -v compute-sanitizer >/dev/null 2>&1 || die "no compute-sanitizer on this machine"
  # One GPU: on several ranks the sanitizers take NCCL's own start-up probes for API errors; the tools slow
  # every spin-wait down.
  export CUDA_VISIBLE_DEVICES=0 POUNCE_PEER_TIMEOUT_S=300
  local reports=()
  for tool in $tools; do
    tool_filter=$filter
    if [ -z "$tool_filter" ]; then
      tool_filter=$sanitize_filter
      [ "$tool" = racecheck ] && tool_filter=$racecheck_filter
    fi
    step "sanitize_$tool" "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
      "$build/tests/pounce_gpu_tests" --gtest_filter="$tool_filter" \
      --gtest_output="json:$out/sanitize_$tool.json"
    reports+=("$out/sanitize_$tool.json")
  done
  report gtest "${reports[@]}"
}

job_python() {  # [install] [cpu] [gpu] [train]
  local parts=("$@") part
  [ ${#parts[@]} -eq 0 ] && parts=(install cpu gpu train)
  need_gpu
  local pytest=(python3 -m pytest -q -rs -p no:cacheprovider)
  for part in "${parts[@]}"; do
    case "$part" in
      install)
        # setup.py reads POUNCE_BUILD_DIR as its own build folder: it must not build into the carried one.
        step python_install 480 env -u POUNCE_BUILD_DIR python3 -m pip install -v --no-build-isolation --no-deps . ||
          break
        step python_import 60 python3 -c 'import pounce; print("pounce", pounce.build_info())'
        ;;
      cpu)
        step python_cpu 300 "${pytest[@]}" --junitxml="$out/python_cpu.xml" tests/python \
          --ignore=tests/python/test_torch_gpu.py
        ;;
      gpu)
        if [ "$num_gpus" -gt 1 ]; then
          # shellcheck disable=SC2016  # expanded by each rank's shell: its own RANK
          step python_gpu 300 torchrun --no-python --nproc-per-node="$num_gpus" bash -c \
            'exec "${@:2}" --junitxml="$1/python_gpu_rank$RANK.xml" tests/python/test_torch_gpu.py' \
            rank "$out" "${pytest[@]}"
        else
          step python_gpu 300 "${pytest[@]}" --junitxml="$out/python_gpu_rank0.xml" tests/python/test_torch_gpu.py
        fi
        ;;
      train)
        step train_moe 300 torchrun --nproc-per-node="$((num_gpus < 2 ? num_gpus : 2))" examples/train_moe.py \
          --steps 300 --out "$out"
        ;;
      *) die "python: unknown part '$part' (install cpu gpu train)" ;;
    esac
  done
}

# build_missing: the binaries the build folder lacks, built here with the image's nvcc, cmake and ninja.
build_missing() {
  local targets=()
  [ -x "$build/pounce" ] || targets+=(pounce)
  [ -x "$build/tests/pounce_gpu_tests" ] || targets+=(pounce_gpu_tests)
  [ ${#targets[@]} -eq 0 ] && return 0
  echo "gpu.sh: $build lacks ${targets[*]}: building here"
  # A cache configured on another machine (another source path) cannot be reused.
  if [ -f "$build/CMakeCache.txt" ] &&
    ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$(pwd)" "$build/CMakeCache.txt"; then
    rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
  fi
  local nccl=()
  [ -n "${POUNCE_NCCL_ROOT:-}" ] && nccl=("-DPOUNCE_NCCL_ROOT=$POUNCE_NCCL_ROOT")
  step build_configure 120 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${nccl[@]}" &&
    step build 400 cmake --build "$build" --parallel "$(nproc)" --target "${targets[@]}"
}

job_close() {  # [--deadline S] [-- pounce bench args]
  local limit=560
  while [ $# -gt 0 ]; do
    case "$1" in
      --deadline) limit=${2:?--deadline needs seconds}; shift 2 ;;
      --) shift; break ;;
      *) die "close: unknown option '$1' (bench arguments go after --)" ;;
    esac
  done
  deadline=$(($(date +%s) + limit))
  local args=("$@")
  has_opt --preset "${args[@]}" || args+=(--preset "${presets[@]}")
  has_opt --tokens "${args[@]}" || args+=(--tokens 8192)
  has_opt --iters "${args[@]}" || args+=(--iters 10)
  need_gpu
  build_missing
  have_binary "$build/tests/pounce_gpu_tests" && have_binary "$build/pounce" || return
  suite 2 180
  bench_step "bench_ep$num_gpus" 590 "${args[@]}"
  report bench "$out/bench_ep$num_gpus.json"
}

main() {
  local job=${1:-help}
  [ $# -gt 0 ] && shift
  case "$job" in
    help | -h | --help) usage; exit 0 ;;
  esac
  mkdir -p "$out" || die "cannot create $out"
  case "$job" in
    suite) job_suite "$@" ;;
    bench) job_bench "$@" ;;
    ab) job_ab "$@" ;;
    profile) job_profile "$@" ;;
    ncu) job_ncu "$@" ;;
    sanitize) job_sanitize "$@" ;;
    python) job_python "$@" ;;
    close) job_close "$@" ;;
    *) usage >&2; die "unknown job '$job'" ;;
  esac
  python3 tools/gpu_report.py finish "$out" "$run_id" "$job"
  exit "$failed"
}

main "$@"
