"""MQAR (multi-query associative recall) with length extrapolation, the KLA paper's synthetic test,
for ResLin's rules: train a 2-layer model at length 256, measure recall at 1x, 2x, 4x and 8x.

Two protocols, chosen by --protocol; both score, for each query, the model's logits at the
query's key token: the answer is that key's value, i.e. the token the model should say next
(input position p holds the key, the label at p is the value; the input at p + 1 is filler, not
the value). Loss and accuracy cover only those answer positions; accuracy = correct answers / all
answers scored (argmax over the whole vocabulary; chance: 2 / V).

kla-authors (the default): the KLA authors' protocol (arXiv 2605.08587, Sec. 5.3, Table 4; their
mqar_data.py, train_mqar.py and run_mqar_experiment.sh, followed from a description in words):
- data: vocabulary 8192; a sequence starts with 32 pairs k1 v1 k2 v2 ..., keys drawn with
  replacement from [0, V/2), values with replacement from [V/2, V) (so about 11% of sequences
  repeat a key, whose queries then have two possible answers); every later position holds a
  uniformly random token of the whole vocabulary. Then, for each pair in a random order, its key
  alone is written at an absolute position p drawn from the power law of density ~ p^-0.1 on
  [2 x 32, length - 2) (inverse-CDF sampling of the continuous law, then the integer below),
  overwriting the filler. Positions may collide: a later query overwrites an earlier one, whose
  answer is then not scored (its answer is IGNORE_INDEX in the data).
- sets: 20,000 training, 2,000 validation and 2,000 test sequences of length 256 from seeds 42,
  43 and 44; test sets at 2x, 4x and 8x (512, 1024, 2048; still 32 pairs, the law over the longer
  range) from seeds 45, 46 and 47. Generated on the CPU, so the data are the same on every
  machine; --seed sets only the initial weights and the batch order.
- training: batch 32, AdamW (betas 0.9 / 0.95, weight decay 0.1, none on A_log and dt_bias), lr
  1e-3 constant (no warm-up, no decay), gradient clipping 1.0, fp32 weights under bf16 autocast on
  CUDA (the authors' bf16-mixed); at most 10,000 steps; the validation accuracy (the metric above,
  on the validation set) every 200 steps and at the last step; training stops after 10 validations in a row without a strict gain, and
  the best checkpoint (the earliest with the highest validation accuracy) is the one tested.
- model: 2 layers, width 256, 4 heads, head sizes 48 / 96 (the KLA code's expand_k 0.75 and
  expand_v 1.5), SwiGLU 1024, RMSNorm eps 1e-5, input and output embeddings tied, no padding token
  (token 0 is a key like any other: the shipped config's pad_token_id 0 would freeze its embedding).

reslin-gap: the variant this script ran before the authors' protocol was known (Zoology's MQAR,
Arora et al. 2023, arXiv 2312.04927): keys drawn without repetition from [1, V/2) and values
without repetition from [V/2, V); each key asked once, at an even offset 2 x gap past the pairs,
gaps drawn without repetition with probability ~ gap^(0.01 - 1) (most queries soon after the pairs,
so a much easier extrapolation: at 8x the median query sits ~124 tokens after its pair, against
~927 under kla-authors); training set and one evaluation set per length (2,000 sequences each)
all generated on the device from --seed; warm-up over 2% of the steps and cosine decay to 0 over a
fixed --steps (default 10K), the last model evaluated. The same model (tied embeddings: the
earlier comparison's runs took them, and bf16 weights, from the shipped config.json).

Both protocols: --lr takes several values (a sweep); each attn type reports the lr whose run has
the best validation accuracy (kla-authors) or the best 1x accuracy (reslin-gap, which has no
validation set). KLA, GDN and Mamba2 are the paper's models; RDN, RKLA, RLA and sGLA (ResLin's
other rules) use the same shape.

Outputs: one line per run (accuracy at each length, steps run and the best step, wall time of
training and testing), a table of the best lr per attn type, and JSON (--out) with the protocol,
the task and every run (its validation history, steps run, best step and why it stopped). Rerun
with other seeds to see the noise.

Stopping and resuming (kla-authors): at each validation the runs save their state beside the JSON,
in <out>.partial.pt (for --out x.json: x.partial.pt; written to a temporary file, then renamed, so
a stop while writing keeps the previous one): the records of the runs finished, and of the run under
way its weights, AdamW's state, the steps trained (the batch order, fixed by --seed, is rebuilt),
the validations, the best weights, the loss since the last log and the RNGs. The same command
finds it and resumes from it (a state saved with other flags is refused, naming them); on a CPU
the result is that of the run never stopped, bit for bit. The finished command writes its JSON
(also through a temporary file) and removes the saved state. A record's resumed_at_steps lists
where it resumed; its train_seconds add up the processes that trained it, up to their last saved
state, and its ms_per_step is the last process's. reslin-gap's runs, without validations, save
nothing: a stopped one starts over. The paper's model (4.5M parameters) saves 54 MB (the fp32
weights and AdamW's two moments), 72 MB while its best weights are not its current ones.

GPU cost on one H200, measured under reslin-gap (the step is the same under kla-authors): 9.2 ms
a training step with --compile, 19.6 ms eager, run alone; the host bounds a step of this small
model (~700 kernel launches), not the GPU (~0.14 TFLOP a step). A kla-authors run: at most 10K
steps (~1.5 min compiled), fewer when it stops early, plus 50 validations of 0.5M tokens and the
tests (7.7M tokens, forward only: ~1 s), and, once per process, ~1 min of start-up (CUDA,
compiling the Triton kernels). On a shared CPU set OMP_NUM_THREADS=1 (oversubscribed threads made
steps ~20x slower).

    python benchmarks/mqar.py --device cuda --attn-types gdn kla rdn rkla --out out/mqar_seed42.json
    python benchmarks/mqar.py --device cuda --attn-types kla --lr 3e-4 1e-3 3e-3 --seed 1 --out out/mqar_kla_seed1.json
    python benchmarks/mqar.py --device cuda --attn-types rdn --protocol reslin-gap --compile
    python benchmarks/mqar.py --smoke    # tiny sizes on the CPU, seconds

--compile fuses the training step's small kernels (inductor; one graph, as the training inputs'
shape never changes), at the cost of a compilation per process; validation and tests run eagerly.
"""

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from train import learning_rate  # noqa: E402  (train.py's schedule: one for both training scripts)

