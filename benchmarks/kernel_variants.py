"""GPU time per kernel of several versions of the Triton kernels, side by side in one run.

kernel_times.py says which kernel to work on; this says which version of it is faster, measured
in the same run on the same GPU (an H200's times move between runs by more than many a change
gains). Each --variant is NAME=DIR, DIR a folder of kernels_reslin_triton*.py files: those it
holds replace the tree's, the others are the tree's own. The tree itself is `--variant now=.`;
tools/variant.sh makes folders from another commit's files (the GPU machine gets no .git) or
from the tree's edited with sed (a tile, a warp count). For every rule and shape it calls
each variant's chunk_forward and, with --backward, the two halves of a training call as
autograd runs them: the training forward (chunk_forward with training=True, at the backward's
chunk size) and chunk_backward from what it kept (T^-1, the kept segment starts; the recomputed
forward included). It prints the kernels' total and the slowest kernels, in microseconds per
call, and the call's own time (CUDA events, as bench_forward.py takes it): below the kernels'
total where kernels overlap (on two streams), above it where the host is the slower side, and
the host's time to issue it (`host`, calls queued without waiting): near the call's time, the
host bounds it. --rounds 2 times every variant a second time in reverse order.
With --check it also compares every variant's outputs and gradients with the first variant's
(the largest relative RMS difference; inf where one is not finite), so that a faster variant is
known to compute the same thing on that GPU before it is worth landing, and gives each variant's
error against the chunked PyTorch reference in fp32 (kernels_reslin_torch, its gradients by
autograd): a variant that rounds differently (an intermediate in bf16, a sum in another order)
shows whether it lost precision or only moved. The reference is not a Triton variant run in
fp32: at D128 those kernels compile for minutes a copy.

    python benchmarks/kernel_variants.py --variant now=. --variant old=scratch/variants/old \\
        [--rules gdn rdn] [--shapes 4x4096 8x2048] [--heads 8] [--dim 128] [--backward] [--top 5]
        [--check]
    python benchmarks/kernel_variants.py --smoke   # the tree's kernels (or the --variant folders) on tiny sizes

Every variant compiles its kernels anew (files of its own to Triton): give a first run time.
A variant that fails (a launch past the shared memory, say) is reported and the others go on;
after an illegal memory access the GPU's context is lost, and every later call fails with it.
"""

import argparse
import glob
import importlib
import os
import re
import shutil
import sys
import tempfile

import torch

from bench_forward import parse_shape
from common import DEVICE, REPO, RULES, host_ms, median_ms, print_header, rule_inputs
from kernel_times import kernel_times
from kernels_reslin_torch import chunk_reslin


VARIANT_FILES = ("kernels_reslin_torch.py", "kernels_reslin_triton*.py")


def load_variant(name, folder):
    """The variant's kernels_reslin_triton module (chunk_forward, chunk_backward, CHUNK_SIZE: the
    same names before the kernels were split into modules): the tree's kernel files with the
    folder's in their place, imported as a package of their own."""
    package = "kernels_variant_" + re.sub(r"\W", "_", name)
    root = tempfile.mkdtemp(prefix="kernel-variant-")
    os.mkdir(os.path.join(root, package))
    for source in (REPO, folder):
        for pattern in VARIANT_FILES:
            for path in glob.glob(os.path.join(source, pattern)):
                shutil.copy(path, os.path.join(root, package))
    sys.path.insert(0, root)
    try:
        return importlib.import_module(f"{package}.kernels_reslin_triton")
    finally:
        sys.path.remove(root)


def chunk_arguments(rule, B, T, H, D):
    """Positional arguments of chunk_forward, and the gradient of its output, for `rule`."""
    x = rule_inputs(rule, B, T, H, D)
    residual = x["gamma"] is not None
    gamma_write = x["gamma_write"] if x["gamma_write"] is not None else x["gamma"]
    S0 = torch.zeros(B, H, D, D, device=DEVICE)
    R0 = torch.zeros_like(S0) if residual else None
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["gamma"], gamma_write, x["update"], 1.0, D ** -0.5,
            S0, R0, None)
    return args, torch.randn_like(x["v"])


def fp32_reference(chunk_args, do, backward):
    """What `results` gives, from kernels_reslin_torch.chunk_reslin on the inputs in fp32."""
    args = [t.detach().float().requires_grad_(backward) if torch.is_tensor(t) else t for t in chunk_args]
    with torch.enable_grad():
        o, S, R = chunk_reslin(*args)
        tensors = [o, S, R]
        if backward:
            inputs = [t for t in args if torch.is_tensor(t)]
            tensors += torch.autograd.grad((o * do.float()).sum(), inputs, allow_unused=True)
    return [t.detach().float() for t in tensors if t is not None]


