#!/usr/bin/env bash
# GPU machine, repo root, build folder carried: every timed run of one preset (TIMES_PRESET, gpt-oss-120b
# unless set), to see the spread of the layer's own times: forward, backward and both, 30 runs each, with the
# input sets rotated (3) and with one input set, no baseline. The runs' times print in order.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu_env.sh
out="${OUT:-/tmp/pounce_out}"
mkdir -p "$out"
preset="${TIMES_PRESET:-gpt-oss-120b}"
for sets in 3 1; do
  timeout 200 ./build/pounce bench --preset "$preset" --tokens 8192 --impl "${TIMES_IMPL:-fused}" \
    --pass forward,backward,forward_backward --iters 30 --input-sets $sets --no-baseline --plot-script '' \
    --out "$out/times_sets$sets.json" >"$out/times_sets$sets.log" 2>&1
  echo "== $preset, $sets input set(s): rc=$?"
  python3 - "$out/times_sets$sets.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    t = r.get("times_ms") or []
    print(f"{r['pass']:17s} median {r['median_ms']:.3f} min {r['min_ms']:.3f} max {r['max_ms']:.3f} |",
          " ".join(f"{x:.2f}" for x in t))
PY
done