PROTOCOLS = ("kla-authors", "reslin-gap")
LENGTH_FACTORS = (1, 2, 4, 8)
IGNORE_INDEX = -100  # an answer not scored (cross_entropy's default ignore_index)
QUERY_POSITION_POWER = 0.1  # kla-authors: query positions of density ~ p ** -QUERY_POSITION_POWER
TRAIN_SEED, VALIDATION_SEED = 42, 43  # kla-authors' data seeds
TEST_SEEDS = {1: 44, 2: 45, 4: 46, 8: 47}  # kla-authors' test sets, by length factor
POWER_A = 0.01  # reslin-gap: Zoology's query-gap power law
WARMUP_FRACTION = 0.02  # reslin-gap
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
EVAL_TOKENS_PER_BATCH = 65536  # evaluation batches hold about this many tokens at every length

# The KLA code's "*_MQAR" models (lit_gpt/config.py): n_embd 256, n_head 4, expand_k 0.75, expand_v 1.5.
PAPER_MODEL = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=2, num_heads=4, head_dim=48, expand_v=2.0,
                   intermediate_size=1024, norm_eps=1e-5, tie_word_embeddings=True)
PAPER_TASK = dict(train_length=256, kv_pairs=32, train_examples=20000, eval_examples=2000, batch_size=32, steps=10000)
PAPER_EARLY_STOPPING = dict(eval_interval=200, patience=10)  # kla-authors only
SMOKE_MODEL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=1.0,
                   intermediate_size=64, norm_eps=1e-5, tie_word_embeddings=True)
