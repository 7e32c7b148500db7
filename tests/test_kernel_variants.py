"""benchmarks/kernel_variants.py --check on tiny sizes (Triton's interpreter on a CPU): a copy of
the kernel files matches the tree exactly, and a copy with a wrong state step shows its
difference, from the first variant and from the fp32 reference alike."""

import shutil
import sys
from pathlib import Path

import pytest

import kernels_reslin

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")
sys.path.insert(0, str(REPO / "benchmarks"))
import kernel_variants  # noqa: E402


def copy_of_kernel_files(folder):
    """`folder` made, with a copy of the tree's Triton kernel files: a variant as tools/variant.sh makes one."""
    folder.mkdir()
    for path in REPO.glob("kernels_reslin_triton*.py"):
        shutil.copy(path, folder)
    return folder


def test_check_tells_a_changed_kernel_from_a_copy(tmp_path, capsys):
    for name in ("same", "wrong"):
        copy_of_kernel_files(tmp_path / name)
    state = tmp_path / "wrong" / "kernels_reslin_triton_state.py"
    source = state.read_text()
    wrong = source.replace("return decay * S + _added(", "return 0.5 * decay * S + _added(")
    assert wrong != source
    state.write_text(wrong)
    # --smoke's sizes but one head (the interpreter's time goes with the heads): 70 tokens still
    # make two chunks, so the changed step shows in the final state.
    kernel_variants.main(["--check", "--backward", "--rules", "gdn", "rdn", "--shapes", "1x70", "--heads", "1",
                          "--dim", "32", "--repeats", "1", "--variant", f"now={REPO}",
                          "--variant", f"same={tmp_path / 'same'}", "--variant", f"wrong={tmp_path / 'wrong'}"])
    out = capsys.readouterr().out.splitlines()

    def figures(phrase, names):
        """The number ending each printed line that holds `phrase`, by variant name."""
        lines = [line.split() for line in out if phrase in line]
        return {name: [float(line[-1]) for line in lines if line[0] == name] for name in names}

    difference = figures("differs from now", ("same", "wrong"))
    assert difference["same"] == [0.0, 0.0]  # gdn and rdn
    assert len(difference["wrong"]) == 2 and min(difference["wrong"]) > 1e-2
    # Inputs in fp32 here: the kernels' error against the PyTorch reference is rounding (< 1e-4).
    error = figures("error against the fp32 reference", ("now", "same", "wrong"))
    assert len(error["now"]) == 2 and max(error["now"] + error["same"]) < 1e-4
    assert len(error["wrong"]) == 2 and min(error["wrong"]) > 1e-2


def test_rounds_time_every_variant_again_in_reverse_order(tmp_path, capsys):
    copy = copy_of_kernel_files(tmp_path / "copy")
    kernel_variants.main(["--rules", "sgla", "--shapes", "1x20", "--heads", "1", "--dim", "16", "--repeats", "1",
                          "--rounds", "3", "--variant", f"now={REPO}", "--variant", f"copy={copy}"])
    timed = [line.split() for line in capsys.readouterr().out.splitlines() if " call " in line]
    assert [line[0] for line in timed] == ["now", "copy", "copy", "now", "now", "copy"]
    assert all(line[-3] == "host" and float(line[-2]) > 0 for line in timed)
