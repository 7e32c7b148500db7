"""Chunked forward (no gradient) of reslin_attention against FLA 0.6.0's chunked kernels, same GPU, same run.

For each rule and shape (bf16 q, k, v; fp32 gates; H heads, Dk = Dv = D) it prints the median
time of `reslin_attention(..., backend=--backend)` and of FLA's kernel for the same recurrence
or its nearest one, when FLA is importable (carried as wheels):

    rule   FLA baseline              inputs given to FLA
    gdn    chunk_gated_delta_rule    the same q, k, v, g, beta (the same recurrence)
    kla    chunk_gated_delta_rule    the same, raw keys and beta = eta / (||k||^2 + eps) (the same recurrence)
    sgla   chunk_simple_gla          q, beta * k, v, g (the same recurrence: FLA has no beta)
    rla    chunk_simple_gla          as sgla: RLA's base pass alone
    rdn    chunk_gated_delta_rule    as gdn: RDN's base pass alone
    rkla   chunk_gated_delta_rule    as kla: RKLA's base pass alone

Goals (issue "Bundled Triton kernels for inference", backend "triton"): ours / FLA <= 1.0x for
gdn, kla and sgla; <= 1.6x for rla (against chunk_simple_gla) and rdn (against
chunk_gated_delta_rule), whose residual pass is a second recurrence; rkla is reported against
chunk_gated_delta_rule without a goal.

    python benchmarks/bench_forward.py [--shapes 8x2048 2x8192 1x32768] [--heads 16] [--dim 128]
                                       [--rules ...] [--backend triton|torch] [--repeats 10]
    python benchmarks/bench_forward.py --smoke   # tiny sizes; runs on a CPU (Triton interpreter, fp32)
"""

import argparse

import torch

from common import RULES, import_fla, median_ms, print_header, rule_inputs
from kernels_reslin import reslin_attention

GOALS = {"gdn": 1.0, "kla": 1.0, "sgla": 1.0, "rla": 1.6, "rdn": 1.6, "rkla": None}


def fla_baseline(fla, rule, x):
    """(name, zero-argument call) of the FLA kernel that `rule` is compared with, on `x`'s inputs."""
    update = RULES[rule][0]
    if update == "additive":
        k = x["k"] * x["beta"][..., None].to(x["k"].dtype)  # outside the timed call: FLA's sGLA has no beta
        return "chunk_simple_gla", lambda: fla.ops.simple_gla.chunk_simple_gla(x["q"], k, x["v"], g=x["g"])
    return "chunk_gated_delta_rule", lambda: fla.ops.gated_delta_rule.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"])


def parse_shape(text):
    B, T = text.lower().split("x")
    return int(B), int(T)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(8, 2048), (2, 8192), (1, 32768)],
                        help="BxT, e.g. 8x2048")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    parser.add_argument("--backend", default="triton", choices=["triton", "torch"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.heads, args.dim, args.repeats = [(1, 70)], 2, 32, 1

    fla = import_fla()
    H, D = args.heads, args.dim
    print_header(f"reslin_attention forward, backend {args.backend!r}, H={H} Dk=Dv={D}, "
                 f"median of {args.repeats} after warm-up")
    print(f"{'rule':5} {'shape':>9} {'ours ms':>9}   {'FLA baseline':22} {'FLA ms':>8} {'ours/FLA':>9}   goal")
    torch.manual_seed(0)
    with torch.no_grad():
        for rule in args.rules:
            for B, T in args.shapes:
                x = rule_inputs(rule, B, T, H, D)
                ours = median_ms(lambda: reslin_attention(**x, backend=args.backend), args.repeats)
                line = f"{rule:5} {f'{B}x{T}':>9} {ours:9.3f}"
                if fla is not None:
                    name, call = fla_baseline(fla, rule, x)
                    theirs = median_ms(call, args.repeats)
                    ratio = ours / theirs
                    goal = GOALS[rule]
                    verdict = "none" if goal is None else f"<= {goal:.1f}x {'met' if ratio <= goal else 'NOT met'}"
                    line += f"   {name:22} {theirs:8.3f} {ratio:8.2f}x   {verdict}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
