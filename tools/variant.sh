#!/usr/bin/env bash
# A copy of kernels_reslin_triton.py with sed expressions applied, for `gpu_run.sh variants`
# (which times every scratch/variants/*.py beside this tree's file):
#
#   bash tools/variant.sh values-w4 's/num_warps=GRAD_VALUES_WARPS/num_warps=8/'
#   bash tools/variant.sh committed --rev HEAD     # another commit's file, unedited
#   bash tools/variant.sh fused --patch scratch/fused.patch   # this file, patched (git diff output)
#                                       (several patches: applied in the order given)
#
# Each expression must change the file, so that a launch setting renamed since stops the run
# here, not as a variant that times the same code twice.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,11p' "$0"; exit 2; }
name=$1; shift
mkdir -p scratch/variants
out=scratch/variants/$name.py
if [ "$1" = "--rev" ]; then
  git show "$2:kernels_reslin_triton.py" > "$out"
  exit 0
fi
if [ "$1" = "--patch" ]; then  # the patches' hunks for kernels_reslin_triton.py; they may touch other files
  shift
  work=$(mktemp -d)
  cp kernels_reslin_triton.py "$work/"
  for patch in "$@"; do
    (cd "$work" && git apply --include=kernels_reslin_triton.py) <"$patch"
  done
  mv "$work/kernels_reslin_triton.py" "$out"
  rm -r "$work"
  exit 0
fi
cp kernels_reslin_triton.py "$out"
for expr in "$@"; do
  before=$(md5sum <"$out")
  sed -i -e "$expr" "$out"
  [ "$before" != "$(md5sum <"$out")" ] || { rm "$out"; echo "$name: '$expr' changed nothing" >&2; exit 1; }
done
