"""Prefill of one long sequence on 1 GPU and split over the P GPUs of a torchrun launch (context
parallelism, context_parallel_reslin.py).

The model has random weights, bf16, loaded through remote code as a user loads it: the shape of
bench_generate.py (hidden size 1024, 24 layers, 8 heads of size 128, vocabulary 32000) with
--rule and the size flags, or the checkpoint --model. Timed: one forward without gradient of
--batch x --length random token ids through the base model (ResLinModel: the hidden states and
the cache of the last token; no logits, whose [T, vocabulary] alone would take 8 GB at 128K):

- 1 GPU: the last rank alone runs `model.model(input_ids)` while the others wait;
- P GPUs: every rank runs `context_parallel_forward(model.model, input_ids)` on its T / P tokens,
  timed from a barrier to the end of the slowest rank.

Each time is the median of --repeats after --warmup, by the wall clock around a device sync.
The layers run as a pipeline across the ranks, so P GPUs take about (L + P - 1) / L times a P-th
of the 1-GPU time for L layers, plus the hand-over of each layer's states. Peak memory is the
largest over the ranks. The last rank also compares its hidden states, which depend on every
rank's hand-over, with the same tokens' hidden states of the 1-GPU run, and prints the table.

    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py [--length 131072] [--batch 1]
        [--rule gdn] [--layers 24] [--hidden-size 1024] [--heads 8] [--head-dim 128] [--model PATH_OR_HUB_ID]
        [--repeats 5] [--warmup 2] [--kernel-backend auto]
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --smoke   # tiny model; CPU and gloo in seconds
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from bench_generate import SHAPE, SMOKE_SHAPE, load_ours, parameters
from common import DEVICE, DTYPE, RULES, print_header, synchronize
from context_parallel_reslin import context_parallel_forward, shard_bounds


def median_ms(fn, repeats, warmup, group=None):
    """Median wall time of fn() in ms; with a group, from a barrier to the end of its slowest rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group)
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        elapsed = torch.tensor(time.perf_counter() - start, device=DEVICE)
        if group is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(1e3 * elapsed.item())
    return statistics.median(times)


def peak_gib(group=None):
    """The largest peak of allocated device memory since the last reset, over the group; None on the CPU."""
    if DEVICE != "cuda":
        return None
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=DEVICE)
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return peak.item()


def load_model(args, shape):
    if args.model is not None:
        return AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, dtype=DTYPE).to(DEVICE).eval()
    return load_ours(args.rule, shape, args.kernel_backend)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rule", choices=list(RULES), default="gdn")
    parser.add_argument("--layers", type=int, help=f"default {SHAPE['num_hidden_layers']}")
    parser.add_argument("--hidden-size", type=int, help=f"default {SHAPE['hidden_size']}")
    parser.add_argument("--heads", type=int, help=f"default {SHAPE['num_heads']}")
    parser.add_argument("--head-dim", type=int, help=f"default {SHAPE['head_dim']}")
    parser.add_argument("--model", help="a ResLin checkpoint (folder or Hub id) instead of random weights")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (Triton's compilation)")
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="the random model's kernel_backend (auto: what a user gets)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and sequence, to check the script itself")
    args = parser.parse_args()
    shape = dict(SMOKE_SHAPE if args.smoke else SHAPE)
    for key, value in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden_size),
                       ("num_heads", args.heads), ("head_dim", args.head_dim)):
        if value is not None:
            shape[key] = value
    if args.smoke:
        args.length, args.batch, args.repeats, args.warmup = 256, 1, 2, 1

    if DEVICE == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    last = world_size - 1
    # Rank 0 fills the remote-code module cache first: ranks writing it at once could race.
    if rank != 0:
        dist.barrier()
    torch.manual_seed(0)  # the same random weights on every rank
    model = load_model(args, shape)
    if rank == 0:
        dist.barrier()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the peaks below count the weights, not loading's transients
    vocab_size = model.config.vocab_size
    # The same ids on every rank; from 3 up, clear of the pad, bos and eos ids 0-2 of our config.json.
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab_size, (args.batch, args.length), generator=generator).to(DEVICE)

    with torch.no_grad():
        if rank == last:
            single_ms = median_ms(lambda: model.model(input_ids), args.repeats, args.warmup)
            single_peak = peak_gib()
        dist.barrier()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        parallel_ms = median_ms(lambda: context_parallel_forward(model.model, input_ids), args.repeats, args.warmup,
                                dist.group.WORLD)
        parallel_peak = peak_gib(dist.group.WORLD)
        parallel = context_parallel_forward(model.model, input_ids).last_hidden_state
        if rank == last:
            start, end = shard_bounds(args.length, rank, world_size)
            single = model.model(input_ids).last_hidden_state[:, start:end].float()
            difference = (parallel.float() - single).abs().max().item()
            largest = single.abs().max().item()

    if rank == last:
        described = f"--model {args.model}" if args.model else f"{args.rule}, random weights, " + ", ".join(
            f"{k}={v}" for k, v in shape.items())
        print_header(f"context-parallel prefill: B{args.batch} x T{args.length}, {str(DTYPE).removeprefix('torch.')}, "
                     f"{described}, {parameters(model)} parameters, median of {args.repeats} after {args.warmup}")
        tokens = args.batch * args.length
        print(f"{'ranks':>8} {'ms':>10} {'tokens/s':>12} {'speedup':>8} {'peak GiB':>9}")
        for count, ms, peak in ((1, single_ms, single_peak), (world_size, parallel_ms, parallel_peak)):
            label = f"{count} rank" + ("s" if count > 1 else "")
            peak_text = f"{peak:9.2f}" if peak is not None else f"{'n/a':>9}"
            print(f"{label:>8} {ms:10.1f} {tokens / ms * 1e3:12.0f} {single_ms / ms:7.2f}x {peak_text}")
        print(f"last rank's hidden states, {world_size} ranks against 1: max |difference| {difference:.2e} "
              f"(largest |value| {largest:.2e})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
