"""Context parallelism (context_parallel_reslin.py): a sequence split over 2 or 3 processes gives
the single-process logits, loss, parameter gradients and final states.

Each case spawns its ranks (torch.multiprocessing, gloo on the CPU, NCCL on GPUs, a file
rendezvous in tmp_path). Every rank runs the single-process reference on the whole batch itself,
then its context-parallel share, and checks its part: the logits of its tokens, the sum of the
ranks' losses, the sum of the ranks' gradients of every parameter, and on the last rank the
cache's states after the whole sequence. A failing check fails its rank, which fails the test.

Tolerances, max |difference| / max |reference| per tensor: fp32 1e-5 (a rank boundary inside one
of the torch backend's chunks changes the order of its sums); bf16 autocast on GPUs 2e-2 (each
rank's gradients are rounded to bf16 before they are summed).
"""

import contextlib
import datetime
import importlib
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO_ROOT, build_model
from test_generate import cache_of

RULES = ["sgla", "rla", "gdn", "kla", "rdn", "rkla"]
GPU_SIZES = dict(vocab_size=512, hidden_size=256, num_heads=4, head_dim=64, intermediate_size=512)


def context_parallel():
    return importlib.import_module("reslin_repo.context_parallel_reslin")


def relative_error(actual, expected):
    expected = expected.float()
    return ((actual.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def check_rank(rank, world_size, case):
    """The checks of the module docstring, on this rank of an initialised process group."""
    device = torch.device("cuda", rank) if case["device"] == "cuda" else torch.device("cpu")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if case["bf16"] else contextlib.nullcontext()
    tolerance = 2e-2 if case["bf16"] else 1e-5
    model = build_model(case["mixer"], kernel_backend=case["backend"], **case["sizes"]).to(device)
    if case["lora"]:
        import peft

        # Random B (not zeros), so that the adapters' A matrices get gradients to compare too.
        lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (2, case["length"]), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[1, :case["padding"]] = 0  # the second row left-padded, across rank boundaries when long enough
    labels = ids.masked_fill(mask == 0, -100)

    with autocast:
        reference = model(ids, attention_mask=mask, labels=labels, use_cache=True)
    reference.loss.backward()
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    reference_grads = {name: p.grad.clone() for name, p in trained.items()}
    model.zero_grad(set_to_none=True)

    cp = context_parallel()
    with autocast:
        output = cp.context_parallel_forward(model, ids, labels=labels, attention_mask=mask)
    output.loss.backward()
    cp.all_reduce_gradients(model)
    loss = output.loss.detach().clone()
    dist.all_reduce(loss)

    start, end = cp.shard_bounds(case["length"], rank, world_size)
    errors = {"logits": relative_error(output.logits, reference.logits[:, start:end]),
              "loss": relative_error(loss, reference.loss)}
    errors.update({name: relative_error(p.grad, reference_grads[name]) for name, p in trained.items()})
    if rank == world_size - 1:
        cache, reference_cache = cache_of(output), cache_of(reference)
        assert cache.get_seq_length() == case["length"]
        for i, (conv, states) in enumerate(zip(cache.conv_states, cache.recurrent_states)):
            reference_states = (*reference_cache.conv_states[i], *reference_cache.recurrent_states[i])
            for j, (x, ref) in enumerate(zip((*conv, *states), reference_states)):
                if ref is not None:
                    errors[f"layer {i} state {j}"] = relative_error(x, ref)
    too_far = {name: f"{error:.1e}" for name, error in errors.items() if not error <= tolerance}
    assert not too_far, f"rank {rank}: beyond {tolerance:g}: {too_far}"


def check_pipeline(rank, world_size, case):
    """Rank 0 runs its layer 1 only once rank 1 has run its layer 0, and in the backward rank 1
    goes back through its layer 0 only once rank 0 has gone back through its layer 1: ranks that
    ran one after the other, rather than as a pipeline across the layers, would wait forever."""
    model = build_model(case["mixer"])
    layers = model.model.layers
    token = torch.zeros(1)

    def wait_for_rank(source, tag):
        def hook(*_):
            dist.recv(token, src=source, tag=tag)
        return hook

    def signal_rank(destination, tag):
        def hook(*_):
            dist.send(token, dst=destination, tag=tag)
        return hook

    if rank == 0:
        layers[1].attn.register_forward_pre_hook(wait_for_rank(1, tag=1))
        layers[1].attn.register_full_backward_hook(signal_rank(1, tag=2))
    else:
        layers[0].attn.register_forward_hook(signal_rank(0, tag=1))
        layers[0].attn.register_full_backward_pre_hook(wait_for_rank(0, tag=2))
    ids = torch.randint(1, 100, (1, case["length"]))
    context_parallel().context_parallel_forward(model, ids, labels=ids).loss.backward()


def run_rank(rank, world_size, rendezvous, check, case):
    torch.set_num_threads(1)  # the ranks share the machine's cores (with the other pytest workers)
    if case["device"] == "cuda":
        torch.cuda.set_device(rank)
    # A rank stuck waiting for a message fails after the timeout instead of hanging the test run.
    dist.init_process_group("nccl" if case["device"] == "cuda" else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        check(rank, world_size, case)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size, tmp_path, mixer, length=40, padding=0, device="cpu", backend="torch", bf16=False,
              sizes=None, lora=False, check=check_rank):
    case = dict(mixer=mixer, length=length, padding=padding, device=device, backend=backend, bf16=bf16,
                sizes=sizes or {}, lora=lora)
    mp.spawn(run_rank, args=(world_size, str(tmp_path / "rendezvous"), check, case), nprocs=world_size)


@pytest.mark.parametrize("rule", RULES)
def test_two_ranks_equal_one_process(rule, tmp_path):
    run_ranks(2, tmp_path, rule)


def test_three_ranks_uneven_split_grouped_value_heads_and_padding(tmp_path):
    # 50 tokens over 3 ranks: 17, 17, 16; the padding of the second row covers rank 0 and 3 tokens of rank 1.
    run_ranks(3, tmp_path, "rdn_grouped_v", length=50, padding=20)


def test_two_ranks_train_lora_adapters_of_a_frozen_model(tmp_path):
    # The embeddings are frozen: the first layer's input needs no gradient, its received states still do.
    run_ranks(2, tmp_path, "rla", lora=True)


def test_ranks_run_as_a_pipeline_across_layers(tmp_path):
    run_ranks(2, tmp_path, "rdn", check=check_pipeline)


def test_shard_bounds_split_like_tensor_split():
    cp = context_parallel()
    for length in (1, 7, 50, 64):
        for world_size in range(1, min(length, 5) + 1):
            parts = torch.arange(length).tensor_split(world_size)
            assert [cp.shard_bounds(length, r, world_size) for r in range(world_size)] == [
                (int(p[0]), int(p[-1]) + 1) for p in parts]


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_is_the_plain_model(one_rank_group):
    model = build_model("rkla")
    ids = torch.randint(1, 100, (2, 12))
    output = context_parallel().context_parallel_forward(model, ids, labels=ids)
    reference = model(ids, labels=ids)
    assert torch.allclose(output.logits, reference.logits, atol=1e-6)
    assert torch.allclose(output.loss, reference.loss, atol=1e-6)


def test_functions_load_through_remote_code_beside_the_model(one_rank_group, repo_copy, tiny_config):
    """The README's way: the model and the functions from one folder, through trust_remote_code."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    tiny_config("rdn").to_json_file(repo_copy / "config.json")
    config = AutoConfig.from_pretrained(repo_copy, trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
    forward = get_class_from_dynamic_module("context_parallel_reslin.context_parallel_forward", str(repo_copy))
    ids = torch.randint(1, 100, (2, 12))
    assert torch.allclose(forward(model, ids).logits, model(ids).logits, atol=1e-6)


def test_hybrid_model_is_refused(one_rank_group):
    model = build_model("hybrid")
    with pytest.raises(ValueError, match=r"layers \[1\] are softmax attention"):
        context_parallel().context_parallel_forward(model, torch.randint(1, 100, (1, 8)))


def test_gradient_checkpointing_is_refused(one_rank_group):
    model = build_model("gdn").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="gradient checkpointing"):
        context_parallel().context_parallel_forward(model, torch.randint(1, 100, (1, 8)))


def test_labels_need_a_language_model_head(one_rank_group):
    model = build_model("gdn").model
    ids = torch.randint(1, 100, (1, 8))
    with pytest.raises(ValueError, match="language-model head"):
        context_parallel().context_parallel_forward(model, ids, labels=ids)


def test_benchmark_smoke_run_under_torchrun(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO_ROOT / "benchmarks" / "bench_context_parallel.py"), "--smoke"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 2 ranks " in result.stdout, result.stdout
    difference, largest = map(float, re.search(r"max \|difference\| (\S+) \(largest \|value\| (\S+)\)",
                                               result.stdout).groups())
    assert difference <= 1e-5 * largest, result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("rule", RULES)
def test_two_gpus_nccl_triton_bf16_at_65536_tokens(rule, tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # NVLink multicast: required off on the 2-GPU machine
    run_ranks(2, tmp_path, rule, length=65536, padding=40000, device="cuda", backend="triton", bf16=True,
              sizes=GPU_SIZES)
