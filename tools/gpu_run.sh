#!/usr/bin/env bash
# The GPU jobs of this repository, for the GPU machine (the `device` tool), one name per job:
#
#   bash tools/gpu_run.sh tests forward backward       # in the order given
#
# Each job runs under its own time limit and writes its output to $OUT/<job>.log (or ./gpu-logs
# without $OUT), so that a job cut short still leaves what it printed; a summary line per job
# follows at the end. FLA 0.6.0 is installed from .whl/ when present (carry it: see
# DEVELOPMENT.md), into /tmp/site, never into the machine's environment.
#
# With no job it prints the versions it runs on (with $CARRIED_SITES: tools/carry.sh's folders).
# Jobs (limit in seconds):
#   tests        pytest -m gpu: the GPU tests, 4 workers (560; on a freshly started machine they
#                can take longer: then run its parts in calls of their own)
#   tests-kernels  tests/test_gpu.py, the chunked kernels at real sizes (560)
#   tests-graphs   tests/test_cuda_graphs.py, generation through CUDA graphs (560)
#   tests-others   the GPU tests of every other file: conversion, fused layers, MQAR, and the two-GPU
#                tests, which skip on one GPU (560; with tests-graphs it did not end within 560 s)
#   tests-generation  the generation step's tests: generate's own loop, the fused step, its kernels, the greedy
#                choice, the step graph kept between calls (560)
#   The test jobs name every test as it ends (-v), so that a job cut short says what ran.
#   suite        the whole test suite, compiled kernels (600)
#   layers       the fused layer kernels' tests and the PEFT tests, all of them compiled (240)
#   convert      the conversion test against FLA's GPU kernels (300)
#   forward      benchmarks/bench_forward.py (240)
#   backward     benchmarks/bench_forward.py --backward (420)
#   forward-graphs   bench_forward.py --graphs: ours and FLA's calls replayed from CUDA graphs (240)
#   backward-graphs  bench_forward.py --backward --graphs (570; compiles every rule first, then times:
#                give it a call of its own)
#   kernels      benchmarks/kernel_times.py, forward and backward (300)
#   variants     benchmarks/kernel_variants.py --backward: this tree's kernel files beside every folder
#                scratch/variants/*/ (tools/variant.sh; carry scratch), each compiled first in a process of its own; more
#                kernel_variants options in $VARIANTS_ARGS ("--rules rla rdn --heads 16", say) (540)
#   variants-forward  the same without --backward: for copies whose backward does not compile (540)
#   variants-graphs  bench_forward.py --graphs with this tree's kernel files, then each folder in
#                scratch/variants/*/ in their place in turn, then this tree's again (what bench_forward
#                replays is the kernel files it imports, so copies take turns in them; the files are put
#                back at the end); every copy compiled first, all at once on tiny shapes; more
#                bench_forward options in $GRAPHS_ARGS ("--rules sgla rla --shapes 8x2048", "--backward")
#                (540). For changes that show only replayed (launch overlap, PDL): kernel_variants
#                times kernels and eager calls.
#   variants-command  $VARIANTS_COMMAND (any benchmark: "python3 benchmarks/bench_gemv.py --rows 16")
#                with this tree's modules, then with each folder in scratch/variants/*/ in their place
#                in turn (every top-level .py file a folder holds: `tools/variant.sh NAME --rev REV`
#                copies a commit's modules, the model's with the kernels'), then this tree's again (540)
#   gemv         benchmarks/bench_gemv.py: the fused GEMVs beside the unfused step's kernels, replayed; more
#                options in $GEMV_ARGS ("--pdl", "--split", "--sweep": ~150-300 s) (540)
#   decode       benchmarks/bench_decode.py: our decode step beside FLA's and FlashInfer's, those that import;
#                more options in $DECODE_ARGS ("--pdl") (240)
#   generate     benchmarks/bench_generate.py, the 400m shape: every rule, both loops, FLA's generate beside;
#                more options in $GENERATE_ARGS ("--rules gdn --no-fla", "--loops fast pdl split", "--top 12") (570: the
#                rows print as measured)
#   generate-1.3b  the same at the 1.3b shape (570)
#   training     benchmarks/bench_training.py (600)
#   compile      benchmarks/bench_compile.py: train.py's step eager and compiled (--compile) (420)
#   prefill      benchmarks/bench_prefill.py, its CSV and SVG into the log folder (600)
#   context      context parallelism on 2 GPUs (nvidia-h200-x2): its GPU tests, then
#                benchmarks/bench_context_parallel.py under torchrun (600)
#   ddp          benchmarks/bench_data_parallel.py: train.py's tokens/s on 1 and 2 GPUs (nvidia-h200-x2) (300)
#   compare      benchmarks/compare_rules.py --seeds 0 1 2, 8 runs a GPU at once, MQAR compiled, no LM run
#                started after 3.5 min (MQAR runs still start: one cut at the end resumes from its last
#                validation in the next call, if the machine is still warm); its JSON results into
#                compare.tgz in the log folder (untar it in the repository's root: see the script's
#                docstring); its summary line: "compare: N of M runs done[, K more started ...]" (570)
#   residual-clip  benchmarks/residual_clip.py: rla and rdn, c = 1 and off, seeds 0-2, 8 runs a GPU at
#                once; the c = 1 runs that the comparison trained on this machine are measured in place
#                (so run it right after `compare`, while the machine is warm); its JSON records into
#                residual_clip.tgz in the log folder (570)
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${OUT:-gpu-logs}
mkdir -p "$logs"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
# Folders of packages that tools/carry.sh carried go first on the path, ahead of the image's, their
# .pth files in effect as in site-packages (the CuTe DSL's puts its own packages on the path).
if [ -n "${CARRIED_SITES:-}" ]; then
  PYTHONPATH=$(python3 -c 'import os, site, sys
before = list(sys.path)
for folder in sys.argv[1:]:
    site.addsitedir(folder)
print(os.pathsep.join([p for p in sys.path if p not in before] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))' $CARRIED_SITES)
  export PYTHONPATH
fi
python3 -c "import importlib.metadata as metadata, torch, triton
print('torch', torch.__version__, 'triton', triton.__version__, triton.__file__, *(f'{name} {metadata.version(name)}'
      for name in ('fla-core', 'flashinfer-python') if any(metadata.distributions(name=name))))" | tee "$logs/versions.log"

job() {  # job NAME LIMIT COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  local status=$?
  local verdict="exit $status"
  [ $status -eq 124 ] && verdict="TIMED OUT after ${limit}s"
  summary+=("$(printf '%-9s %-22s %4ds  %s' "$name" "$verdict" $((SECONDS - start)) "$(tail -n 1 "$logs/$name.log")")")
}

for name in "$@"; do  # every name checked before any job runs
  case $name in
    tests|tests-kernels|tests-graphs|tests-others|tests-generation|suite|layers|convert|forward|backward|forward-graphs|backward-graphs|kernels|variants|variants-forward|variants-graphs|variants-command|gemv|decode|generate|generate-1.3b|training|compile|prefill|context|ddp|compare|residual-clip) ;;
    *) echo "unknown job $name" >&2; exit 2 ;;
  esac
