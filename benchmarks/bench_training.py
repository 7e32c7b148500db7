"""Training throughput and peak memory of a ~400M-parameter model: ResLin (every rule) against FLA's
GatedDeltaNetForCausalLM, same GPU, same run.

Both models have random weights and the shape of bench_generate.py (built by its load_ours /
load_fla): hidden size 1024, 24 layers, 8 heads of size 128 (value heads as large), short
convolutions, a SwiGLU MLP of 2816, vocabulary 32000, untied embeddings. Precision as FLA's own
benchmarks/benchmark_training_throughput.py runs its models (where the issue's FLA figures come
from): bf16 weights, the forward under bf16 autocast (accelerate's mixed_precision="bf16"), fused
AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1) whose states are bf16 like the weights.

One measured step: forward of --batch x --length random token ids with labels = the ids (each
model's own next-token loss: FLA's fused Triton cross-entropy, ours transformers' loss on fp32
logits), backward, optimizer step, zero_grad. After --warmup steps (compilation, autotuning),
the peak-memory counter is reset, then --steps steps run; tokens/s = batch x length / the median
step time (CUDA events around each step, as common.median_ms) and peak memory =
torch.cuda.max_memory_allocated over those steps (weights, gradients, optimizer states and
activations; the warm-up's autotuning buffers not included). With --checkpointing both models
recompute each block's activations in the backward (gradient_checkpointing_enable, non-reentrant).
Our model runs with config kernel_backend --kernel-backend ("auto": Triton on CUDA on this branch,
forward and backward).

FLA 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (wrong values, FLA issue 640):
the guard is lifted for timing (common.lift_fla_backward_guard) and a note says so when it was;
FLA's gradients, hence its loss after the first step, are then wrong, its times are not.

Goals (issue "Triton backward for training"), ours / FLA at B4 x T4096: tokens/s >= 1.0x for gdn
and kla, >= 0.75x for rdn and rla (sgla, rkla reported without a goal); peak memory <= 1.1x
FLA's for every rule. FLA on the H200, measured by the issue's author: 81k tokens/s, 19 GB.

    python benchmarks/bench_training.py [--rules gdn kla rdn rla sgla rkla] [--batch 4] [--length 4096]
                                        [--steps 10] [--warmup 3] [--checkpointing] [--kernel-backend auto]
                                        [--profile 20]   # and each model's 20 slowest kernels of a step
                                        [--compile]      # ours through torch.compile, block by block
    python benchmarks/bench_training.py --smoke   # tiny model; runs on a CPU (torch backend, fp32; FLA skipped)
    python benchmarks/bench_training.py --smoke --kernel-backend triton   # the same, Triton in its interpreter
"""

import argparse
import gc
import time

import torch

from bench_generate import SHAPE, SMOKE_SHAPE, load_fla, load_ours, parameters
from common import DEVICE, RULES, import_fla, lift_fla_backward_guard, median_ms, print_header, synchronize
from kernel_times import kernel_times

SPEED_GOALS = {"gdn": 1.0, "kla": 1.0, "rdn": 0.75, "rla": 0.75}  # tokens/s, ours / FLA at least
MEMORY_GOAL = 1.1  # peak memory, ours / FLA at most


def measure(model, input_ids, steps, warmup, checkpointing, profile=False):
    """(median ms per training step, peak GiB over the measured steps or None on the CPU, last loss,
    and with `profile` the step's time per kernel, {name: us}, else None)."""
    model.train()
    if checkpointing:
        # Non-reentrant for both: transformers' default for it changed between versions.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=DEVICE == "cuda")
    last_loss = []

    def step():
        # Autocast on the CPU would hand bf16 to the Triton interpreter, which computes it wrongly.
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
            # No cache: a training step needs no final states (FLA's model drops its cache in training itself).
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last_loss[:] = [loss.detach()]

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    synchronize()
    # Compilation and autotuning: where a run cut short by a time limit spent its time.
    print(f"    ({warmup} warm-up steps: {time.perf_counter() - start:.0f} s)", flush=True)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, repeats=steps, warmup=0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None
    times = kernel_times(step, repeats=3) if profile else None
    return ms, peak, last_loss[0].item(), times