SMOKE_TASK = dict(train_length=32, kv_pairs=4, train_examples=20000, eval_examples=32, batch_size=16, steps=20)
SMOKE_EARLY_STOPPING = dict(eval_interval=4, patience=3)


def make_mqar(num_examples, seq_len, kv_pairs, vocab_size, generator):
    """reslin-gap's MQAR examples on the generator's device (the layout is in the module docstring):
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
    """reslin-gap's {factor: MQAR examples of length factor x the train length}, with the train
    task's number of pairs at every length."""
    return {factor: make_mqar(task["eval_examples"], factor * task["train_length"], task["kv_pairs"], vocab_size,
                              generator)
            for factor in LENGTH_FACTORS}


def power_law_positions(shape, low, high, generator):
    """Integer positions in [low, high): the integer part of a draw from the density
    ~ x ** -QUERY_POSITION_POWER on [low, high), by inverting its CDF
    F(x) = (x^e - low^e) / (high^e - low^e), e = 1 - QUERY_POSITION_POWER."""
    exponent = 1 - QUERY_POSITION_POWER
    uniform = torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)
    draws = (low ** exponent + uniform * (high ** exponent - low ** exponent)) ** (1 / exponent)
    return draws.floor().long().clamp_(low, high - 1)  # the clamp only guards rounding at the ends


def make_kla_authors_mqar(num_examples, seq_len, kv_pairs, vocab_size, generator):
    """kla-authors' MQAR examples (the layout is in the module docstring), on the generator's
    device: inputs [N, seq_len], query_positions [N, P] (where the j-th placed query went) and
    answers [N, P] (its key's value; IGNORE_INDEX where a later query took its position)."""
    prefix_len = 2 * kv_pairs
    if seq_len - 2 <= prefix_len or vocab_size < 2:
        raise ValueError(f"{kv_pairs} pairs need length >= {prefix_len + 3} and a vocabulary of 2 tokens or more, got "
                         f"length {seq_len}, vocabulary {vocab_size}")
    device, half = generator.device, vocab_size // 2
    keys = torch.randint(0, half, (num_examples, kv_pairs), device=device, generator=generator)
    values = torch.randint(half, vocab_size, (num_examples, kv_pairs), device=device, generator=generator)
    inputs = torch.randint(vocab_size, (num_examples, seq_len), device=device, generator=generator)
    inputs[:, 0:prefix_len:2] = keys
    inputs[:, 1:prefix_len:2] = values

    order = torch.rand(num_examples, kv_pairs, device=device, generator=generator).argsort(-1)  # placing order
    asked, answers = keys.gather(1, order), values.gather(1, order)
    query_positions = power_law_positions((num_examples, kv_pairs), prefix_len, seq_len - 2, generator)
    later = torch.ones(kv_pairs, kv_pairs, dtype=torch.bool, device=device).triu(1)  # [j, i]: query i placed after j
    overwritten = ((query_positions[:, :, None] == query_positions[:, None, :]) & later).any(-1)
    kept = ~overwritten  # the kept positions of a row are distinct: writing them is order-free
    rows = torch.arange(num_examples, device=device)[:, None].expand(-1, kv_pairs)
    inputs[rows[kept], query_positions[kept]] = asked[kept]
    return inputs, query_positions, answers.masked_fill(overwritten, IGNORE_INDEX)


