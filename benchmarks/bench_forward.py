"""Chunked forward (no gradient), or with --backward forward + backward, of reslin_attention against
FLA 0.6.0's chunked kernels, same GPU, same run.

For each rule and shape (bf16 q, k, v; fp32 gates; H heads, Dk = Dv = D) it prints the time of
`reslin_attention(..., backend=--backend)` and of FLA's kernel for the same recurrence or its
nearest one, when FLA is importable (carried as wheels). Every call of a shape is timed in
--rounds interleaved rounds (each the median of --repeats calls) and the median round is kept:
FLA's calls are partly bound by their host side, and one timing per row varied up to 1.9x for
the same call. FLA is timed once per baseline and shape, on the inputs of the first
rule compared with it (its time does not depend on the values), so every row of a baseline
shares one denominator:

    rule   FLA baseline              inputs given to FLA
    gdn    chunk_gated_delta_rule    the same q, k, v, g, beta (the same recurrence)
    kla    chunk_gated_delta_rule    the same, raw keys and beta = eta / (||k||^2 + eps) (the same recurrence)
    sgla   chunk_simple_gla          q, beta * k, v, g (the same recurrence: FLA has no beta)
    rla    chunk_simple_gla          as sgla: RLA's base pass alone
    rdn    chunk_gated_delta_rule    as gdn: RDN's base pass alone
    rkla   chunk_gated_delta_rule    as kla: RKLA's base pass alone

With --backward each timed call is a training call: fp32 initial states (S0, and R0 for the
residual rules) are given too, loss = (o * w).sum() with a fixed random bf16 w, and
torch.autograd.grad takes the gradient of every input: ours q, k, v, g, beta, gamma,
gamma_write (rkla) and the initial states; FLA's q, k (beta * k for simple GLA), v, g, beta
(delta rule) and its initial state. FLA 0.6.0 refuses its gated backward on Hopper with
triton < 3.7.1 (wrong values, FLA issue 640): the guard is lifted for timing
(common.lift_fla_backward_guard), and a note beside the table says so when it was.

Goals, ours / FLA, backend "triton":
- forward (issue "Bundled Triton kernels for inference"): <= 1.0x for gdn, kla and sgla; <= 1.6x
  for rla (against chunk_simple_gla) and rdn (against chunk_gated_delta_rule), whose residual
  pass is a second recurrence.
- forward + backward (issue "Triton backward for training"): <= 1.0x for gdn, kla and sgla;
  <= 1.7x for rla and rdn.
rkla is reported against chunk_gated_delta_rule without a goal.

With --retune-fla FLA's kernels are tuned afresh before every round (common.retune_fla), and
FLA's figure is its fastest round: the ratio against FLA's best pick of its configs, rather than
against whichever pick a run's one tuning made. Without it the goal is judged against FLA's
median round, and the last column gives the ratio against FLA's fastest round of the run too:
FLA's host-bound calls vary between rounds by more than some goals' margins.

With --graphs every timed call, ours and FLA's, is captured once in a CUDA graph after its
warm-up and timed by replaying it (common.graph_replay): the host's time leaves both sides, so
that FLA's call is timed at its GPU-bound speed whatever the host. On the H200 machine FLA's
calls are partly bound by a host whose speed differs between machine starts (its delta rule's
training call at B2 x T8192 took 2.3 to 3.7 ms in different starts): without graphs a slow host
flatters the ratios. A call that cannot be captured is timed eagerly, and a line says so.

    python benchmarks/bench_forward.py [--shapes 8x2048 2x8192 1x32768] [--heads 16] [--dim 128]
                                       [--rules ...] [--backend triton|torch] [--repeats 10]
                                       [--rounds 3] [--retune-fla | --graphs]
    python benchmarks/bench_forward.py --backward   # shapes default to 8x2048 2x8192
    python benchmarks/bench_forward.py --smoke [--backward]   # tiny sizes; runs on a CPU (Triton interpreter, fp32)
"""

import argparse
import contextlib
import statistics

import torch