def build_and_measure(build, input_ids, args):
    """(parameter count, measure's result) of the model that build() returns. The model is gone when
    this returns; its memory is freed before the next model is built, so that each peak is its own."""
    model = build()
    result = measure(model, input_ids, args.steps, args.warmup, args.checkpointing, args.profile)
    return parameters(model), result


def load_ours_for_training(rule, shape, args):
    model = load_ours(rule, shape, args.kernel_backend)
    if args.compile:
        model.compile_blocks()
    return model


def free_memory():
    gc.collect()  # a model may hold reference cycles
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def print_slowest_kernels(times, count):
    """The `count` slowest kernels of a step, and the share of the step's kernel time they take."""
    if not times:
        return
    total = sum(times.values())
    for name, us in times.most_common(count):
        print(f"    {us:9.1f} us {100 * us / total:5.1f}%  {name[:100]}")
    print(f"    {total:9.1f} us in all {len(times)} kernels of a step", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", nargs="+", choices=list(RULES),
                        default=["gdn", "kla", "rdn", "rla", "sgla", "rkla"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10, help="measured steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (compilation, autotuning)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing, both models")
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="our config's kernel_backend (auto: what a user gets)")
    parser.add_argument("--compile", action="store_true",
                        help="our model through torch.compile (inductor), block by block; FLA's stays eager")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after each model's row, its N slowest kernels of a step (GPU time; CPU operators on a CPU)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few steps, to check the script itself")
    args = parser.parse_args()
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    if args.smoke:
        args.batch, args.length, args.steps, args.warmup = 2, 64, 2, 1

    fla = import_fla()
    note = lift_fla_backward_guard() if fla is not None else None
    precision = "bf16 weights, bf16 autocast, fused AdamW" if DEVICE == "cuda" else "fp32, AdamW"
    print_header(f"training step: B{args.batch} x T{args.length} random ids, {precision}, "
                 f"checkpointing {'on' if args.checkpointing else 'off'}, median of {args.steps} steps after "
                 f"{args.warmup}, random weights, " + ", ".join(f"{k}={v}" for k, v in shape.items())
                 + f", our kernel_backend {args.kernel_backend!r}"
                 + (", ours compiled (inductor), FLA eager" if args.compile else ""))
    if note:
        print(note)
    generator = torch.Generator().manual_seed(0)
    # Ids from 3 up: clear of the pad, bos and eos ids 0-2 of our config.json.
    input_ids = torch.randint(3, shape["vocab_size"], (args.batch, args.length), generator=generator).to(DEVICE)
    tokens = args.batch * args.length

    print(f"{'model':9} {'params':>7} {'step ms':>9} {'tok/s':>9} {'peak GiB':>9} {'loss':>7}   "
          f"{'tok/s vs FLA':>12}  {'goal':17} {'mem vs FLA':>10}  goal")

    def row(name, count, result):
        ms, peak, loss, _ = result
        peak_text = f"{peak:9.2f}" if peak is not None else f"{'n/a':>9}"
        return f"{name:9} {count:>7} {ms:9.1f} {tokens / ms * 1e3:9.0f} {peak_text} {loss:7.3f}"

    theirs = None
    if fla is not None:
        count, theirs = build_and_measure(lambda: load_fla(shape), input_ids, args)
        free_memory()
        print(row("FLA gdn", count, theirs), flush=True)
        print_slowest_kernels(theirs[3], args.profile)

    for rule in args.rules:
        count, ours = build_and_measure(lambda: load_ours_for_training(rule, shape, args), input_ids, args)
        free_memory()
        line = row(f"ours {rule}", count, ours)
        if theirs is not None:
            speed = theirs[0] / ours[0]  # tokens/s ratio = inverse step-time ratio
            memory = ours[1] / theirs[1]
            goal = SPEED_GOALS.get(rule)
            speed_verdict = "none" if goal is None else f">= {goal:.2f}x {'met' if speed >= goal else 'NOT met'}"
            memory_verdict = f"<= {MEMORY_GOAL:.1f}x {'met' if memory <= MEMORY_GOAL else 'NOT met'}"
            line += f"   {speed:11.2f}x  {speed_verdict:17} {memory:9.2f}x  {memory_verdict}"
        print(line, flush=True)
        print_slowest_kernels(ours[3], args.profile)


if __name__ == "__main__":
    main()
