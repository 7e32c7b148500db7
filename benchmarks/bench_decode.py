"""One decode step of one layer (T = 1): our kernel against FLA's and FlashInfer's GDN decode, same run.

For every head count in --heads and batch size in --batches: our `reslin_decode_step` (Triton) for
every rule in --rules, then, for gdn, the anchors that import here:
- FLA 0.6.0's `fused_recurrent_gated_delta_rule` (its GatedDeltaNet layer's call for inputs of up
  to 64 tokens at inference; FLA has no separate one-token entry point for this rule), given the
  same inputs as ours (L2-normalised q and k, g and beta already formed), fp32 state [B, H, K, V];
- FlashInfer's `gdn_decode.gated_delta_rule_decode` (the serving engines' kernel), fp32 state
  [B, H, K, V] updated in place as ours, gates from their raw inputs (A_log, a, dt_bias, b) in the
  kernel as FlashInfer takes them;
- FlashInfer's `gdn_decode.gated_delta_rule_decode_pretranspose` with a bf16 state [B, H, V, K],
  its fast path: half the state bytes of the others.
An anchor that does not import is named in the header and left out; one that fails at its first
call is named in its row.

Each step is timed as generation runs it: --calls-per-graph calls captured in one CUDA graph,
the graph replayed --repeats times (CUDA events, median), the time per call printed; the host's
time is out of it. As in a model, where a layer's state is read once a step with every other
layer's weights and state read in between, the calls cycle through enough copies of the state to
pass the L2 cache twice (a graph takes as many calls as there are copies, if more than
--calls-per-graph): one state read again and again would stay in L2 up to ~50 MB. The state a
step reads and writes (S, and R for the residual rules, each read and written once) is set against
the device-to-device copy bandwidth measured at the start (bytes read + written / time).

    python benchmarks/bench_decode.py [--heads 8 16] [--dim 128] [--batches 1 16 64] [--rules ...] [--pdl]
    python benchmarks/bench_decode.py --smoke   # tiny sizes, Triton's CPU interpreter in fp32, eager timing
"""

import argparse
import math

import torch

from common import (DEVICE, DTYPE, RULES, copies_past_l2, import_fla, median_ms, print_header,
                    programmatic_launch, rule_inputs, us_per_call)
from kernels_reslin import reslin_decode_step
import kernels_reslin_triton_launch as triton_launch


def copy_bandwidth(nbytes=2**31):
    """Bytes read + written per second by a copy of `nbytes` within the device (median of 10)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src)) / 1e3)


def import_flashinfer_gdn():
    """(flashinfer.gdn_decode or None, why not). Its import runs FlashInfer's whole package
    set-up, which fails with other errors than ImportError where a CUDA library or its compiler
    stack is missing: any failure leaves the anchor out, with the reason printed."""
    if DEVICE != "cuda":
        return None, "skipped on the CPU"
    try:
        from flashinfer import gdn_decode
    except Exception as error:  # noqa: BLE001 - see the docstring
        return None, f"not importable ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return gdn_decode, None


def flashinfer_gate_inputs(B, H):
    """FlashInfer's raw gate inputs: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b),
    drawn as a GDN layer's are at initialisation (A_log = log U(1, 16))."""
    return dict(A_log=torch.empty(H, device=DEVICE).uniform_(1, 16).log(),
                a=torch.randn(B, 1, H, device=DEVICE, dtype=DTYPE),
                dt_bias=torch.randn(H, device=DEVICE),
                b=torch.randn(B, 1, H, device=DEVICE, dtype=DTYPE))


