#!/usr/bin/env bash
# A folder of the Triton kernel files (kernels_reslin_triton*.py) for `gpu_run.sh variants`, which
# times every scratch/variants/*/ beside this tree's kernels (benchmarks/kernel_variants.py), and
# for `variants-graphs` and `variants-command`, which put a folder's files in the tree's place:
#
#   bash tools/variant.sh values-w4 's/num_warps=GRAD_VALUES_WARPS/num_warps=8/'
#   bash tools/variant.sh committed --rev HEAD     # another commit's modules (every top-level .py), unedited
#   bash tools/variant.sh fused --patch scratch/fused.patch   # these files, patched (git diff output)
#                                       (several patches: applied in the order given)
#
# The sed expressions apply to every kernel file; each must change one, so that a launch setting
# renamed since stops the run here, not as a variant that times the same code twice.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,12p' "$0"; exit 2; }
name=$1; shift
out=scratch/variants/$name
rm -rf "$out"
mkdir -p "$out"
if [ "$1" = "--rev" ]; then
  for file in $(git ls-tree --name-only "$2" | grep '\.py$'); do
    git show "$2:$file" > "$out/$file"
  done
  exit 0
fi
cp kernels_reslin_triton*.py "$out/"
if [ "$1" = "--patch" ]; then  # the patches' hunks for the kernel files; they may touch other files
  shift
  for patch in "$@"; do
    (cd "$out" && git apply --include='kernels_reslin_triton*.py') <"$patch"
  done
  exit 0
fi
for expr in "$@"; do
  before=$(cat "$out"/*.py | md5sum)
  sed -i -e "$expr" "$out"/*.py
  [ "$before" != "$(cat "$out"/*.py | md5sum)" ] || { rm -r "$out"; echo "$name: '$expr' changed nothing" >&2; exit 1; }
done
