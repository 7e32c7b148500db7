#!/usr/bin/env bash
# Carries Python packages that the GPU machine's image lacks, or has in another release, to that
# machine: Triton 3.7.1 (the release torch 2.13 installs; the image has 3.6) for the GPU tests, and
# FlashInfer's GDN decode kernels for bench_decode.py's anchor. Their wheels are over what one
# device call carries (64 MiB with the working tree), so they travel in parts over consecutive
# calls while the machine is warm; /tmp survives between those calls, a carried folder does not.
#
#   here:  bash tools/carry.sh pack NAME               # .carry-parts/NAME/p00, p01, ... (git-ignored)
#   there, one call per part, carry [".carry-parts/NAME/pNN"]:
#          bash tools/carry.sh receive NAME
#   there, after the last part:
#          bash tools/carry.sh install NAME            # unpacks into /tmp/NAME-site
#          CARRIED_SITES=/tmp/NAME-site bash tools/gpu_run.sh JOB    # first on PYTHONPATH
#
# NAME (the wheels are the image's: Python 3.12, CUDA 13):
#   triton      triton 3.7.1 less what a test run never loads (static libraries, the Blackwell
#               ptxas, a test-only instrumentation library, the host profiling library: ~190 MB of
#               ~720); five parts of ~22 MiB.
#   flashinfer  flashinfer-python 0.7.4 less the CUDA sources of its other kernels (its GDN decode
#               kernels are CuTe DSL Python, compiled at their first call), with the packages its
#               import and those kernels need that the image lacks: apache-tvm-ffi, cuda-tile,
#               cuDNN's frontend, and the CuTe DSL (nvidia-cutlass-dsl and its libraries for CUDA
#               13); five parts of ~22 MiB. `import flashinfer` and `flashinfer.gdn_decode`'s
#               kernels were seen to import from such a folder on a CPU (2026-12-05; Python 3.11
#               wheels); never yet on the GPU.
# A part's size is what a call carries less the working tree. Each package's files are unpacked by
# Python's zipfile and compressed with xz.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${2:-}
case "$name" in
  triton)
    requirements=(triton==3.7.1)
    prune() {
      rm -f triton/backends/nvidia/lib/cupti/*.a triton/backends/nvidia/bin/ptxas-blackwell \
        triton/instrumentation/libGPUInstrumentationTestLib.so triton/backends/nvidia/lib/cupti/libnvperf_host.so
    }
    ;;
  flashinfer)
    requirements=(flashinfer-python==0.7.4 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 nvidia-cudnn-frontend==1.32.0
                  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
                  nvidia-cutlass-dsl-libs-cu13==4.8.1)
    prune() {
      find flashinfer/data/csrc -mindepth 1 -maxdepth 1 ! -name gdn -exec rm -rf {} +
    }
    ;;
  *)
    echo "usage: carry.sh pack|receive|install triton|flashinfer" >&2
    exit 2
    ;;
esac
parts=.carry-parts/$name
received=/tmp/$name-parts
site=/tmp/$name-site
case "${1:-}" in
  pack)
    work=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_28_x86_64 -d "$work" "${requirements[@]}"
    mkdir "$work/site"
    for wheel in "$work"/*.whl; do
      python3 -m zipfile -e "$wheel" "$work/site"
    done
    (cd "$work/site" && prune)
    tar cf - -C "$work/site" . | xz -T0 -6 >"$work/site.tar.xz"
    # What travels beside a part: the working tree (tracked and untracked, not ignored files).
    tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -n 1 | cut -f1)
    size=$(( (62 * 1024 * 1024 - tree) / 1024 / 1024 ))
    rm -rf "$parts" && mkdir -p "$parts"
    (cd "$parts" && split -b "${size}m" -d "$work/site.tar.xz" part)
    for part in "$parts"/part*; do mkdir "$parts/p${part##*part}" && mv "$part" "$parts/p${part##*part}/"; done
    sha256sum "$work/site.tar.xz" | cut -d' ' -f1 >"$parts/p00/sha256"
    rm -rf "$work"
    echo "$(ls -d "$parts"/p* | wc -l) parts of at most ${size} MiB in $parts: carry each in its own call"
    ;;
  receive)
    mkdir -p "$received"
    cp "$parts"/p*/* "$received"/
    ls -la "$received"
    ;;
  install)
    (cd "$received" && cat part* | tee site.tar.xz | sha256sum | cut -d' ' -f1 | diff - sha256)
    rm -rf "$site" && mkdir "$site"
    xz -dc "$received/site.tar.xz" | tar xf - -C "$site"
    # Python's zipfile drops the execute bits of the programs a package runs (triton's ptxas and co).
    find "$site" -path '*/bin/*' -type f -exec chmod +x {} +
    CARRIED_SITES=$site bash tools/gpu_run.sh  # no job: the versions it runs on
    ;;
  *)
    echo "usage: carry.sh pack|receive|install triton|flashinfer" >&2
    exit 2
    ;;
esac
