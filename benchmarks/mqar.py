"""MQAR (multi-query associative recall) with length extrapolation, the KLA paper's synthetic test,
for ResLin's rules: train a 2-layer model at length 256, measure recall at 1x, 2x, 4x and 8x.

The task (Zoology's MQAR, Arora et al. 2023, arXiv 2312.04927, whose protocol the KLA code follows):
a sequence starts with P key-value pairs k1 v1 k2 v2 ..., keys drawn without repetition from the
lower half of the vocabulary [1, V/2), values from the upper half [V/2, V). Each key is asked
once afterwards: at an even offset 2 * gap past the pairs, with gaps drawn without repetition
with probability proportional to gap ** (a - 1), a = 0.01 (a power law: most queries come soon
after the pairs, some far away); key j goes to the j-th gap drawn, as in Zoology. Every other
position holds a uniformly random token of the whole vocabulary. The model must predict, at each
query's key, the value that key was paired with. Loss and accuracy cover only those P answer
positions; accuracy = correct answers / all answers (chance: 2 / V).

What the KLA paper (arXiv 2605.08587, Sec. 5.3, Table 4, Appendix C-D) and its code
(anonymous-kla-review/kla-anonymous: train_mqar.py, lit_gpt/config.py "*_MQAR",
run_ablation_47.sh) specify -> what this script does:

- model: 2 layers, width 256, 4 heads, expand_k 0.75 and expand_v 1.5 (head sizes 48 / 96),
  SwiGLU 1024, RMSNorm eps 1e-5, vocabulary 8192 -> the same, through ResLinConfig.
- data: 32 pairs, keys of one token, 20K training and 2K validation examples, seed 42 -> the
  same, generated on the device from --seed (default 42).
- lengths: train at 256, evaluate at 256 x {1, 2, 4, 8}, 2K examples each, still 32 pairs -> the
  same (the pairs are kept at 32, not scaled with the length).
- optimiser: AdamW, lr 1e-3, betas 0.9 / 0.95, weight decay 0.1, clipping 1.0, batch 32, bf16
  mixed precision -> the same; A_log and dt_bias are not decayed (their _no_weight_decay flag).
- schedule: constant lr, up to 10K steps, validation every 200, early stop after 10 without a
  gain, the best checkpoint evaluated -> warmup (2% of the steps) and cosine decay to 0 over a
  fixed --steps (default 10K): a fixed GPU cost, and the last model is the one evaluated.
- lr sweep: none (1e-3 for every model) -> --lr takes several values; each attn type reports the
  one with the best 1x accuracy (the 1x set is also reported, as the paper's validation set is).
- metric: accuracy on the answer tokens ("validation accuracy") -> the same.

Where the paper's files are silent (its mqar_data.py is not public), Zoology's generator is
followed: the power-law query gaps and the random filler tokens above. KLA, GDN and Mamba2 are the
paper's models; RDN and RKLA (ResLin's residual rules) use the same shape.

Outputs: one line per run (accuracy at each length, wall time of training and evaluation), a table
of the best lr per attn type, and JSON (--out) with every run. Data and initial weights come from
--seed alone, so every attn type sees the same examples; the data differ between CPU and CUDA (their
generators differ). Rerun with other seeds to see the noise.

GPU cost, estimated for one H200 (not yet measured: each run prints its ms/step and seconds). A
step is 32 x 256 = 8192 tokens. FLOPs: 6 x 2.36M non-embedding parameters x 8192 tokens = 116 G,
the output layer at the 1024 answer positions 13 G, the chunked attention ~8 G (~15 G with the
residual state): ~0.14 TFLOP a step, 1.4 PFLOP for 10K steps, 2 s at the H200's ~750 TFLOP/s
(bf16, measured) or ~10 s at a fifth of it for these narrow matrices. So the host bounds a step,
not the GPU: counted on the CPU (TorchDispatchMode, Triton in its interpreter), a step launches
~190 ATen kernels in the forward, ~440 in the backward, 18 Triton kernels (and ~15 ATen ops around
them), and ~60 for autocast's casts, clipping and the fused AdamW; at ~5-10 us a launch in eager
PyTorch and ~25 us a Triton launch from Python, that is ~5-7 ms a step (the model also reads
input_ids on the host at each forward, a device sync). A run of 10K steps: ~60 s, plus ~1 s of
evaluation (7.7M tokens, forward only) and, once per process, ~1 min of start-up (CUDA,
compiling ~20 Triton kernel variants). The table (gdn, kla, rdn, rkla at one lr, one seed):
~5-6 min; a 3-value lr sweep: ~14 min; each further seed: ~5 min. On a shared CPU set
OMP_NUM_THREADS=1 (oversubscribed threads made steps ~20x slower here).

    python benchmarks/mqar.py --device cuda --attn-types gdn kla rdn rkla --out out/mqar_seed42.json
    python benchmarks/mqar.py --device cuda --attn-types kla --lr 3e-4 1e-3 3e-3 --seed 1 --out out/mqar_kla_seed1.json
    python benchmarks/mqar.py --device cuda --attn-types rdn --steps 1000 --compile   # the step through inductor
    python benchmarks/mqar.py --smoke    # tiny sizes on the CPU, seconds

--compile (not yet timed on a GPU) fuses the step's small kernels, of which the host launches
~700: it should shorten a host-bound step, at the cost of a compilation per process (inductor's
cache on disk serves later processes with the same graph).
"""

