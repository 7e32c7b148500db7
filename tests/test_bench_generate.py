"""The generation benchmarks on a CPU: bench_generate.py's --smoke run, its byte counts (the
weight-read limit, the states), the GPU's busy time and the goals' verdicts; bench_decode.py's
--smoke run with stand-ins for FLA's and FlashInfer's kernels (called as their APIs take them, one
failing)."""

import contextlib
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import kernels_reslin

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_decode  # noqa: E402
import bench_generate  # noqa: E402


def test_busy_time_counts_overlapping_operations_once():
    assert bench_generate.busy_us([(20, 25), (0, 10), (5, 12), (21, 22), (25, 26)]) == 18
    assert bench_generate.busy_us([]) == 0


def test_activity_sums_by_name_and_reads_a_profile_from_kineto():
    measured = bench_generate.activity([("mm", 0.0, 4.0), ("add", 2.0, 3.0), ("mm", 10.0, 11.0)])
    assert (measured.busy_us, measured.ops, measured.us_by_name) == (5.0, 3, {"mm": 5.0, "add": 1.0})
    # The same reading as on a GPU, of the CPU's operations: names and times in microseconds.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.ones(64, 64) @ torch.ones(64, 64)
    ops = bench_generate.kineto_ops(profile, torch.autograd.DeviceType.CPU)
    assert "aten::mm" in {name for name, _, _ in ops}
    assert all(0 <= end - start < 1e6 for _, start, end in ops)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_read_bytes_count_the_batch_rows_of_an_untied_embedding(tiny_model, tied):
    model = tiny_model("gdn", tie_word_embeddings=tied)
    every_weight = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab, hidden = model.get_input_embeddings().weight.shape
    for batch in (1, 3):
        unread_rows = 0 if tied else vocab - batch
        assert bench_generate.weight_read_bytes(model, batch) == every_weight - unread_rows * hidden * 4


def test_state_bytes_are_the_cache_read_and_written(tiny_model):
    """rdn's cache holds R beside gdn's S: the difference is R's bytes, read and written a step."""
    prompt = torch.randint(3, 100, (3, 6))
    gdn, rdn = (bench_generate.state_bytes(tiny_model(rule), prompt) for rule in ("gdn", "rdn"))
    config = tiny_model("rdn").config
    residual_state = config.num_hidden_layers * 3 * config.num_v_heads * config.head_dim * config.head_v_dim * 4
    assert rdn - gdn == 2 * residual_state
    assert gdn > 2 * residual_state  # S, and the short convolutions' windows


def test_tensor_bytes_count_each_storage_once_and_no_module():
    shared = torch.zeros(10)
    cache = types.SimpleNamespace(states=[{"a": shared, "b": shared}, (shared, torch.zeros(3, dtype=torch.bfloat16))],
                                  model=torch.nn.Linear(100, 100), note="text")
    assert bench_generate.tensor_bytes(cache) == 10 * 4 + 3 * 2


def test_table_gives_ratios_and_judges_the_default_loop_only(capsys):
    table = bench_generate.Table(copy_bw=1e12, top=0)

    def row(name, loop, B, tokens_per_s):
        measured = bench_generate.Measurement(tokens_per_s, 1e6 * B / tokens_per_s, 1.0, 2.0)
        table.row(name, loop, "fast", B, measured, weights=1e8, states=0)
        return capsys.readouterr().out.split()

    assert row("FLA gdn", "eager", 1, 100)[-1] == "1.0%"  # no ratio, no goal (its limit 100 us, its step 10 ms)
    assert row("gdn", "fast", 1, 2_500)[-5:] == ["25.00x", ">=", "2,000", "tok/s:", "met"]
    assert row("gdn", "hf", 1, 500)[-1] == "5.00x"
    assert row("kla", "fast", 1, 2_000)[-7:] == ["20.00x", "0.80x", ">=", "0.85x", "gdn:", "NOT", "met"]
    assert row("kla", "hf", 1, 450)[-2:] == ["4.50x", "0.90x"]
    assert row("gdn", "fast", 16, 21_000)[-5:] == ["13.1%", ">=", "20,000", "tok/s:", "met"]  # no FLA row at 16
    assert table.verdicts == [True, False, True]


def test_table_splits_a_step_into_gpu_and_host_time_and_lists_the_top_operations(capsys):
    table = bench_generate.Table(copy_bw=1e12, top=2)
    gpu = bench_generate.Activity(busy_us=300.0, ops=40, us_by_name=bench_generate.collections.Counter(
        {"gemv": 200.0, "norm": 30.0, "decode": 70.0}))
    table.row("gdn", "hf", "fast", 1, bench_generate.Measurement(1_000, 1_000.0, 5.0, 7.5, 12.25, gpu),
              weights=1e8, states=1e7)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[3:14] == ["1,000", "1000.0", "5.0", "7.50", "12.2", "300.0", "700.0", "40", "100.0", "10.0%",
                                      "110.0"]
    assert [line.split() for line in lines[2:]] == [["200.0", "us", "a", "step", "gemv"],
                                                    ["70.0", "us", "a", "step", "decode"]]