def make_kla_authors_sets(task, vocab_size, device):
    """kla-authors' (training set, validation set, {factor: test set}), each from its own seed on
    the CPU (the same data on every machine), moved to `device`."""
    def make(num_examples, factor, seed):
        examples = make_kla_authors_mqar(num_examples, factor * task["train_length"], task["kv_pairs"], vocab_size,
                                         torch.Generator().manual_seed(seed))
        return tuple(tensor.to(device) for tensor in examples)

    return (make(task["train_examples"], 1, TRAIN_SEED), make(task["eval_examples"], 1, VALIDATION_SEED),
            {factor: make(task["eval_examples"], factor, TEST_SEEDS[factor]) for factor in LENGTH_FACTORS})


def build_model(attn_type, model_shape, kernel_backend, seed, device):
    """A fresh ResLinForCausalLM loaded as users load it: the repository's config and code through
    the Auto classes with trust_remote_code. Two of the shipped model's settings are not the task's:
    its dtype (bf16: from_config would build bf16 weights, and AdamW would then update them in bf16)
    and its padding token (id 0, whose embedding nn.Embedding keeps at zero without a gradient)."""
    config = AutoConfig.from_pretrained(
        REPO, trust_remote_code=True, attn_type=attn_type, num_v_heads=model_shape["num_heads"],
        layer_types=["linear_attention"] * model_shape["num_hidden_layers"], kernel_backend=kernel_backend,
        pad_token_id=None, **model_shape)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32).to(device)


def answer_logits(model, inputs, query_positions):
    """Logits [B, P, V] at the query positions only: the output layer is the largest matrix of this
    model, and the other positions have nothing to predict."""
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    hidden = hidden.gather(1, query_positions[..., None].expand(-1, -1, hidden.shape[-1]))
    return model.lm_head(hidden)


