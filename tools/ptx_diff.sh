#!/usr/bin/env bash
# Here, no GPU needed: whether a change alters the device code at all. Compiles each named CUDA file of the
# library to PTX twice, from the working tree and from BASE (a commit, HEAD unless set; checked out into a
# temporary worktree), with the build's own nvcc command line, drops debug info (.loc, .file, the .debug
# sections: line numbers move with any edit) and compares the rest. "identical" means the GPU runs the same
# instructions, so a pure refactor needs no device time; anything else needs the gpu tests.
#   tools/ptx_diff.sh [files...]      (default: src/gpu/fused_forward.cu src/gpu/fused_backward.cu)
#   BASE=<commit> tools/ptx_diff.sh src/gpu/staged_backward.cu
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build="${BUILD_DIR:-build}"
base="${BASE:-HEAD}"
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(src/gpu/fused_forward.cu src/gpu/fused_backward.cu)
[ -f "$build/build.ninja" ] || { echo "no $build/build.ninja: configure and build first (cmake -S . -B $build -G Ninja)"; exit 2; }
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/base" >/dev/null 2>&1; rm -rf "$work"' EXIT
git worktree add --detach "$work/base" "$base" >/dev/null 2>&1 || { echo "cannot check out BASE=$base"; exit 2; }

# The object's compile command, turned into a PTX-only one for source tree $1, output $2.
ptx_of() {
  local tree=$1 file=$2 out=$3 object cmd
  local tail2
  tail2=$(awk -F/ '{print (NF > 1 ? $(NF - 1) "/" : "") $NF}' <<<"$file")  # objects are named by the last parts
  object=$(ninja -C "$build" -t targets all 2>/dev/null | cut -d: -f1 | grep -F "/$tail2.o" | head -1)
  [ -n "$object" ] || { echo "no object for $file in $build"; return 2; }
  cmd=$(ninja -C "$build" -t commands "$object" | tail -1)
  cmd=${cmd//"$root/cmake/ptxas_guard.sh "/}
  cmd=$(sed -E 's/ -MD -MT [^ ]+ -MF [^ ]+//; s/ -c / -ptx /; s/ -o [^ ]+$//' <<<"$cmd")
  cmd=${cmd//"-I$root "/"-I$tree "}
  cmd=${cmd//"$root/$file"/"$tree/$file"}
  (cd "$build" && eval "$cmd -o $out") || return 2
  # code only: no line table, no debug sections, no comments, and internal symbols without the hash of the
  # source path nvcc puts in their names
  awk '/\.section[ \t]+\.debug/{exit} {print}' "$out" | grep -vE '^[[:space:]]*\.(loc|file)[[:space:]]|^//' |
    sed -E 's/(_INTERNAL_|_GLOBAL__N__)[0-9a-f]{8}_/\1_/g' >"$out.code"
}

status=0
for file in "${files[@]}"; do
  name=$(basename "$file" .cu)
  if ! ptx_of "$root" "$file" "$work/$name.tree.ptx" || ! ptx_of "$work/base" "$file" "$work/$name.base.ptx"; then
    echo "$file: could not compile"
    status=2
    continue
  fi
  differing=$(diff "$work/$name.base.ptx.code" "$work/$name.tree.ptx.code" | grep -c '^[<>]')
  if [ "$differing" -eq 0 ]; then
    echo "$file: identical to $base ($(wc -l <"$work/$name.tree.ptx.code") PTX lines)"
  else
    echo "$file: $differing PTX lines differ from $base"
    status=1
  fi
done
exit $status
