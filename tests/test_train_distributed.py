"""train.py in two processes, DDP and FSDP2, started by `accelerate launch` with the configs in
accelerate_configs/: on the CPU (gloo), and on two GPUs (NCCL, bf16) in the `gpu` tests.

CPU runs: the tiny model of test_train.py (torch kernels) on a corpus of short documents, so that
the two processes' halves of a batch hold different numbers of predicted tokens (a document's
first token predicts nothing): a loss averaged per process would show. Two fp32 processes differ
from one only in the order of floating-point sums: losses, validation figures and weights agree
to LOSS_RTOL relative (measured: 2e-7 or less).

FSDP2 on the CPU: accelerate 1.15 turns FSDP on for GPUs only, and on CPUs silently trains with
DDP. tests/launch_train.py lets accelerate take FSDP there (torch's FSDP2 itself runs with gloo),
so the CPU tests run train.py's FSDP2 path: sharding by ResLinBlock, gathered checkpoints, resume.

GPU runs (bf16 autocast, Triton kernels): two GPUs against one within BF16_RTOL. Measured on
2 x H200 (2026-11-30), largest relative difference of the 20 losses: 2.1e-4 under DDP, 5.0e-4
under FSDP2 (then within a looser 2e-2); BF16_RTOL is 10x the larger.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import train
from conftest import REPO_ROOT
from test_train import TINY_MODEL, tiny_run_args

CONFIGS = REPO_ROOT / "accelerate_configs"
LAUNCHER = REPO_ROOT / "tests" / "launch_train.py"
# 40 documents of 1 to 5 short functions: rows of 64 tokens hold several document starts.
CORPUS = {f"module_{i}.py": "".join(f"def add_{i}_{j}(a, b):\n    return a + b * {j}\n\n" for j in range(1 + i % 5))
          for i in range(40)}
# Validation at steps 0, 10 and 20, checkpoints at 10 and 20 (test_train.tiny_run_args gives the intervals).
RUN = ("--max-steps", "20", "--tie-word-embeddings")
CPU_RUN = (*RUN, "--device", "cpu")  # also where CUDA is there
LOSS_RTOL = 1e-5
GPU_RUN = (*RUN, "--device", "cuda", "--hidden-size", "128", "--heads", "2", "--head-dim", "64", "--intermediate-size",
           "256", "--kernel-backend", "auto")  # later flags override tiny_run_args's
BF16_RTOL = 5e-3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for name, text in CORPUS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def one_process(corpus, data_dir, tmp_path_factory):
    """(out_dir, metrics) of the reference run, in this process."""
    out_dir = tmp_path_factory.mktemp("one") / "out"
    return out_dir, train.main(tiny_run_args(corpus, data_dir, out_dir, *CPU_RUN))


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(config, argv, **env):
    """`accelerate launch --config_file accelerate_configs/CONFIG tests/launch_train.py ARGV`, on
    a port of its own (tests run side by side), or with config None `python tests/launch_train.py
    ARGV`; its CompletedProcess, with `seconds`."""
    command = [sys.executable, str(LAUNCHER), *map(str, argv)]
    if config is not None:
        command[1:1] = ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
                        "--main_process_port", str(free_port())]
    start = time.perf_counter()
    # NVLink multicast stays off on the GPU machine (the launchers pass the environment on).
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NCCL_NVLS_ENABLE": "0", **env})
    result.seconds = time.perf_counter() - start
    print(f"{config}: {result.seconds:.1f} s")
    return result


def launched_run(config, corpus, data_dir, out_dir, *extra):
    """metrics of a launched run; out_dir/../logits.pt holds its trained model's logits, and
    out_dir/../step10.pt its step-10 checkpoint."""
    argv = tiny_run_args(corpus, data_dir, out_dir, *extra)
    result = launch(config, argv, RESLIN_TEST_LOGITS=str(out_dir.parent / "logits.pt"),
                    RESLIN_TEST_KEEP_CHECKPOINT=str(out_dir.parent / "step10.pt"))
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads((out_dir / "metrics.json").read_text())


def assert_same_run(metrics, reference, rtol=LOSS_RTOL):
    losses = [entry["loss"] for entry in metrics["train"]]
    assert len(losses) == 20
    np.testing.assert_allclose(losses, [entry["loss"] for entry in reference["train"]], rtol=rtol, atol=0)
    for got, expected in zip(metrics["validation"] + [metrics["final_validation"]],
                             reference["validation"] + [reference["final_validation"]]):
        assert (got["step"], got["tokens"], got["bytes"]) == (expected["step"], expected["tokens"], expected["bytes"])
        assert got["loss"] == pytest.approx(expected["loss"], rel=rtol)
    assert [entry["step"] for entry in metrics["validation"]] == [0, 10]


def loaded_model_folder(out_dir):
    """The run's model folder, loaded on the CPU, after checking that it holds the whole weights of
    the run's last checkpoint, with the tied weights tied."""
    weights = load_file(out_dir / "model.safetensors")
    checkpoint = torch.load(out_dir / train.CHECKPOINT, weights_only=True)
    assert weights.keys() == checkpoint["model"].keys() - {"lm_head.weight"}  # saved once, as tied
    for name, tensor in weights.items():
        assert torch.equal(checkpoint["model"][name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def assert_same_weights(out_dir, reference_dir, rtol=LOSS_RTOL):
    weights, reference = load_file(out_dir / "model.safetensors"), load_file(reference_dir / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=rtol * tensor.abs().max().item())


@torch.no_grad()
def logits_on_one_thread(model, input_ids):
    """As in the launched processes (torchrun gives each one thread), so that CPU matmuls sum in
    the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return model(input_ids).logits
    finally:
        torch.set_num_threads(threads)


def assert_launch_matches_one_process(config_file, parallelism, one_process, corpus, data_dir, tmp_path):
    """A 2-process run with activation checkpointing computes the one-process run, and its saved
    folder loads with the logits of the model it trained. Returns its output folder and metrics."""
    out_dir = tmp_path / "out"
    metrics = launched_run(config_file, corpus, data_dir, out_dir, *CPU_RUN, "--gradient-checkpointing")
    assert metrics["device"].startswith(f"2 processes, {parallelism}")
    assert_same_run(metrics, one_process[1])
    assert_same_weights(out_dir, one_process[0])
    model = loaded_model_folder(out_dir)
    trained = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert torch.equal(logits_on_one_thread(model, trained["input_ids"]), trained["logits"])
    return out_dir, metrics


def test_ddp_matches_one_process(one_process, corpus, data_dir, tmp_path):
    assert_launch_matches_one_process("ddp.yaml", "DDP", one_process, corpus, data_dir, tmp_path)


def test_fsdp2_matches_one_process_and_resumes_exactly(one_process, corpus, data_dir, tmp_path):
    """FSDP2 with activation checkpointing; then a run resumed from its step-10 checkpoint, as if it
    had stopped there, repeats it bit for bit. (One test: two FSDP runs are most of its time.)"""
    out_dir, metrics = assert_launch_matches_one_process("fsdp2.yaml", "FSDP2", one_process, corpus, data_dir, tmp_path)
    # The checkpoint holds the whole optimizer state, keyed by parameter name.
    optimizer = torch.load(out_dir / train.CHECKPOINT, weights_only=True)["optimizer"]
    moments = optimizer["state"]["model.layers.0.attn.q_proj.weight"]["exp_avg"]
    assert moments.shape == load_file(out_dir / "model.safetensors")["model.layers.0.attn.q_proj.weight"].shape

    # A run resumes in its own --out-dir: the whole run's folder moves aside for it.
    whole_dir = out_dir.rename(tmp_path / "whole")
    out_dir.mkdir()
    shutil.copyfile(tmp_path / "step10.pt", out_dir / train.CHECKPOINT)
    argv = tiny_run_args(corpus, data_dir, out_dir, *CPU_RUN, "--gradient-checkpointing", "--resume")
    resumed = launch("fsdp2.yaml", argv)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout and "at step 10" in resumed.stdout
    resumed = json.loads((out_dir / "metrics.json").read_text())
    assert len(resumed["train"]) == 20 and len(resumed["commands"]) == 2
    assert [entry["loss"] for entry in resumed["train"]] == [entry["loss"] for entry in metrics["train"]]
    assert resumed["validation"] == metrics["validation"]
    assert resumed["final_validation"] == metrics["final_validation"]
    weights = load_file(out_dir / "model.safetensors")
    for name, tensor in load_file(whole_dir / "model.safetensors").items():
        assert torch.equal(weights[name], tensor), name


def test_global_batch_not_divisible_by_the_processes_fails_clearly(corpus, data_dir, tmp_path):
    argv = tiny_run_args(corpus, data_dir, tmp_path / "out", "--max-steps", "1", "--device", "cpu", "--batch-size", "3")
    result = launch("ddp.yaml", argv)
    assert result.returncode != 0
    assert ("--batch-size 3 is the global batch, split evenly across the processes: it must be a multiple of the "
            "number of processes, 2") in result.stderr


def test_processes_share_each_batch_as_one_process_takes_it(corpus, data_dir):
    """Two processes' shares of a training batch, laid end to end, are the one-process batch; each
    counts the whole batch's predicted tokens. Validation: the same rows, split, and the same number
    of batches in each process (the short last batch gives one process a token predicting nothing)."""
    args = train.parse_args(tiny_run_args(corpus, data_dir, "unused", "--max-steps", "1"))
    _, streams, _ = train.prepare_data(args)
    cpu = torch.device("cpu")
    whole = train.TrainBatches(streams["train"], 64, 4, 0, cpu)
    halves = [train.TrainBatches(streams["train"], 64, 4, 0, cpu, rank, 2) for rank in (0, 1)]
    uneven = 0
    for step in range(12):
        batch, predicted = whole(step)
        shares = [half(step) for half in halves]
        assert [count for _, count in shares] == [predicted] * 2 == [int((batch["labels"] != -100).sum())] * 2
        for name in TOKEN_TENSORS:
            assert torch.equal(torch.cat([share[name] for share, _ in shares], dim=1), batch[name])
        for share, _ in shares:
            assert_sequence_starts(share)
        own_counts = [int((share["labels"] != -100).sum()) for share, _ in shares]
        uneven += own_counts[0] != own_counts[1]
    assert uneven >= 3  # the corpus does what the module docstring says

    rows = [streams["validation"][i:i + 64] for i in range(0, len(streams["validation"]), 64)]
    assert len(rows) % 4 in (1, 2)  # a short last batch, which leaves the second process without rows
    whole = train.validation_batches(streams["validation"], 64, 4, 0, cpu)
    halves = [train.validation_batches(streams["validation"], 64, 4, 0, cpu, rank, 2) for rank in (0, 1)]
    assert len(halves[0]) == len(halves[1]) == len(whole)
    for batch, first, second in zip(whole, *halves):
        if torch.equal(second["labels"], torch.tensor([[-100]])):  # the filler: the batch's first token
            assert torch.equal(first["input_ids"], batch["input_ids"])
            assert second["input_ids"].item() == batch["input_ids"][0, 0].item()
        else:
            for name in TOKEN_TENSORS:
                assert torch.equal(torch.cat([first[name], second[name]], dim=1), batch[name])
        for share in (first, second):
            assert_sequence_starts(share)


TOKEN_TENSORS = ("input_ids", "position_ids", "labels")


def assert_sequence_starts(batch):
    """cu_seq_lens_q: where the batch's position_ids restart at 0, then its length."""
    positions = batch["position_ids"][0]
    starts = [i for i, position in enumerate(positions.tolist()) if position == 0]
    assert batch["cu_seq_lens_q"].tolist() == starts + [len(positions)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_and_fsdp2_on_two_gpus_match_one_gpu_in_bf16(corpus, data_dir, tmp_path):
    """The same global batch on one GPU and on two (with activation checkpointing), bf16 autocast
    and the Triton kernels: the first 20 losses and the validation figures agree within bf16 noise.
    The FSDP2 run's folder loads on one GPU with exactly its in-memory logits, and on the CPU with
    them up to the backends' fp32 difference."""
    runs = {}
    for name, config in (("one", None), ("ddp", "ddp.yaml"), ("fsdp2", "fsdp2.yaml")):
        runs[name] = launched_run(config, corpus, data_dir, tmp_path / name / "out", *GPU_RUN,
                                  *(("--gradient-checkpointing",) if config else ()))
    for name in ("ddp", "fsdp2"):
        assert runs[name]["device"].startswith(f"2 processes, {name.upper()}")
        assert runs[name]["precision"] == "bf16 autocast"
        losses = np.array([entry["loss"] for entry in runs[name]["train"]])
        reference = np.array([entry["loss"] for entry in runs["one"]["train"]])
        print(f"{name}: largest relative loss difference to one GPU {np.max(np.abs(losses / reference - 1)):.2e}")
        assert_same_run(runs[name], runs["one"], rtol=BF16_RTOL)

    model = loaded_model_folder(tmp_path / "fsdp2" / "out")
    trained = torch.load(tmp_path / "fsdp2" / "logits.pt", weights_only=True)
    with torch.no_grad():
        on_cpu = model(trained["input_ids"]).logits
        on_gpu = model.cuda()(trained["input_ids"].cuda()).logits.cpu()
    assert torch.equal(on_gpu, trained["logits"])
    torch.testing.assert_close(on_cpu, trained["logits"], rtol=0, atol=1e-4 * trained["logits"].abs().max().item())


def test_data_parallel_benchmark_runs_one_and_two_processes(corpus):
    """benchmarks/bench_data_parallel.py end to end with its default config (DDP; gloo on the CPU):
    both launches train, and the same global batch gives the same losses on 1 and 2 processes."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import bench_data_parallel

    runs = bench_data_parallel.main(["--steps", "4", "--", "--corpus", str(corpus), "--vocab-size", "300", *TINY_MODEL,
                                     "--seq-len", "64", "--batch-size", "4", "--eval-tokens", "256", "--device", "cpu",
                                     "--kernel-backend", "torch"])
    assert runs[1]["device"].startswith("CPU") and runs[2]["device"].startswith("2 processes, DDP")
    np.testing.assert_allclose([e["loss"] for e in runs[2]["train"]], [e["loss"] for e in runs[1]["train"]],
                               rtol=LOSS_RTOL)