done
# Each copy of the kernel files compiles for ~30-60 s at its first call: all of them at once, on tiny shapes,
# before any timing. warm_copies "KERNEL_VARIANTS_OPTIONS" FILE...
warm_copies() {
  local options=$1 file
  shift
  for file in "$@"; do
    python3 benchmarks/kernel_variants.py $options --variant "warm=$file" --repeats 1 >/dev/null 2>&1 &
  done
  wait
}
export -f warm_copies
summary=()
for name in "$@"; do
  case $name in
    tests) job tests 560 python3 -m pytest -v -n 4 -p no:cacheprovider -m gpu ;;
    tests-kernels) job tests-kernels 560 python3 -m pytest -v -n 4 -p no:cacheprovider -m gpu tests/test_gpu.py ;;
    tests-graphs) job tests-graphs 560 python3 -m pytest -v -n 4 -p no:cacheprovider -m gpu tests/test_cuda_graphs.py ;;
    tests-others) job tests-others 560 python3 -m pytest -v -n 4 -p no:cacheprovider -m gpu \
      --ignore tests/test_gpu.py --ignore tests/test_cuda_graphs.py ;;
    tests-generation) job tests-generation 560 python3 -m pytest -v -n 4 -p no:cacheprovider -m gpu \
      tests/test_generation_loop.py tests/test_fused_decode_step.py tests/test_projected_decode.py tests/test_gemv_triton.py \
      tests/test_greedy_choice.py tests/test_kept_step.py ;;
    suite) job suite 600 python3 -m pytest -q -n 6 -p no:cacheprovider ;;
    layers) job layers 240 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_layers_triton.py tests/test_peft.py ;;
    convert) job convert 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_convert.py -k gpu_bf16 ;;
    forward) job forward 240 python3 benchmarks/bench_forward.py ;;
    backward) job backward 420 python3 benchmarks/bench_forward.py --backward ;;
    forward-graphs) job forward-graphs 240 python3 benchmarks/bench_forward.py --graphs ;;
    backward-graphs) job backward-graphs 570 python3 benchmarks/bench_forward.py --backward --graphs ;;
    kernels) job kernels 300 bash -c "python3 benchmarks/kernel_times.py && python3 benchmarks/kernel_times.py --backward --shapes 8x2048" ;;
    variants|variants-forward)
      passes=--backward
      [ "$name" = variants-forward ] && passes=
      job "$name" 540 bash -c '
      files=(scratch/variants/*/)
      [ -e "${files[0]}" ] || { echo "no scratch/variants/*/"; exit 2; }
      warm_copies "'"$passes"' --shapes 1x256" "${files[@]}"
      python3 benchmarks/kernel_variants.py '"$passes"' ${VARIANTS_ARGS:-} --variant main=. \
        $(for file in "${files[@]}"; do echo --variant "$(basename "$file")=$file"; done)' ;;
    variants-graphs|variants-command)
      if [ "$name" = variants-graphs ]; then
        command="python3 benchmarks/bench_forward.py --graphs ${GRAPHS_ARGS:-}"
      else
        command=${VARIANTS_COMMAND:?"variants-command runs \$VARIANTS_COMMAND"}
      fi
      job "$name" 540 bash -c '
      files=(scratch/variants/*/)
      [ -e "${files[0]}" ] || { echo "no scratch/variants/*/"; exit 2; }
      main=$(mktemp -d)
      cp *.py "$main"
      trap "rm -f kernels_reslin_triton*.py; cp \"$main\"/*.py ." EXIT
      [ "'"$name"'" = variants-graphs ] && warm_copies "--shapes 8x256 2x256 --heads 16" "$main" "${files[@]}"
      for file in "$main" "${files[@]}" "$main"; do
        name=$(basename "$file")
        [ "$file" = "$main" ] && name=main
        rm -f kernels_reslin_triton*.py; cp "$main"/*.py .; cp "$file"/*.py .
        echo "== $name"
        '"$command"'
      done' ;;
    gemv) job gemv 540 python3 benchmarks/bench_gemv.py ${GEMV_ARGS:-} ;;
    decode) job decode 240 python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} ;;
    generate) job generate 570 python3 benchmarks/bench_generate.py ${GENERATE_ARGS:-} ;;
    generate-1.3b) job generate-1.3b 570 python3 benchmarks/bench_generate.py --shape 1.3b ${GENERATE_ARGS:-} ;;
    training) job training 600 python3 benchmarks/bench_training.py ;;
    compile) job compile 420 python3 benchmarks/bench_compile.py ;;
    prefill) job prefill 600 python3 benchmarks/bench_prefill.py --out "$logs" ;;
    # NVLink multicast off: required on the 2-GPU machine (the tests set it themselves).
    context) job context 600 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_context_parallel.py \
      && NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
         benchmarks/bench_context_parallel.py" ;;
    ddp) job ddp 300 env NCCL_NVLS_ENABLE=0 python3 benchmarks/bench_data_parallel.py --steps 30 ;;
    # Finished runs (committed in benchmarks/results/compare) are skipped: repeat until the table is whole.
    compare) job compare 570 python3 benchmarks/compare_rules.py --seeds 0 1 2 --start-within 3.5 \
      --jobs $((8 * $(nvidia-smi -L | wc -l))) --mqar-args=--compile
      find benchmarks/results/compare -name comparison.json -o -name metrics.json -o -path '*/mqar/*.json' \
        | tar czf "$logs/compare.tgz" -T -
      for log in benchmarks/results/compare/logs/*.log; do echo "== $log"; tail -c 2000 "$log"; echo; done >"$logs/compare-runs.log" ;;
    residual-clip) job residual-clip 570 python3 benchmarks/residual_clip.py --lm-runs benchmarks/results/compare \
      --start-within 4 --jobs $((8 * $(nvidia-smi -L | wc -l)))
      find benchmarks/results/residual_clip -name residual_clip.json -o -name metrics.json \
        | tar czf "$logs/residual_clip.tgz" -T - ;;
  esac
done
printf '%s\n' "${summary[@]}"
