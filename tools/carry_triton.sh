#!/usr/bin/env bash
# Carries another Triton release to the GPU machine, whose image has triton 3.6, to run the GPU
# tests on the release that torch 2.13 installs (3.7.1). Its wheel is ~190 MB, over what one device
# call carries (64 MiB with the working tree), so it travels in parts over consecutive calls
# while the machine is warm; /tmp survives between those calls, a carried folder does not.
#
#   here:  bash tools/carry_triton.sh pack 3.7.1       # .triton-parts/p00, p01, ... (git-ignored)
#   there, one call per part, carry [".triton-parts/pNN"]:
#          bash tools/carry_triton.sh receive
#   there, after the last part:
#          bash tools/carry_triton.sh install          # unpacks into /tmp/triton-site
#          TRITON_SITE=/tmp/triton-site bash tools/gpu_run.sh tests    # first on PYTHONPATH
#
# pack drops what a test run never loads (static libraries, the Blackwell ptxas, a test-only
# instrumentation library, the host profiling library: ~190 MB of ~720) and compresses with xz.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=.triton-parts
received=/tmp/triton-parts
case "${1:-}" in
  pack)
    version=${2:?usage: carry_triton.sh pack VERSION}
    work=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work" "triton==$version"
    mkdir "$work/site"
    (cd "$work/site" && python3 -m zipfile -e "$work"/triton-*.whl . \
      && rm -f triton/backends/nvidia/lib/cupti/*.a triton/backends/nvidia/bin/ptxas-blackwell \
               triton/instrumentation/libGPUInstrumentationTestLib.so triton/backends/nvidia/lib/cupti/libnvperf_host.so)
    tar cf - -C "$work/site" . | xz -T0 -6 >"$work/triton.tar.xz"
    # What travels beside a part: the working tree (tracked and untracked, not ignored files).
    tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -n 1 | cut -f1)
    size=$(( (62 * 1024 * 1024 - tree) / 1024 / 1024 ))
    rm -rf "$parts" && mkdir "$parts"
    (cd "$parts" && split -b "${size}m" -d "$work/triton.tar.xz" part)
    for part in "$parts"/part*; do mkdir "$parts/p${part##*part}" && mv "$part" "$parts/p${part##*part}/"; done
    sha256sum "$work/triton.tar.xz" | cut -d' ' -f1 >"$parts/p00/sha256"
    rm -rf "$work"
    echo "$(ls -d "$parts"/p* | wc -l) parts of at most ${size} MiB in $parts: carry each in its own call"
    ;;
  receive)
    mkdir -p "$received"
    cp "$parts"/p*/* "$received"/
    ls -la "$received"
    ;;
  install)
    (cd "$received" && cat part* | tee triton.tar.xz | sha256sum | cut -d' ' -f1 | diff - sha256)
    rm -rf /tmp/triton-site && mkdir /tmp/triton-site
    xz -dc "$received/triton.tar.xz" | tar xf - -C /tmp/triton-site
    # The wheel was unpacked by Python's zipfile, which drops the execute bits of ptxas and co.
    chmod +x /tmp/triton-site/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/triton-site python3 -c "import triton; print('triton', triton.__version__, triton.__file__)"
    ;;
  *)
    echo "usage: carry_triton.sh pack VERSION | receive | install" >&2
    exit 2
    ;;
esac
