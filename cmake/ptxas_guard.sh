#!/usr/bin/env bash
# CUDA compiler launcher of the device code (src/CMakeLists.txt): runs the compile and fails it when ptxas
# reports that it serialised wgmma instructions ("Potential Performance Loss", C7510-C7519): the kernel still
# runs, correct but slower (a plain write to accumulator registers between wgmmas slowed every GEMM of the
# layer by 10-15 %), so like spills it is an error here.
log=$(mktemp)
"$@" 2>"$log"
rc=$?
cat "$log" >&2
if [ "$rc" -eq 0 ] && grep -q "Potential Performance Loss: wgmma" "$log"; then
  echo "error: ptxas serialised wgmma instructions (above); fix: no plain instruction may write accumulator" \
    "registers between wgmmas, and ptxas needs the registers to pipeline them" >&2
  rc=1
fi
rm -f "$log"
exit "$rc"