from common import (DEVICE, RULES, graph_replay, import_fla, lift_fla_backward_guard, median_ms, print_header,
                    retune_fla, rule_inputs)
from kernels_reslin import reslin_attention

GOALS = {"gdn": 1.0, "kla": 1.0, "sgla": 1.0, "rla": 1.6, "rdn": 1.6, "rkla": None}
BACKWARD_GOALS = {"gdn": 1.0, "kla": 1.0, "sgla": 1.0, "rla": 1.7, "rdn": 1.7, "rkla": None}
SHAPES = [(8, 2048), (2, 8192), (1, 32768)]
BACKWARD_SHAPES = [(8, 2048), (2, 8192)]


def fla_baseline(fla, rule, x, S0=None):
    """(name, zero-argument call returning FLA's output, the tensors it reads that a backward
    differentiates) of the FLA kernel that `rule` is compared with, on `x`'s inputs."""
    update = RULES[rule][0]
    if update == "additive":
        # Outside the timed call (FLA's sGLA has no beta); a leaf of its own for the backward.
        k = (x["k"] * x["beta"][..., None].to(x["k"].dtype)).detach().requires_grad_(x["k"].requires_grad)
        return ("chunk_simple_gla",
                lambda: fla.ops.simple_gla.chunk_simple_gla(x["q"], k, x["v"], g=x["g"], initial_state=S0)[0],
                [x["q"], k, x["v"], x["g"], S0])
    return ("chunk_gated_delta_rule",
            lambda: fla.ops.gated_delta_rule.chunk_gated_delta_rule(
                x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=S0)[0],
            [x["q"], x["k"], x["v"], x["g"], x["beta"], S0])


def forward_backward(call, inputs, weight):
    """A zero-argument call of `call`, loss = (o * weight).sum() and the gradients of `inputs`.
    torch.autograd.grad returns them without accumulating into .grad, so repeats do the same work."""
    inputs = [t for t in inputs if t is not None]

    def run():
        torch.autograd.grad((call() * weight).sum(), inputs)
    return run


def rule_calls(fla, rule, B, T, H, D, backend, backward):
    """Zero-argument calls of one rule and shape, forward or with `backward` a training call (see
    the module's docstring): (ours, (FLA's baseline name, its call) or None without FLA)."""
    x = rule_inputs(rule, B, T, H, D)
    S0 = R0 = weight = None
    ours = lambda: reslin_attention(**x, backend=backend)  # noqa: E731
    if backward:
        x = {name: t.requires_grad_() if torch.is_tensor(t) else t for name, t in x.items()}
        state = lambda: torch.zeros(B, H, D, D, device=x["v"].device, requires_grad=True)  # noqa: E731
        S0, R0 = state(), (state() if x["gamma"] is not None else None)
        weight = torch.randn_like(x["v"])
        ours = forward_backward(
            lambda: reslin_attention(**x, initial_state=(S0, R0), backend=backend)[0],
            [x[name] for name in ("q", "k", "v", "g", "beta", "gamma", "gamma_write")] + [S0, R0], weight)
    if fla is None:
        return ours, None
    name, call, inputs = fla_baseline(fla, rule, x, S0)
    return ours, (name, forward_backward(call, inputs, weight) if backward else call)


def captured(name, call):
    """`call` replayed from a CUDA graph, or `call` itself, with a line saying why, where it cannot
    be captured."""
    try:
        return graph_replay(call)
    except Exception as error:  # a call that syncs with the host, say: timed eagerly, and said so
        print(f"{name}: not captured in a CUDA graph ({type(error).__name__}: {str(error).splitlines()[0][:200]});"
              " timed eagerly", flush=True)
        return call