import argparse
import functools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from train import learning_rate  # noqa: E402  (train.py's schedule: one for both training scripts)

LENGTH_FACTORS = (1, 2, 4, 8)
POWER_A = 0.01  # Zoology's query-gap power law
WARMUP_FRACTION = 0.02
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
EVAL_TOKENS_PER_BATCH = 65536  # evaluation batches hold about this many tokens at every length

# The KLA code's "*_MQAR" models (lit_gpt/config.py): n_embd 256, n_head 4, expand_k 0.75, expand_v 1.5.
PAPER_MODEL = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=2, num_heads=4, head_dim=48, expand_v=2.0,
                   intermediate_size=1024, norm_eps=1e-5)
PAPER_TASK = dict(train_length=256, kv_pairs=32, train_examples=20000, eval_examples=2000, batch_size=32, steps=10000)
SMOKE_MODEL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=1.0,
                   intermediate_size=64, norm_eps=1e-5)
SMOKE_TASK = dict(train_length=32, kv_pairs=4, train_examples=20000, eval_examples=32, batch_size=16, steps=20)


def make_mqar(num_examples, seq_len, kv_pairs, vocab_size, generator):
    """MQAR examples on the generator's device (the layout is in the module docstring):
    inputs [N, seq_len], query_positions [N, P] (where key j is asked) and answers [N, P] (its value)."""
    device = generator.device
    query_slots = (seq_len - 2 * kv_pairs) // 2
    if query_slots < kv_pairs or vocab_size // 2 - 1 < kv_pairs:
        raise ValueError(f"{kv_pairs} pairs need length >= {4 * kv_pairs} and vocabulary >= {2 * kv_pairs + 2}, "
                         f"got length {seq_len}, vocabulary {vocab_size}")
    half = vocab_size // 2

    def distinct(low, high):  # kv_pairs distinct tokens of [low, high) per example
        return low + torch.rand(num_examples, high - low, device=device, generator=generator).topk(kv_pairs).indices

    keys, values = distinct(1, half), distinct(half, vocab_size)
    gap_weights = torch.arange(1, query_slots + 1, device=device, dtype=torch.float) ** (POWER_A - 1)
    gaps = torch.multinomial(gap_weights.repeat(num_examples, 1), kv_pairs, generator=generator)
    query_positions = 2 * kv_pairs + 2 * gaps

    inputs = torch.randint(vocab_size, (num_examples, seq_len), device=device, generator=generator)
    inputs[:, 0:2 * kv_pairs:2] = keys
    inputs[:, 1:2 * kv_pairs:2] = values
    inputs.scatter_(1, query_positions, keys)
    return inputs, query_positions, values


def make_eval_sets(task, vocab_size, generator):
    """{factor: MQAR examples of length factor x the train length}, with the train task's number
    of pairs at every length, as the KLA code evaluates."""
    return {factor: make_mqar(task["eval_examples"], factor * task["train_length"], task["kv_pairs"], vocab_size,
                              generator)
            for factor in LENGTH_FACTORS}


