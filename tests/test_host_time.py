"""tools/host_time.py: the host's time of a call with the Triton kernels stubbed out, and the
kernels it would launch; the stubs leave the module's real kernels in place afterwards."""

import re
import sys
from pathlib import Path

import pytest
import torch

import kernels_reslin
import kernels_reslin_triton_launch
from kernels_reslin import reslin_attention
from test_kernels import make_inputs

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")


def test_host_time_counts_the_launches_and_restores_the_kernels(capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import host_time

    real_launch = kernels_reslin_triton_launch._Launcher.__getitem__
    host_time.main(["--rules", "gdn", "--calls", "3"])
    line = re.search(r"gdn +forward +([\d.]+) us \((\d+) kernels\), training +([\d.]+) us \((\d+) kernels\)",
                     capsys.readouterr().out)
    assert line is not None
    forward_us, forward_kernels, training_us, training_kernels = map(float, line.groups())
    # Both timed, but not compared: with 3 calls on a loaded 2-core CI machine the forward once
    # took several times the training call's time. The counts say which does more.
    assert forward_us > 0 and training_us > 0
    assert forward_kernels == 4 and training_kernels > forward_kernels  # gram, WY, state, output
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = [make_inputs(1, 20, 2, 2, 16, 16, residual=False)[n].to(device) for n in ("q", "k", "v", "g", "beta")]
    o, _ = reslin_attention(*x, backend="triton")
    o_ref, _ = reslin_attention(*x, backend="recurrent")
    assert torch.allclose(o, o_ref, atol=1e-4)
    assert kernels_reslin_triton_launch._Launcher.__getitem__ is real_launch
