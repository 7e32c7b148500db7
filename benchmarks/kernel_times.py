"""Where the time of one chunked call goes: GPU time per kernel, ours beside FLA 0.6.0's, same run.

bench_forward.py says how far a rule is from its goal; this says which kernel to work on. For
each rule and shape it runs the call (forward, or with --backward forward + backward) under
torch.profiler and prints every kernel's GPU time per call, ours then FLA's baseline for the
rule (the same baselines as bench_forward.py), each with its share of the kernels' total, and
beside that total the call's own time as bench_forward.py measures it and the host's time to
issue it (a call slower than its kernels, taking about its host time, is bound by the host:
Python and launches). Under FLA's times, the configs its autotuning picked so far in the process
(one per kernel and tuned shape), which may differ between runs.

    python benchmarks/kernel_times.py [--shapes 8x2048 1x32768] [--rules gdn rdn] [--backward]
    python benchmarks/kernel_times.py --smoke   # tiny sizes on a CPU: checks the script runs

On a CPU the kernels run in Triton's interpreter, which the profiler does not see: --smoke
prints the torch operators' CPU times instead.
"""

import argparse
import collections
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from bench_forward import parse_shape, rule_calls
from common import DEVICE, RULES, fla_picks, host_ms, import_fla, lift_fla_backward_guard, median_ms, print_header


def kernel_times(call, repeats):
    """{kernel name: microseconds per call} of `call`, after one warm-up call (compilation)."""
    call()
    activities = [ProfilerActivity.CUDA] if DEVICE == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    times = collections.Counter()
    for event in prof.events():
        if DEVICE == "cuda" and event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / repeats
        elif DEVICE != "cuda" and event.cpu_parent is None:
            times[event.name] += event.cpu_time_total / repeats
    return times


def print_times(label, call, repeats):
    """The kernels' times, and beside their sum the call's time as bench_forward.py takes it and
    the host's time to issue the call: where the call takes longer than its kernels and about as
    long as the host's part, the host (Python, launches) is the slower side."""
    times = kernel_times(call, repeats)
    total = sum(times.values())
    print(f"  {label}: {total:8.1f} us in kernels, {1e3 * median_ms(call, repeats):8.1f} us per call, "
          f"{1e3 * host_ms(call, repeats):8.1f} us of host to issue it")
    for name, us in times.most_common():
        print(f"    {us:8.1f} us {100 * us / total:5.1f}%  {name[:90]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(8, 2048), (1, 32768)])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    parser.add_argument("--backward", action="store_true", help="forward + backward (a training call)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.heads, args.dim, args.repeats, args.rules = [(1, 70)], 2, 32, 1, ["gdn", "rdn"]
    fla = import_fla()
    note = lift_fla_backward_guard() if fla is not None and args.backward else None
    H, D = args.heads, args.dim
    print_header(f"GPU time per kernel, {'forward + backward' if args.backward else 'forward'}, "
                 f"backend 'triton', H={H} Dk=Dv={D}, mean of {args.repeats} calls")
    if note:
        print(note)
    torch.manual_seed(0)
    with contextlib.nullcontext() if args.backward else torch.no_grad():
        for rule in args.rules:
            for B, T in args.shapes:
                ours, fla_call = rule_calls(fla, rule, B, T, H, D, "triton", args.backward)
                print(f"\n{rule} {B}x{T}")
                print_times("ours", ours, args.repeats)
                if fla_call is not None:
                    name, call = fla_call
                    print_times(f"FLA {name}", call, args.repeats)
                    for kernel, settings in sorted(fla_picks().items()):
                        print(f"    FLA's tuning picked for {kernel}: {'; '.join(settings)}")

if __name__ == "__main__":
    main()