def build_model(attn_type, model_shape, kernel_backend, seed, device):
    """A fresh ResLinForCausalLM loaded as users load it: the repository's config and code through
    the Auto classes with trust_remote_code."""
    config = AutoConfig.from_pretrained(
        REPO, trust_remote_code=True, attn_type=attn_type, num_v_heads=model_shape["num_heads"],
        layer_types=["linear_attention"] * model_shape["num_hidden_layers"], kernel_backend=kernel_backend,
        **model_shape)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True).to(device)


def answer_logits(model, inputs, query_positions):
    """Logits [B, P, V] at the query positions only: the output layer is the largest matrix of this
    model, and the other positions have nothing to predict."""
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    hidden = hidden.gather(1, query_positions[..., None].expand(-1, -1, hidden.shape[-1]))
    return model.lm_head(hidden)


@torch.no_grad()
def accuracy(model, inputs, query_positions, answers):
    """Share of answers predicted right (argmax over the whole vocabulary)."""
    model.eval()
    batch_size = max(1, EVAL_TOKENS_PER_BATCH // inputs.shape[1])
    correct = torch.zeros((), device=inputs.device, dtype=torch.long)
    for start in range(0, len(inputs), batch_size):
        batch = slice(start, start + batch_size)
        with autocast(inputs.device):
            logits = answer_logits(model, inputs[batch], query_positions[batch])
        correct += (logits.argmax(-1) == answers[batch]).sum()
    return correct.item() / answers.numel()


def autocast(device):
    # bf16 on CUDA, as the paper's bf16-mixed; fp32 on the CPU.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def shuffled_batches(num_examples, steps, batch_size, generator):
    """[steps, batch_size] example indices: epochs over the fixed training set, each in a fresh
    order, as the paper's shuffled loader."""
    epochs = math.ceil(steps * batch_size / num_examples)
    order = torch.cat([torch.randperm(num_examples, device=generator.device, generator=generator)
                       for _ in range(epochs)])
    return order[:steps * batch_size].view(steps, batch_size)


def train(model, train_set, batches, peak_lr, log_every, compile_backend=None):
    """AdamW with warmup and cosine decay over `batches`. Returns (the mean loss of the last
    `log_every` steps, ms per step after the first log: without the first steps' compilation).
    With `compile_backend` the training forward runs through torch.compile (one graph: the
    inputs' shape never changes), which fuses the small elementwise kernels that bound a step of
    this small model by the host; the evaluation's longer inputs run eagerly."""
    forward = functools.partial(answer_logits, model)
    if compile_backend is not None:
        forward = torch.compile(forward, fullgraph=True, backend=compile_backend)
    inputs, query_positions, answers = train_set
    device, steps = inputs.device, len(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    decayed = [p for p in params if not getattr(p, "_no_weight_decay", False)]
    not_decayed = [p for p in params if getattr(p, "_no_weight_decay", False)]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": WEIGHT_DECAY},
                                   {"params": not_decayed, "weight_decay": 0.0}],
                                  lr=peak_lr, betas=BETAS, fused=device.type == "cuda")
    model.train()
    recent_loss = torch.zeros((), device=device)
    first_log = None
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(peak_lr, step, step / steps, round(WARMUP_FRACTION * steps), 0.0)
        batch = batches[step]
        with autocast(device):
            logits = forward(inputs[batch], query_positions[batch])
        loss = F.cross_entropy(logits.float().flatten(0, 1), answers[batch].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent_loss += loss.detach()  # read on the host only at a log step: no sync per step
        if (step + 1) % log_every == 0 or step + 1 == steps:
            mean_loss = recent_loss.item() / (step % log_every + 1)  # .item() waits for the device
            now = time.perf_counter()
            first_log = first_log or (step, now)
            print(f"  step {step + 1}/{steps}  loss {mean_loss:.4f}", flush=True)
            recent_loss.zero_()
    ms_per_step = 1e3 * (now - first_log[1]) / (step - first_log[0]) if step > first_log[0] else float("nan")
    return mean_loss, ms_per_step


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(attn_type, peak_lr, args, model_shape, train_set, batches, eval_sets, device):
    """Train one model and measure it at every length: the run's record for the JSON."""
    run_start = time.perf_counter()
    model = build_model(attn_type, model_shape, args.kernel_backend, args.seed, device)
    synchronize(device)
    start = time.perf_counter()
    final_loss, ms_per_step = train(model, train_set, batches, peak_lr, log_every=max(1, len(batches) // 10),
                                    compile_backend=args.compile)
    synchronize(device)
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    acc = {f"{factor}x": accuracy(model, *eval_sets[factor]) for factor in LENGTH_FACTORS}
    eval_seconds = time.perf_counter() - start
    run_seconds = time.perf_counter() - run_start
    record = dict(attn_type=attn_type, lr=peak_lr, seed=args.seed, compile=args.compile, accuracy=acc,
                  final_loss=final_loss,
                  train_seconds=round(train_seconds, 2), ms_per_step=round(ms_per_step, 2),
                  eval_seconds=round(eval_seconds, 2), run_seconds=round(run_seconds, 2))
    print(f"{attn_type:5s} lr {peak_lr:.0e}  " + "  ".join(f"{k} {100 * v:6.2f}%" for k, v in acc.items())
          + f"  | train {train_seconds:.1f} s ({ms_per_step:.1f} ms/step after the first log), "
          f"eval {eval_seconds:.1f} s, run {run_seconds:.1f} s", flush=True)
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn-types", nargs="+", default=["gdn", "kla", "rdn", "rkla"])
    parser.add_argument("--seed", type=int, default=42, help="data, initial weights and batch order")
    parser.add_argument("--steps", type=int, help=f"training steps (default {PAPER_TASK['steps']})")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-3], help="peak lr; several = a sweep")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kernel-backend", default="auto", help="the config's kernel_backend")
    parser.add_argument("--train-length", type=int, help=f"default {PAPER_TASK['train_length']}")
    parser.add_argument("--kv-pairs", type=int, help=f"default {PAPER_TASK['kv_pairs']}")
    parser.add_argument("--eval-examples", type=int, help=f"per length (default {PAPER_TASK['eval_examples']})")
    parser.add_argument("--out", default=os.path.join(REPO, "out", "mqar.json"), help="JSON results")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="train through torch.compile (backend: inductor when given alone)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and task: seconds on a CPU")
    args = parser.parse_args(argv)

    model_shape = SMOKE_MODEL if args.smoke else PAPER_MODEL
    task = dict(SMOKE_TASK if args.smoke else PAPER_TASK)
    for name in ("steps", "train_length", "kv_pairs", "eval_examples"):
        if getattr(args, name) is not None:
            task[name] = getattr(args, name)
    device = torch.device(args.device)
    print(f"MQAR on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}"
          f"\ntask {task}\nmodel {model_shape}, kernel_backend {args.kernel_backend}", flush=True)

    generator = torch.Generator(device).manual_seed(args.seed)
    train_set = make_mqar(task["train_examples"], task["train_length"], task["kv_pairs"], model_shape["vocab_size"],
                          generator)
    eval_sets = make_eval_sets(task, model_shape["vocab_size"], generator)
    # One batch order for every run, so that the attn types and lrs see the same batches.
    batches = shuffled_batches(task["train_examples"], task["steps"], task["batch_size"], generator)

    runs = [run(attn_type, lr, args, model_shape, train_set, batches, eval_sets, device)
            for attn_type in args.attn_types for lr in args.lr]
    best = {attn_type: max((r for r in runs if r["attn_type"] == attn_type), key=lambda r: r["accuracy"]["1x"])
            for attn_type in args.attn_types}

    print("\n| attn_type | lr | " + " | ".join(f"{f}x ({f * task['train_length']})" for f in LENGTH_FACTORS)
          + " | train s |")
    print("|---|---|" + "---|" * len(LENGTH_FACTORS) + "---|")
    for r in best.values():
        print(f"| {r['attn_type']} | {r['lr']:.0e} | "
              + " | ".join(f"{100 * r['accuracy'][f'{f}x']:.2f}%" for f in LENGTH_FACTORS)
              + f" | {r['train_seconds']:.0f} |")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(task=task, model=model_shape,
                       eval_lengths={f"{f}x": f * task["train_length"] for f in LENGTH_FACTORS},
                       device=str(device), kernel_backend=args.kernel_backend,
                       argv=sys.argv[1:] if argv is None else argv,
                       runs=runs, best={k: runs.index(v) for k, v in best.items()}), f, indent=1)
    print(f"\nwrote {args.out}")
    return runs


if __name__ == "__main__":
    main()
