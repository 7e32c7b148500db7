"""benchmarks/common.py and the timing it gives the benchmarks: retune_fla finds every autotuned
kernel of FLA's modules, also under triton.heuristics, and makes it tune again without the disk
cache; fla_picks says what they picked; copies_past_l2 cycles through enough copies to pass the L2
cache; bench_forward's rounds and graphs."""

import sys
import types
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

REPO = Path(__file__).resolve().parents[1]


@triton.jit
def _copy_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets))


def _tuned():
    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    return triton.autotune(configs=configs, key=[])(_copy_kernel)


def test_retune_fla_clears_every_fla_autotuner_and_its_disk_cache(monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import common

    plain, under_heuristics, elsewhere = _tuned(), _tuned(), _tuned()
    fla_module = types.ModuleType("fla.ops.fake_for_test")
    fla_module.plain = plain
    fla_module.under_heuristics = triton.heuristics({"EXTRA": lambda args: 1})(under_heuristics)
    fla_module.not_a_kernel = 3
    other_module = types.ModuleType("not_fla_for_test")
    other_module.kernel = elsewhere
    monkeypatch.setitem(sys.modules, fla_module.__name__, fla_module)
    monkeypatch.setitem(sys.modules, other_module.__name__, other_module)
    for tuner in (plain, under_heuristics, elsewhere):
        tuner.cache[("key",)] = tuner.configs[0]
        tuner.cache_results = True  # as FLA asks by default (the interpreter turns it off)

    tuners = common.fla_autotuners()
    assert plain in tuners and under_heuristics in tuners and elsewhere not in tuners
    picked = "BLOCK=16, num_warps=4, num_ctas=1, num_stages=3"
    assert common.fla_picks() == {"_copy_kernel": [picked, picked]}  # the two FLA tuners, one shape each
    common.retune_fla()
    assert plain.cache == {} and under_heuristics.cache == {}
    assert not plain.cache_results and not under_heuristics.cache_results
    assert elsewhere.cache == {("key",): elsewhere.configs[0]} and elsewhere.cache_results


def test_bench_forward_judges_the_median_round_and_gives_the_fastest_round_beside(monkeypatch, capsys):
    """Against FLA's median round the goal's verdict; against its fastest round the last column
    (the figures the README quotes). With --retune-fla the fastest round is the verdict's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_forward

    ours_call, fla_call = object(), object()
    rounds = {ours_call: iter([1.0, 0.8, 0.9]), fla_call: iter([0.5, 1.0, 0.8])}  # medians 0.9 and 0.8
    monkeypatch.setattr(bench_forward, "import_fla", lambda: types.SimpleNamespace())
    monkeypatch.setattr(bench_forward, "rule_calls", lambda *args: (ours_call, ("chunk_baseline", fla_call)))
    monkeypatch.setattr(bench_forward, "median_ms", lambda call, repeats: next(rounds[call]))
    monkeypatch.setattr(sys, "argv", ["bench_forward.py", "--rules", "gdn", "--shapes", "1x64"])
    bench_forward.main()
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[:3] == ["gdn", "1x64", "0.900"]
    assert row[-6:] == ["1.12x", "<=", "1.0x", "NOT", "met", "1.80x"]  # 0.9 / 0.8, 0.9 / 0.5

    rounds = {ours_call: iter([1.0, 0.8, 0.9]), fla_call: iter([0.5, 1.0, 0.8])}
    monkeypatch.setattr(bench_forward, "retune_fla", lambda: None)
    monkeypatch.setattr(sys, "argv", ["bench_forward.py", "--rules", "gdn", "--shapes", "1x64", "--retune-fla"])
    bench_forward.main()
    assert capsys.readouterr().out.splitlines()[-1].split()[-5:] == ["1.80x", "<=", "1.0x", "NOT", "met"]


def test_bench_forward_with_graphs_replays_every_call_and_refuses_what_it_cannot_do(monkeypatch, capsys):
    """--graphs times ours and FLA's calls replayed from CUDA graphs (a call that cannot be
    captured is timed eagerly, and a line says so); it needs CUDA and cannot retune FLA."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_forward

    ours_call, fla_call = object(), object()
    graphed = {ours_call: object(), fla_call: object()}
    rounds = {graphed[ours_call]: iter([1.0, 1.0, 1.0]), graphed[fla_call]: iter([0.5, 0.5, 0.5])}
    monkeypatch.setattr(bench_forward, "DEVICE", "cuda")
    monkeypatch.setattr(bench_forward, "import_fla", lambda: types.SimpleNamespace())
    monkeypatch.setattr(bench_forward, "rule_calls", lambda *args: (ours_call, ("chunk_baseline", fla_call)))
    monkeypatch.setattr(bench_forward, "graph_replay", lambda call: graphed[call])
    monkeypatch.setattr(bench_forward, "median_ms", lambda call, repeats: next(rounds[call]))
    monkeypatch.setattr(sys, "argv", ["bench_forward.py", "--rules", "gdn", "--shapes", "1x64", "--graphs"])
    bench_forward.main()
    out = capsys.readouterr().out
    assert "replayed from a CUDA graph" in out
    assert out.splitlines()[-1].split()[-6:] == ["2.00x", "<=", "1.0x", "NOT", "met", "2.00x"]

    def refuses(call):
        raise RuntimeError("operation not permitted when stream is capturing")
    rounds = {ours_call: iter([1.0, 1.0, 1.0]), fla_call: iter([0.5, 0.5, 0.5])}
    monkeypatch.setattr(bench_forward, "graph_replay", refuses)
    bench_forward.main()
    out = capsys.readouterr().out
    assert "gdn: not captured in a CUDA graph (RuntimeError: operation not permitted" in out
    assert "chunk_baseline: not captured in a CUDA graph" in out
    assert out.splitlines()[-1].split()[2] == "1.000"

    for argv, device in ((["--graphs", "--retune-fla"], "cuda"), (["--graphs"], "cpu")):
        monkeypatch.setattr(bench_forward, "DEVICE", device)
        monkeypatch.setattr(sys, "argv", ["bench_forward.py", *argv])
        with pytest.raises(SystemExit):
            bench_forward.main()


def test_copies_past_l2_cycle_through_enough_copies_to_pass_the_l2_cache_twice(monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import common

    made = []

    def make():
        made.append(object())
        return made[-1]

    monkeypatch.setattr(common, "DEVICE", "cuda")
    next_copy, count = common.copies_past_l2(make, 30 * 2**20)  # 100 MiB / 30 MiB: 4 copies
    assert count == 4 and made and len(made) == 4
    assert [next_copy() for _ in range(6)] == made + made[:2]
    assert common.copies_past_l2(make, 3 * common.L2_BYTES)[1] == 1  # one copy larger than the cache
    monkeypatch.setattr(common, "DEVICE", "cpu")
    assert common.copies_past_l2(make, 2**10)[1] == 1  # nothing to pass on the CPU
