"""One-token decode step of one layer: ResLin's Triton kernel against FLA, same GPU, same run.

For each rule and batch size it prints the time of one `reslin_decode_step` call, Python
included (a loop of calls, synchronised at the end); the same step replayed from a CUDA graph,
the way `generate` runs it (config `decode_cuda_graphs`), Python of the replay included; the state bytes it moves (S, and R for the
residual rules, each read and written once, fp32) as bandwidth and as a share of the
device-to-device copy bandwidth measured at the start of the run, and, for GDN, the same for
FLA 0.6.0's fused_recurrent_gated_delta_rule when FLA is importable (carried as wheels).

Goals (issue "Bundled Triton kernels for inference"): >= 60% of copy bandwidth at B = 64 and
<= 20 us per layer step at B = 1, Python included. FLA's column is its eager call.

    python benchmarks/bench_decode.py [--heads 16] [--dim 128] [--steps 200]
"""

import argparse
import time

import torch

from common import RULES, graph_replay, import_fla, print_header, rule_inputs
from kernels_reslin import reslin_decode_step


def copy_bandwidth(gib=2):
    src = torch.randn(gib * 2**28, device="cuda")
    dst = torch.empty_like(src)
    seconds = per_call(lambda: dst.copy_(src), 20)
    return 2 * src.numel() * 4 / seconds


def per_call(fn, steps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    fla = import_fla()
    H, D = args.heads, args.dim
    copy_bw = copy_bandwidth()
    print_header(f"decode step, H={H} Dk=Dv={D}, bf16 inputs, fp32 states; copy bandwidth "
                 f"{copy_bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'rule':5} {'B':>3} {'us/step':>8} {'TB/s':>6} {'% copy':>7} {'graph us':>8}   {'FLA us':>7} {'FLA % copy':>10}")
    for name, (_, residual, _) in RULES.items():
        for B in args.batches:
            x = rule_inputs(name, B, 1, H, D)
            shape = (B, H, D, D)
            state = (torch.randn(shape, device="cuda") * 0.1, torch.randn(shape, device="cuda") * 0.1 if residual else None)
            step = lambda: reslin_decode_step(**x, state=state)  # noqa: E731
            seconds = per_call(step, args.steps)
            graph_seconds = per_call(graph_replay(step), args.steps)
            state_bytes = 2 * (2 if residual else 1) * B * H * D * D * 4
            line = (f"{name:5} {B:3d} {seconds * 1e6:8.1f} {state_bytes / seconds / 1e12:6.2f} "
                    f"{100 * state_bytes / seconds / copy_bw:6.1f}% {graph_seconds * 1e6:8.1f}")
            if name == "gdn" and fla is not None:
                fla_seconds = per_call(lambda: fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule(
                    x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=state[0],
                    output_final_state=True), args.steps)
                line += f"   {fla_seconds * 1e6:7.1f} {100 * state_bytes / fla_seconds / copy_bw:9.1f}%"
            print(line)


if __name__ == "__main__":
    main()