def parse_shape(text):
    B, T = text.lower().split("x")
    return int(B), int(T)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                        help="BxT, e.g. 8x2048 (default 8x2048 2x8192 1x32768; with --backward 8x2048 2x8192)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    parser.add_argument("--backend", default="triton", choices=["triton", "torch"])
    parser.add_argument("--backward", action="store_true", help="time forward + backward (a training call)")
    parser.add_argument("--repeats", type=int, default=10, help="calls per timing (their median)")
    parser.add_argument("--rounds", type=int, default=3, help="timings of every call, interleaved")
    parser.add_argument("--retune-fla", action="store_true",
                        help="tune FLA's kernels afresh every round and take FLA's fastest round")
    parser.add_argument("--graphs", action="store_true",
                        help="time every call, ours and FLA's, replayed from a CUDA graph (no host time)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself")
    args = parser.parse_args()
    if args.graphs and DEVICE != "cuda":
        parser.error("--graphs needs a CUDA device")
    if args.graphs and args.retune_fla:
        parser.error("--graphs fixes FLA's tuning at the capture: it cannot retune every round")
    if args.shapes is None:
        args.shapes = BACKWARD_SHAPES if args.backward else SHAPES
    if args.smoke:
        args.shapes, args.heads, args.dim, args.repeats, args.rounds = [(1, 70)], 2, 32, 1, 2

    fla = import_fla()
    note = lift_fla_backward_guard() if fla is not None and args.backward else None
    goals = BACKWARD_GOALS if args.backward else GOALS
    H, D = args.heads, args.dim
    what = "forward + backward" if args.backward else "forward"
    print_header(f"reslin_attention {what}, backend {args.backend!r}, H={H} Dk=Dv={D}, median over "
                 f"{args.rounds} interleaved rounds of the median of {args.repeats} calls, after warm-up")
    print("FLA's time is one figure per baseline and shape, shared by the rules compared with it; the range "
          "over the rounds beside each figure, ours and FLA's (host-bound calls vary)")
    if args.retune_fla:
        print("FLA's kernels tuned afresh every round; FLA's figure is its fastest round")
    if args.graphs:
        print("every call, ours and FLA's, replayed from a CUDA graph: the host's time left out of both")
    if note:
        print(note)
    print(f"{'rule':5} {'shape':>9} {'ours ms':>9} {'ours range':>15}   {'FLA baseline':22} {'FLA ms':>8} "
          f"{'FLA range':>15} {'ours/FLA':>9}   " + ("goal" if args.retune_fla else f"{'goal':16} vs FLA fastest"))
    torch.manual_seed(0)
    with contextlib.nullcontext() if args.backward else torch.no_grad():
        for B, T in args.shapes:
            calls = {rule: rule_calls(fla, rule, B, T, H, D, args.backend, args.backward) for rule in args.rules}
            baselines = {}  # FLA's call on the inputs of the first rule that uses it (its time is data-blind)
            for _, fla_call in calls.values():
                if fla_call is not None:
                    baselines.setdefault(*fla_call)
            if args.graphs:
                calls = {rule: (captured(rule, ours), fla_call) for rule, (ours, fla_call) in calls.items()}
                baselines = {name: captured(name, call) for name, call in baselines.items()}
            times = {name: [] for name in (*calls, *baselines)}
            for _ in range(args.rounds):
                if args.retune_fla and fla is not None:
                    retune_fla()
                for name, call in [(rule, ours) for rule, (ours, _) in calls.items()] + list(baselines.items()):
                    times[name].append(median_ms(call, args.repeats))
            spread = lambda name: f"{min(times[name]):.3f}-{max(times[name]):.3f}"  # noqa: E731
            for rule, (_, fla_call) in calls.items():
                ours = statistics.median(times[rule])
                line = f"{rule:5} {f'{B}x{T}':>9} {ours:9.3f} {spread(rule):>15}"
                if fla_call is not None:
                    name = fla_call[0]
                    theirs = (min if args.retune_fla else statistics.median)(times[name])
                    ratio = ours / theirs
                    goal = goals[rule]
                    verdict = "none" if goal is None else f"<= {goal:.1f}x {'met' if ratio <= goal else 'NOT met'}"
                    line += f"   {name:22} {theirs:8.3f} {spread(name):>15} {ratio:8.2f}x   "
                    if args.retune_fla:
                        line += verdict
                    else:
                        line += f"{verdict:16} {ours / min(times[name]):13.2f}x"
                print(line, flush=True)


if __name__ == "__main__":
    main()