def variant_calls(kernels, chunk_args, do, backward):
    """{label: zero-argument call}: the forward, or with `backward` the training call's forward
    (returning o, S, R) and the backward from what that forward kept, as `_EagerChunkAttention`
    passes it."""
    if not backward:
        return {"forward": lambda: kernels.chunk_forward(*chunk_args)}
    kept = {}

    def training_forward():
        o, S, R, kept["inverse"], kept["kept_states"] = kernels.chunk_forward(
            *chunk_args, chunk_size=kernels.CHUNK_SIZE, training=True)
        return o, S, R

    training_forward()
    return {"forward": training_forward,
            "backward": lambda: kernels.chunk_backward(*chunk_args, do, None, None, **kept)}


def results(calls):
    """The calls' outputs in order (the forward's o, S, R, then the backward's gradients), in fp32."""
    return [t.float() for call in calls.values() for t in call() if t is not None]


def largest_difference(tensors, reference):
    """The largest relative RMS difference of `tensors` from `reference`, inf where one is not
    finite (a NaN or an unwritten element shows as a difference, not as a match)."""
    return max(((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()
               if torch.isfinite(a).all() else float("inf") for a, b in zip(tensors, reference, strict=True))


def summary(times, top):
    short = lambda name: name.removeprefix("_chunk_").removesuffix("_kernel")[:40]  # noqa: E731
    return f"{sum(times.values()):9.1f} us  [" + ", ".join(
        f"{short(name)} {us:.0f}" for name, us in times.most_common(top)) + "]"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                        help="a folder of kernels_reslin_triton*.py files in place of the tree's (repeat the option)")
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=["sgla", "gdn", "rla", "rdn"])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(4, 4096), (8, 2048)])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--backward", action="store_true", help="also chunk_backward")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=5, help="kernels named per call")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the variants this many times a rule and shape, every second round in "
                             "reverse order (a variant's place in the run should not change its figures)")
    parser.add_argument("--check", action="store_true",
                        help="also every variant's outputs (and gradients) against the first variant's, "
                             "and their error against the chunked PyTorch reference in fp32")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (the tree's kernels without --variant), to check the script")
    args = parser.parse_args(argv)
    if args.smoke:
        args.variant = args.variant or [f"now={REPO}"]
        args.shapes, args.heads, args.dim, args.repeats, args.rules = [(1, 70)], 2, 32, 1, ["gdn", "rdn"]
    if not args.variant:
        parser.error("name at least one --variant NAME=FILE")
    variants = []
    for text in args.variant:
        name, _, path = text.partition("=")
        if not name or not os.path.isdir(path):
            parser.error(f"--variant {text!r}: expected NAME=DIR with an existing folder")
        variants.append((name, load_variant(name, path)))
    print_header(f"GPU time per kernel of {len(variants)} variants, H={args.heads} Dk=Dv={args.dim}, "
                 f"mean of {args.repeats} calls{', forward and backward' if args.backward else ''}")
    torch.manual_seed(0)
    width = max(len(name) for name, _ in variants)
    for rule in args.rules:
        for B, T in args.shapes:
            chunk_args, do = chunk_arguments(rule, B, T, args.heads, args.dim)
            print(f"\n{rule} {B}x{T}", flush=True)
            reference = reference_fp32 = None
            order = [pair for number in range(args.rounds) for pair in variants[::1 if number % 2 == 0 else -1]]
            for number, (name, kernels) in enumerate(order):
                try:
                    calls = variant_calls(kernels, chunk_args, do, args.backward)
                    for label, call in calls.items():
                        times = kernel_times(call, args.repeats)
                        print(f"  {name:{width}s} {label:8s} {summary(times, args.top)}  call "
                              f"{1e3 * median_ms(call, args.repeats):.1f} us  host "
                              f"{1e3 * host_ms(call, args.repeats):.1f} us", flush=True)
                    if args.check and number < len(variants):
                        tensors = results(calls)
                        if reference is None:
                            reference = (name, tensors)
                            reference_fp32 = fp32_reference(chunk_args, do, args.backward)
                        else:
                            print(f"  {name:{width}s} differs from {reference[0]} by at most "
                                  f"{largest_difference(tensors, reference[1]):.1e}", flush=True)
                        print(f"  {name:{width}s} error against the fp32 reference at most "
                              f"{largest_difference(tensors, reference_fp32):.1e}", flush=True)
                except Exception as error:  # a launch that does not fit, say: the other variants still run
                    print(f"  {name:{width}s} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}",
                          flush=True)


if __name__ == "__main__":
    main()