@torch.no_grad()
def accuracy(model, inputs, query_positions, answers):
    """Share of the scored answers (those not IGNORE_INDEX) predicted right (argmax over the whole
    vocabulary)."""
    model.eval()
    batch_size = max(1, EVAL_TOKENS_PER_BATCH // inputs.shape[1])
    correct = torch.zeros((), device=inputs.device, dtype=torch.long)
    for start in range(0, len(inputs), batch_size):
        batch = slice(start, start + batch_size)
        with autocast(inputs.device):
            logits = answer_logits(model, inputs[batch], query_positions[batch])
        correct += (logits.argmax(-1) == answers[batch]).sum()  # never equal to IGNORE_INDEX
    return correct.item() / (answers != IGNORE_INDEX).sum().item()


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


def lr_schedule(protocol, peak_lr, steps):
    """The lr at each step: constant under kla-authors; under reslin-gap, linear warm-up over
    WARMUP_FRACTION of the steps, then cosine decay to 0 at the last step."""
    if protocol == "kla-authors":
        return lambda step: peak_lr
    warmup_steps = round(WARMUP_FRACTION * steps)
    return lambda step: learning_rate(peak_lr, step, step / steps, warmup_steps, 0.0)


def train(model, train_set, batches, lr_at_step, log_every, compile_backend=None, early_stopping=None, saved=None,
          save=None):
    """AdamW over `batches` at lr_at_step(step). Without `early_stopping`, every batch is trained
    and the last model is the result. With early_stopping = (validation_set, eval_interval,
    patience), the validation accuracy is measured every eval_interval steps and at the last
    step; training stops after `patience` validations in a row without a strict gain, and the
    model is left at its best checkpoint (the earliest of the highest validation accuracy).

    With early stopping, `save` (when given) receives the whole training state after each
    validation: the weights, AdamW's state, the steps trained (the batch order's position), the
    validations, the best weights (None while they are the current ones), the loss summed since
    the last log and the RNGs. `saved`, such a state, continues the training from it: on a CPU
    the result and the weights are those of the run never stopped, bit for bit.

    Returns a dict: final_loss (the mean loss of the last `log_every` steps or fewer), ms_per_step
    (of this process's steps after its first log, so without the first steps' compilation, and
    without validations), train_seconds (of every process that trained it, up to its last saved
    state), steps_run, best_step, stop_reason and resumed_at_steps (the steps it resumed at); with
    early stopping also validation_accuracy (the best) and validations ([step, accuracy] each).
    With `compile_backend` the training forward runs through torch.compile (one graph: the
    inputs' shape never changes), which fuses the small elementwise kernels that bound a step of
    this small model by the host; validation runs eagerly."""
    start = time.perf_counter()
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
                                  lr=lr_at_step(0), betas=BETAS, fused=device.type == "cuda")
    recent_loss = torch.zeros((), device=device)
    if saved is None:
        step, done, mean_loss, validations, best_index, best_model = 0, False, None, [], None, None
        stop_reason = f"trained the {steps} steps; the last model is the result"
        resumed_at_steps, seconds_before = [], 0.0
    else:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        set_rng_state(saved["rng"], device)
        recent_loss.copy_(saved["recent_loss"])
        step, done, mean_loss, stop_reason = saved["step"], saved["done"], saved["final_loss"], saved["stop_reason"]
        validations, best_index = saved["validations"], saved["best_index"]
        best_model = weights_copy(model) if saved["best_model"] is None else saved["best_model"]
        resumed_at_steps, seconds_before = [*saved["resumed_at_steps"], step], saved["train_seconds"]
    model.train()
    first_log = None  # (step, time, validation seconds) at this process's first log
    validation_seconds = 0.0  # validations and saved states: not training steps
    while not done:  # `step`: the steps trained so far
        for group in optimizer.param_groups:
            group["lr"] = lr_at_step(step)
        batch = batches[step]
        with autocast(device):
            logits = forward(inputs[batch], query_positions[batch])
        loss = F.cross_entropy(logits.float().flatten(0, 1), answers[batch].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent_loss += loss.detach()  # read on the host only at a log step: no sync per step
        step += 1
        done = step == steps
        validating = early_stopping is not None and (step % early_stopping[1] == 0 or done)
        if validating:
            validation_set, _, patience = early_stopping
            synchronize(device)
            validation_start = time.perf_counter()
            validations.append([step, accuracy(model, *validation_set)])
            model.train()
            if best_index is None or validations[-1][1] > validations[best_index][1]:
                best_index = len(validations) - 1
                best_model = weights_copy(model)
            best_step, best_accuracy = validations[best_index]
            print(f"  step {step}/{steps}  validation accuracy {100 * validations[-1][1]:.2f}%  "
                  f"(best {100 * best_accuracy:.2f}% at step {best_step})", flush=True)
            if len(validations) - 1 - best_index >= patience:
                stop_reason = f"no validation gain in {patience} validations after step {best_step}"
                done = True
            elif done:
                stop_reason = f"reached the {steps} steps"
            validation_seconds += time.perf_counter() - validation_start
        if step % log_every == 0 or done:
            mean_loss = recent_loss.item() / ((step - 1) % log_every + 1)  # .item() waits for the device
            if first_log is None:
                first_log = (step, time.perf_counter(), validation_seconds)
            print(f"  step {step}/{steps}  loss {mean_loss:.4f}", flush=True)
            recent_loss.zero_()
        if validating and save is not None:
            save_start = time.perf_counter()
            save(dict(step=step, done=done, final_loss=mean_loss, stop_reason=stop_reason, model=model.state_dict(),
                      optimizer=optimizer.state_dict(), rng=get_rng_state(device), recent_loss=recent_loss,
                      validations=validations, best_index=best_index,
                      best_model=None if best_index == len(validations) - 1 else best_model,
                      resumed_at_steps=resumed_at_steps, train_seconds=seconds_before + save_start - start))
            validation_seconds += time.perf_counter() - save_start
    synchronize(device)
    end = time.perf_counter()
    timed_steps = step - first_log[0] if first_log is not None else 0
    timed_seconds = end - first_log[1] - (validation_seconds - first_log[2]) if timed_steps else 0.0
    ms_per_step = 1e3 * timed_seconds / timed_steps if timed_steps else float("nan")
    result = dict(final_loss=mean_loss, ms_per_step=ms_per_step, train_seconds=seconds_before + end - start,
                  steps_run=step, best_step=step, stop_reason=stop_reason, resumed_at_steps=resumed_at_steps)
    if early_stopping is not None:
        model.load_state_dict(best_model)
        best_step, best_accuracy = validations[best_index]
        result.update(best_step=best_step, validation_accuracy=best_accuracy, validations=validations)
    return result


def weights_copy(model):
    """A copy of the model's state dict in which tied weights stay one tensor, as in the model."""
    copies = {}
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in copies:
            copies[tensor.data_ptr()] = tensor.detach().clone()
    return {name: copies[tensor.data_ptr()] for name, tensor in model.state_dict().items()}


def get_rng_state(device):
    """Every RNG a run could draw from after its start (the training itself draws none: no dropout)."""
    return dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(attn_type, peak_lr, args, model_shape, task, data, device, saved=None, save=None):
    """Train one model and measure it at every length: the run's record for the JSON. `saved` and
    `save`: train's, the state also holding the run's name and time."""
    train_set, batches, test_sets, validation_set = data
    run_start = time.perf_counter()
    seconds_before = 0.0
    if saved is not None:
        if (saved["attn_type"], saved["lr"]) != (attn_type, peak_lr):
            fail(f"{partial_state_path(args.out)} is the saved state of {saved['attn_type']} lr {saved['lr']:g}, "
                 f"not of the run due next, {attn_type} lr {peak_lr:g}: delete it to start afresh")
        seconds_before = saved["run_seconds"]
        print(f"{attn_type} lr {peak_lr:.0e}: resuming at step {saved['step']}", flush=True)
    model = build_model(attn_type, model_shape, args.kernel_backend, args.seed, device)
    early_stopping = (validation_set, task["eval_interval"], task["patience"]) if validation_set is not None else None
    save_run = None if save is None else lambda state: save(dict(
        state, attn_type=attn_type, lr=peak_lr, run_seconds=seconds_before + time.perf_counter() - run_start))
    trained = train(model, train_set, batches, lr_schedule(args.protocol, peak_lr, len(batches)),
                    log_every=max(1, len(batches) // 10), compile_backend=args.compile,
                    early_stopping=early_stopping, saved=saved, save=save_run)
    start = time.perf_counter()
    acc = {f"{factor}x": accuracy(model, *test_sets[factor]) for factor in LENGTH_FACTORS}
    eval_seconds = time.perf_counter() - start
    run_seconds = seconds_before + time.perf_counter() - run_start
    ms_per_step, train_seconds = trained.pop("ms_per_step"), trained.pop("train_seconds")
    record = dict(attn_type=attn_type, lr=peak_lr, seed=args.seed, compile=args.compile, accuracy=acc, **trained,
                  train_seconds=round(train_seconds, 2), ms_per_step=round(ms_per_step, 2),
                  eval_seconds=round(eval_seconds, 2), run_seconds=round(run_seconds, 2))
    resumed = f", resumed at step {' and '.join(map(str, trained['resumed_at_steps']))}" \
        if trained["resumed_at_steps"] else ""
    print(f"{attn_type:5s} lr {peak_lr:.0e}  " + "  ".join(f"{k} {100 * v:6.2f}%" for k, v in acc.items())
          + f"  | {trained['steps_run']} steps, best {trained['best_step']} ({trained['stop_reason']}{resumed})"
          f"  | train {train_seconds:.1f} s ({ms_per_step:.1f} ms/step after the first log), "
          f"test {eval_seconds:.1f} s, run {run_seconds:.1f} s", flush=True)
    return record


def fail(message):
    raise SystemExit(f"mqar.py: error: {message}")


def partial_state_path(out):
    """Where the runs writing their JSON to `out` keep their saved state: beside it, <name>.partial.pt."""
    out = Path(out)
    return out.with_name(f"{out.stem}.partial.pt")


def resumed_flags(args):
    """The arguments that a saved state must share with the command resuming it: all but --out."""
    return {name: value for name, value in vars(args).items() if name != "out"}


def load_partial_state(path, flags):
    """The saved state at `path` (None without one), refused if made with other flags."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        reason = str(error).partition("\n")[0]  # torch's unpickling errors run over several lines
        fail(f"{path} is not a readable saved state ({type(error).__name__}: {reason}): delete it to start afresh")
    if not isinstance(state, dict) or not {"flags", "runs", "current"} <= state.keys():
        fail(f"{path} is not a saved state of mqar.py: delete it to start afresh")

    def shown(value):
        return " ".join(map(str, value)) if isinstance(value, list) else str(value)

    differing = [f"--{name.replace('_', '-')} {shown(flags.get(name))} (saved: {shown(state['flags'].get(name))})"
                 for name in sorted(flags.keys() | state["flags"].keys())
                 if flags.get(name) != state["flags"].get(name)]
    if differing:
        fail(f"{path} holds the saved state of runs with other flags: {', '.join(differing)}; give its flags to "
             f"resume them, or delete it to start afresh")
    return state


def save_partial_state(path, state):
    """torch.save to a temporary file, then renamed: a stop while writing leaves the previous state whole."""
    temporary = path.with_name(f"{path.name}.tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=PROTOCOLS, default=PROTOCOLS[0],
                        help="kla-authors (default): the KLA authors' data, training and checkpoint; reslin-gap: "
                             "the earlier variant (see the module docstring)")
    parser.add_argument("--attn-types", nargs="+", default=["gdn", "kla", "rdn", "rkla"])
    parser.add_argument("--seed", type=int, default=42,
                        help="initial weights and batch order (kla-authors: the data come from the protocol's own "
                             "seeds); reslin-gap: the data too")
    parser.add_argument("--steps", type=int,
                        help=f"training steps, at most under kla-authors (default {PAPER_TASK['steps']})")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-3], help="(peak) lr; several = a sweep")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kernel-backend", default="auto", help="the config's kernel_backend")
    parser.add_argument("--train-length", type=int, help=f"default {PAPER_TASK['train_length']}")
    parser.add_argument("--kv-pairs", type=int, help=f"default {PAPER_TASK['kv_pairs']}")
    parser.add_argument("--eval-examples", type=int,
                        help=f"validation, and test per length (default {PAPER_TASK['eval_examples']})")
    parser.add_argument("--eval-interval", type=int, help=f"kla-authors: steps between validations (default "
                                                          f"{PAPER_EARLY_STOPPING['eval_interval']})")
    parser.add_argument("--patience", type=int,
                        help=f"kla-authors: validations without a gain before stopping (default "
                             f"{PAPER_EARLY_STOPPING['patience']})")
    parser.add_argument("--out", type=Path, default=Path(REPO) / "out" / "mqar.json",
                        help="JSON results (the saved state of runs under way beside it: <name>.partial.pt)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="train through torch.compile (backend: inductor when given alone)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and task: seconds on a CPU")
    args = parser.parse_args(argv)
    for name in ("steps", "train_length", "kv_pairs", "eval_examples", "eval_interval", "patience"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.protocol != "kla-authors":
        given = [f"--{name.replace('_', '-')}" for name in ("eval_interval", "patience") if getattr(args, name)]
        if given:
            parser.error(f"{' and '.join(given)}: for --protocol kla-authors only (reslin-gap has no validation set)")
    return args


def main(argv=None):
    args = parse_args(argv)
    model_shape = SMOKE_MODEL if args.smoke else PAPER_MODEL
    task = dict(SMOKE_TASK if args.smoke else PAPER_TASK)
    if args.protocol == "kla-authors":
        task.update(SMOKE_EARLY_STOPPING if args.smoke else PAPER_EARLY_STOPPING)
    for name in ("steps", "train_length", "kv_pairs", "eval_examples", "eval_interval", "patience"):
        if getattr(args, name) is not None:
            task[name] = getattr(args, name)
    device = torch.device(args.device)
    state_path, flags = partial_state_path(args.out), resumed_flags(args)
    saved = load_partial_state(state_path, flags)  # before any work: a state of other flags is refused
    runs = saved["runs"] if saved is not None else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"MQAR on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}"
          f"\nprotocol {args.protocol}\ntask {task}\nmodel {model_shape}, kernel_backend {args.kernel_backend}",
          flush=True)
    if saved is not None:
        print(f"resuming from {state_path}: {len(runs)} runs finished", flush=True)

    if args.protocol == "kla-authors":
        train_set, validation_set, test_sets = make_kla_authors_sets(task, model_shape["vocab_size"], device)
        batches = shuffled_batches(task["train_examples"], task["steps"], task["batch_size"],
                                   torch.Generator().manual_seed(args.seed)).to(device)
        data_seeds = dict(train=TRAIN_SEED, validation=VALIDATION_SEED,
                          **{f"test {factor}x": seed for factor, seed in TEST_SEEDS.items()})
    else:
        generator = torch.Generator(device).manual_seed(args.seed)
        train_set = make_mqar(task["train_examples"], task["train_length"], task["kv_pairs"],
                              model_shape["vocab_size"], generator)
        test_sets = make_eval_sets(task, model_shape["vocab_size"], generator)
        # One batch order for every run, so that the attn types and lrs see the same batches.
        batches = shuffled_batches(task["train_examples"], task["steps"], task["batch_size"], generator)
        validation_set, data_seeds = None, dict(all=args.seed)

    data = (train_set, batches, test_sets, validation_set)
    def save(current):  # the runs finished and the one under way
        save_partial_state(state_path, dict(flags=flags, runs=runs, current=current))

    for attn_type, lr in [(attn_type, lr) for attn_type in args.attn_types for lr in args.lr][len(runs):]:
        runs.append(run(attn_type, lr, args, model_shape, task, data, device,
                        saved=saved["current"] if saved is not None else None, save=save))
        saved = None
    selection = "validation_accuracy" if args.protocol == "kla-authors" else "1x test accuracy"
    best = {attn_type: max((r for r in runs if r["attn_type"] == attn_type),
                           key=lambda r: r.get("validation_accuracy", r["accuracy"]["1x"]))
            for attn_type in args.attn_types}

    print(f"\nprotocol {args.protocol}, the lr of the best {selection} per attn type:")
    print("| attn_type | lr | " + " | ".join(f"{f}x ({f * task['train_length']})" for f in LENGTH_FACTORS)
          + " | steps (best) | train s |")
    print("|---|---|" + "---|" * len(LENGTH_FACTORS) + "---|---|")
    for r in best.values():
        print(f"| {r['attn_type']} | {r['lr']:.0e} | "
              + " | ".join(f"{100 * r['accuracy'][f'{f}x']:.2f}%" for f in LENGTH_FACTORS)
              + f" | {r['steps_run']} ({r['best_step']}) | {r['train_seconds']:.0f} |")

    temporary = args.out.with_name(f"{args.out.name}.tmp")  # renamed once whole: a cut write leaves no result
    temporary.write_text(json.dumps(dict(
        protocol=args.protocol, task=task, model=model_shape, data_seeds=data_seeds,
        eval_lengths={f"{f}x": f * task["train_length"] for f in LENGTH_FACTORS}, best_selected_by=selection,
        device=str(device), kernel_backend=args.kernel_backend, argv=sys.argv[1:] if argv is None else argv,
        runs=runs, best={k: runs.index(v) for k, v in best.items()}), indent=1))
    os.replace(temporary, args.out)
    state_path.unlink(missing_ok=True)
    print(f"\nwrote {args.out}")
    return runs


if __name__ == "__main__":
    main()
