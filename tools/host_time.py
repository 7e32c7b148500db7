"""The host's time of one reslin_attention call (Triton backend) without its kernels, on any machine:
every Triton kernel's launch (kernels_reslin_triton_launch._Launcher) replaced by one that does
nothing, tiny tensors on the CPU. What remains is the Python, dispatch and autograd around the
kernels, so changes to that code can be timed without a GPU. The launches' own host time (tens
of microseconds each on a GPU machine) and the GPU's work are not in it.

    python tools/host_time.py [--rules sgla gdn rla rdn] [--calls 200]

Prints, per rule, the microseconds per call of a forward without gradient and of a training call
(forward, loss and torch.autograd.grad of every input, as bench_forward.py --backward times it),
and how many kernels each would launch.
"""

import argparse
import contextlib
import os
import sys
from unittest import mock

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import torch  # noqa: E402

import kernels_reslin_triton_launch  # noqa: E402
from bench_forward import rule_calls  # noqa: E402
from common import RULES, host_ms  # noqa: E402


class _CountingLaunch:
    """`counting_getitem` stands in for `_Launcher.__getitem__`: `kernel[grid](...)` only counts
    the launch."""

    launches = 0

    @staticmethod
    def counting_getitem(launcher, grid):
        def launch(*args, **kwargs):
            _CountingLaunch.launches += 1
        return launch


@contextlib.contextmanager
def kernels_stubbed_out():
    """Every kernel of every Triton module launches nothing while in the block."""
    with mock.patch.object(kernels_reslin_triton_launch._Launcher, "__getitem__", _CountingLaunch.counting_getitem), \
            mock.patch.dict(os.environ, TRITON_INTERPRET="1"):  # backend="triton" takes CPU tensors then
        yield


def host_us(call, calls):
    """(microseconds per call, kernels launched per call) after a few warm-up calls."""
    for _ in range(5):
        call()
    _CountingLaunch.launches = 0
    call()
    launches = _CountingLaunch.launches
    return 1e3 * host_ms(call, calls), launches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=["sgla", "gdn", "rla", "rdn"])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"host time per reslin_attention call, Triton kernels stubbed out, B1 x T64, H2, D16, CPU, "
          f"torch {torch.__version__}")
    with kernels_stubbed_out():
        for rule in args.rules:
            row = []
            for backward in (False, True):
                call, _ = rule_calls(None, rule, 1, 64, 2, 16, "triton", backward)
                with torch.enable_grad() if backward else torch.no_grad():
                    us, launches = host_us(call, args.calls)
                row.append(f"{'training' if backward else 'forward'} {us:7.1f} us ({launches} kernels)")
            print(f"{rule:5s} " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