def gdn_anchors(fla, flashinfer, x, B, H, D):
    """[(name, call, state bytes a call reads and writes, copies of the state its calls cycle
    through)] of the importable GDN anchors on the inputs `x` of ours."""
    anchors = []
    shape = (B, H, D, D)
    if fla is not None:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        next_fla_state, copies = copies_past_l2(lambda: torch.randn(shape, device=DEVICE) * 0.1, math.prod(shape) * 4)
        anchors.append(("FLA fused_recurrent (gdn)", lambda: fused_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=next_fla_state(), output_final_state=True),
            2 * math.prod(shape) * 4, copies))
    if flashinfer is not None:
        gates = flashinfer_gate_inputs(B, H)
        output = torch.empty(B, 1, H, D, device=DEVICE, dtype=torch.bfloat16)
        for name, decode, dtype in (
                ("FlashInfer decode, fp32 state (gdn)", flashinfer.gated_delta_rule_decode, torch.float32),
                ("FlashInfer pretranspose, bf16 state (gdn)", flashinfer.gated_delta_rule_decode_pretranspose,
                 torch.bfloat16)):
            state_bytes = math.prod(shape) * dtype.itemsize
            next_state, copies = copies_past_l2(
                lambda dtype=dtype: (torch.randn(shape, device=DEVICE) * 0.1).to(dtype), state_bytes)
            anchors.append((name, lambda decode=decode, next_state=next_state: decode(
                q=x["q"], k=x["k"], v=x["v"], state=next_state(), output=output, use_qk_l2norm=False, **gates),
                2 * state_bytes, copies))
    return anchors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", help="default 8 16 (--smoke: 2)")
    parser.add_argument("--dim", type=int, help="Dk = Dv, default 128 (--smoke: 32)")
    parser.add_argument("--batches", type=int, nargs="+", help="default 1 16 64 (--smoke: 1 2)")
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    parser.add_argument("--calls-per-graph", type=int, default=20,
                        help="steps captured back to back in one graph (a model's step has one a layer)")
    parser.add_argument("--repeats", type=int, help="replays timed, the median printed; default 10 (--smoke: 2)")
    parser.add_argument("--pdl", action="store_true",
                        help="ours also under programmatic dependent launch (kernels_reslin_triton_launch."
                             "PROGRAMMATIC_LAUNCH_MAX_ROWS, here for every batch size), a row 'ours RULE pdl' "
                             "after each of ours, which runs without it")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself (runs on a CPU)")
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.heads = args.heads or ([2] if smoke else [8, 16])
    args.dim = args.dim or (32 if smoke else 128)
    args.batches = args.batches or ([1, 2] if smoke else [1, 16, 64])
    args.repeats = args.repeats or (2 if smoke else 10)
    copy_bytes = 2**24 if smoke else 2**31

    fla = import_fla()
    flashinfer, flashinfer_missing = import_flashinfer_gdn()
    copy_bw = copy_bandwidth(copy_bytes)
    print_header(f"decode step, Dk = Dv = {args.dim}, {str(DTYPE).removeprefix('torch.')} inputs, fp32 states "
                 f"(but where named); copy bandwidth {copy_bw / 1e12:.3g} TB/s (read + write)")
    print(f"FlashInfer {flashinfer_missing or 'gdn_decode imported'}")
    print(f"{'kernel':42} {'H':>3} {'B':>3} {'us/step':>8} {'state MB':>9} {'TB/s':>6} {'% copy':>7} "
          f"{'ours gdn / it':>13}")
    for H in args.heads:
        for B in args.batches:
            ours_gdn_us = None
            for rule in args.rules:
                _, residual, _ = RULES[rule]
                x = rule_inputs(rule, B, 1, H, args.dim)
                shape = (B, H, args.dim, args.dim)
                state_bytes = (2 if residual else 1) * math.prod(shape) * 4
                next_state, copies = copies_past_l2(lambda: (
                    torch.randn(shape, device=DEVICE) * 0.1,
                    torch.randn(shape, device=DEVICE) * 0.1 if residual else None), state_bytes)
                for pdl in (False, True) if args.pdl else (False,):
                    with programmatic_launch(triton_launch, pdl):
                        us = us_per_call(lambda: reslin_decode_step(**x, state=next_state(), backend="triton"),
                                         max(args.calls_per_graph, copies), args.repeats)
                    print_row(f"ours {rule}{' pdl' if pdl else ''}", H, B, us, 2 * state_bytes, copy_bw)
                    if rule == "gdn" and not pdl:
                        ours_gdn_us = us
            x = rule_inputs("gdn", B, 1, H, args.dim)
            for name, call, state_bytes, copies in gdn_anchors(fla, flashinfer, x, B, H, args.dim):
                try:
                    us = us_per_call(call, max(args.calls_per_graph, copies), args.repeats)
                except Exception as error:  # noqa: BLE001 - one anchor failing leaves the others' rows
                    print(f"{name:42} {H:3d} {B:3d} failed: {type(error).__name__}: {str(error).splitlines()[0]}")
                    continue
                print_row(name, H, B, us, state_bytes, copy_bw, ours_gdn_us)


def print_row(name, H, B, us, state_bytes, copy_bw, ours_gdn_us=None):
    bandwidth = state_bytes / (us / 1e6)
    ratio = "" if ours_gdn_us is None else f"{ours_gdn_us / us:.2f}x"
    print(f"{name:42} {H:3d} {B:3d} {us:8.2f} {state_bytes / 1e6:9.4g} {bandwidth / 1e12:6.2f} "
          f"{100 * bandwidth / copy_bw:6.1f}% {ratio:>13}", flush=True)


if __name__ == "__main__":
    main()
