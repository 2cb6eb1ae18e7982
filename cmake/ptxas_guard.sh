#!/usr/bin/env bash
# CUDA compiler launcher of the device code (src/CMakeLists.txt): runs the compile (any launcher the user set,
# ccache for one, comes after this one in the command) and fails it when ptxas reports that it serialised wgmma
# instructions ("Potential Performance Loss", C7510-C7519): the kernel still runs, correct but slower (a plain
# write to accumulator registers between wgmmas slowed every GEMM of the layer by 10-15 %), so like spills it is
# an error here. The compiler's messages (stdout and stderr) pass through on stderr.
log=$(mktemp) || { echo "ptxas_guard: mktemp failed" >&2; exit 1; }
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log" >&2
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && grep -q "Potential Performance Loss: wgmma" "$log"; then
  echo "error: ptxas serialised wgmma instructions (above); fix: no plain instruction may write accumulator" \
    "registers between wgmmas, and ptxas needs the registers to pipeline them" >&2
  rc=1
fi
exit "$rc"
