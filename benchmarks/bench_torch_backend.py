"""Chunked "torch" backend against the per-token "recurrent" reference, on the CPU by default.

Goal (issue "A loadable ResLin model repository"): "torch" at least 10x faster than
"recurrent" at B=1, H=4, T=2048, D=64, forward and forward+backward, for sgla, gdn, rla and rdn:
the kernels' four paths (kla and rkla run gdn's and rdn's code with other write strengths).

    python benchmarks/bench_torch_backend.py [--device cpu] [--T 2048] [--repeats 3]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernels_reslin import reslin_attention  # noqa: E402

RULES = {"sgla": ("additive", False), "gdn": ("delta", False), "rla": ("additive", True),
         "rdn": ("delta", True)}


def inputs(B, T, H, D, residual, device):
    q = torch.randn(B, T, H, D, device=device)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=device), dim=-1)
    v = torch.randn(B, T, H, D, device=device)
    g = -torch.nn.functional.softplus(torch.randn(B, T, H, device=device))
    beta = torch.rand(B, T, H, device=device)
    gamma = torch.rand(B, T, H, device=device) if residual else None
    return [x if x is None else x.requires_grad_() for x in (q, k, v, g, beta, gamma)]


def timed(fn, repeats, device):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"B={args.B} H={args.H} T={args.T} Dk=Dv={args.D}, median of {args.repeats}")
    print(f"{'rule':6} {'pass':8} {'recurrent ms':>13} {'torch ms':>10} {'speed-up':>9}")
    worst = float("inf")
    for name, (update, residual) in RULES.items():
        x = inputs(args.B, args.T, args.H, args.D, residual, device)
        for label, backward in (("fwd", False), ("fwd+bwd", True)):
            ms = {}
            for backend in ("recurrent", "torch"):
                def step():
                    with torch.set_grad_enabled(backward):
                        o, _ = reslin_attention(*x, update=update, backend=backend)
                        if backward:
                            o.sum().backward()
                ms[backend] = 1e3 * timed(step, args.repeats, device)
            ratio = ms["recurrent"] / ms["torch"]
            worst = min(worst, ratio)
            print(f"{name:6} {label:8} {ms['recurrent']:13.1f} {ms['torch']:10.1f} {ratio:8.1f}x")
    print(f"slowest speed-up {worst:.1f}x (goal >= 10x): {'met' if worst >= 10 else 'NOT met'}")


if __name__ == "__main__":
    main()