def test_smoke_run_prints_a_row_per_loop_and_the_goals(capsys):
    bench_generate.main(["--smoke", "--rules", "gdn", "--batches", "1", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("gdn ")]
    loops = [row[1] for row in rows]
    assert loops in (["fast", "hf"], ["default"])
    for row in rows:
        assert row[2] == "1" and float(row[3].replace(",", "")) != 0 and float(row[5]) > 0  # B, tok/s, prefill ms
        assert float(row[6]) != 0  # the first step (negative where the CPU's noise exceeds it)
        assert (row[7] == "-") == (row[1] == "hf")  # a capture's cost: our loop's only
        assert row[8:11] == ["-", "-", "-"]  # the GPU's and the host's times need CUDA
    assert re.fullmatch(r"goals: [01] of 1 met", lines[-1])


@pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")
def test_smoke_run_times_the_loops_asked_for(capsys, monkeypatch):
    """Each loop's row, each under its settings and the modules' own settings back after."""
    seen = []

    def spy(setting):
        @contextlib.contextmanager
        def spied(module, on):
            with setting(module, on):
                seen.append((module.__name__.rpartition(".")[2], on))
                yield
        return spied

    monkeypatch.setattr(bench_generate, "LOOPS", {loop: (fast, tuple((spy(setting), module, on)
                                                                      for setting, module, on in changes))
                                                  for loop, (fast, changes) in bench_generate.LOOPS.items()})
    bench_generate.main(["--smoke", "--rules", "gdn", "--batches", "1", "--repeats", "1", "--loops", "fast", "pdl",
                         "split"])
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("gdn ")] == [
        "fast", "pdl", "split"]
    assert seen == [("kernels_reslin_triton_launch", True), ("kernels_reslin_triton_gemv", True)]


@pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")
def test_decode_smoke_run_with_pdl_times_each_of_ours_both_ways(monkeypatch, capsys):
    monkeypatch.setattr(bench_decode, "import_fla", lambda: None)
    monkeypatch.setattr(bench_decode, "import_flashinfer_gdn", lambda: (None, "left out"))
    default = bench_decode.triton_launch.PROGRAMMATIC_LAUNCH_MAX_ROWS
    bench_decode.main(["--smoke", "--rules", "gdn", "rdn", "--batches", "1", "--heads", "2", "--repeats", "1", "--pdl"])
    rows = [line[:42].strip() for line in capsys.readouterr().out.splitlines()[4:]]
    assert rows == ["ours gdn", "ours gdn pdl", "ours rdn", "ours rdn pdl"]
    assert bench_decode.triton_launch.PROGRAMMATIC_LAUNCH_MAX_ROWS == default


@pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")
def test_decode_smoke_run_times_ours_and_every_anchor_as_their_apis_take_them(monkeypatch, capsys):
    B, H, D = 1, 2, 32
    calls = []

    def fla_step(q, k, v, g, beta, initial_state, output_final_state):
        assert q.shape == k.shape == v.shape == (B, 1, H, D) and g.shape == beta.shape == (B, 1, H)
        assert initial_state.shape == (B, H, D, D) and initial_state.dtype == torch.float32 and output_final_state
        calls.append("fla")
        return v.clone(), initial_state.clone()

    def flashinfer_decode(q, k, v, state, A_log, a, dt_bias, b, output, use_qk_l2norm):
        # FlashInfer's gated_delta_rule_decode: K-major fp32 state [B, HV, K, V], updated in place.
        assert q.shape == k.shape == v.shape == output.shape == (B, 1, H, D) and a.shape == b.shape == (B, 1, H)
        assert A_log.shape == dt_bias.shape == (H,) and A_log.dtype == torch.float32
        assert state.shape == (B, H, D, D) and state.dtype == torch.float32 and not use_qk_l2norm
        calls.append("flashinfer")
        return output, state

    def flashinfer_pretranspose(state, **inputs):
        assert state.dtype == torch.bfloat16
        raise RuntimeError("no kernel for this device\nsecond line")

    fla_module = types.ModuleType("fla.ops.gated_delta_rule")
    fla_module.fused_recurrent_gated_delta_rule = fla_step
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fla_module.__name__, fla_module)
    monkeypatch.setattr(bench_decode, "import_fla", lambda: sys.modules["fla"])
    flashinfer = types.SimpleNamespace(gated_delta_rule_decode=flashinfer_decode,
                                       gated_delta_rule_decode_pretranspose=flashinfer_pretranspose)
    monkeypatch.setattr(bench_decode, "import_flashinfer_gdn", lambda: (flashinfer, None))

    bench_decode.main(["--smoke", "--rules", "gdn", "rdn", "--batches", str(B), "--heads", str(H), "--repeats", "1"])
    rows = {line[:42].strip(): line[42:].split() for line in capsys.readouterr().out.splitlines()[4:]}
    assert list(rows) == ["ours gdn", "ours rdn", "FLA fused_recurrent (gdn)", "FlashInfer decode, fp32 state (gdn)",
                          "FlashInfer pretranspose, bf16 state (gdn)"]
    for name in ("ours gdn", "ours rdn", "FLA fused_recurrent (gdn)", "FlashInfer decode, fp32 state (gdn)"):
        assert rows[name][:2] == [str(H), str(B)] and float(rows[name][2]) > 0
    assert float(rows["ours rdn"][3]) == pytest.approx(2 * float(rows["ours gdn"][3]), rel=1e-3)  # S and R, S
    assert rows["FLA fused_recurrent (gdn)"][-1].endswith("x")
    assert rows["FlashInfer pretranspose, bf16 state (gdn)"][2:] == ["failed:", "RuntimeError:", "no", "kernel", "for",
                                                                    "this", "device"]
    assert "fla" in calls and "flashinfer" in calls
