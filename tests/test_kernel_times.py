"""benchmarks/kernel_times.py on tiny sizes on a CPU (Triton's interpreter): every call's line gives
its kernels' total, its own time and the host's time to issue it, all positive."""

import re
import sys
from pathlib import Path

import pytest

import kernels_reslin

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")


def test_smoke_prints_kernel_call_and_host_times(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernel_times

    # --smoke's rules and a call each, on one head and one chunk: the interpreter's time goes with
    # the heads and chunks, and what is checked is that every figure is measured.
    kernel_times.main(["--rules", "gdn", "rdn", "--shapes", "1x64", "--heads", "1", "--dim", "32", "--repeats", "1",
                       "--backward"])
    pattern = r"ours: +([\d.]+) us in kernels, +([\d.]+) us per call, +([\d.]+) us of host to issue it"
    lines = re.findall(pattern, capsys.readouterr().out)
    assert len(lines) == 2  # gdn and rdn
    assert all(float(x) > 0 for line in lines for x in line)
