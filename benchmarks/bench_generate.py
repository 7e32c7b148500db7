"""Generation through `model.generate` against the memory roofline, FLA's generate beside it in the same run.

Models: ours for every rule in --rules (gdn always: the other rules' goal is relative to it), loaded
as a user loads it (the repository's config.json through AutoConfig with trust_remote_code, the
shape's fields overridden, then AutoModelForCausalLM.from_config), and FLA's
GatedDeltaNetForCausalLM of the same shape where FLA imports (eager, as FLA runs it). Random
weights, bf16, on CUDA. Shapes (--shape), both untied with a vocabulary of 32000 and heads of 128:
400m: hidden 1024, 24 layers, 8 heads, SwiGLU 2816; 1.3b: hidden 2048, 24 layers, 16 heads,
SwiGLU 5632.

For every batch size in --batches, each model generates greedily after the same random prompt of
--prompt-tokens tokens, min_new_tokens = max_new_tokens = --new-tokens (EOS cannot stop it), after
a warm-up generate (compilation, autotuning, graph capture). Ours runs twice a batch, in one
process: with its default loop ("fast", config.generate_fast_path = True) and with transformers'
loop ("hf", generate_fast_path = False); with --loops, also "pdl" and "no-pdl", the default loop
with the step's kernels under programmatic dependent launch at every batch size and at none (by
default, up to kernels_reslin_triton_launch.PROGRAMMATIC_LAUNCH_MAX_ROWS rows), and "split", the
default loop with the step's products splitting K where their tiles are few, at every batch size
of their tl.dot path (by default up to kernels_reslin_triton_gemv.SPLIT_K_MAX_ROWS rows).

A row, where a step is one new token for every row of the batch:
  tok/s, us/step  the decode alone: (N - 1) new tokens x B / (time of generate(N) - time of
                  generate(1)), medians of --repeats calls (FLA: one call of N tokens)
  prefill ms      generate(1): the prompt's forward and the first token
  1st step ms     generate(2) - generate(1): the first step. Our loop replays the step's CUDA graph that
                  an earlier call kept; transformers' loop captures one at each call (tok/s carries it,
                  spread over the N - 1 steps)
  capture ms      our loop: generate(2) with the kept graph released first, minus generate(2): what a
                  call pays once where it must capture (a model's first call, or after its weights changed)
  GPU us          the GPU's busy time a step (the union of its kernels, copies and sets) from
                  torch.profiler over the same two calls: (busy(N) - busy(1)) / (N - 1); ops: their
                  count a step
  host us         us/step - GPU us: how long the GPU waits on the host a step
  limit us        the weight-read limit: bytes of the parameters a step reads once (every weight;
                  of the input embedding only B rows, lm_head whole) / the copy bandwidth measured
                  at the start (bytes read + written / time of a device-to-device copy); "of
                  limit": limit / us/step
  +state us       the same limit with the states (recurrent, short convolutions' windows) read and
                  written once, which grow with B; "of +state" likewise
  /FLA, /gdn      tok/s over FLA's at that batch; over ours gdn's on the same loop and batch
  goal            default loop only: gdn >= 2,000 tok/s at B = 1 and >= 20,000 at B = 16; every
                  other rule within 15% of gdn's tok/s
--top K lists under each row the K operations with the most GPU time a step.

    python benchmarks/bench_generate.py [--shape 400m|1.3b] [--batches 1 16] [--rules ...] [--loops fast hf pdl]
                                        [--no-fla] [--top 12]
    python benchmarks/bench_generate.py --smoke   # a tiny model and few tokens; runs on a CPU (torch backend, fp32)
"""

import argparse
import collections
import contextlib
import dataclasses
import importlib
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench_decode import copy_bandwidth
from common import DEVICE, DTYPE, REPO, RULES, import_fla, print_header, programmatic_launch, split_k, synchronize

SHAPES = {
    "400m": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=8, head_dim=128, expand_v=1.0,
                 intermediate_size=2816, tie_word_embeddings=False),
    "1.3b": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_heads=16, head_dim=128, expand_v=1.0,
                 intermediate_size=5632, tie_word_embeddings=False),
}
SHAPE = SHAPES["400m"]  # the shape bench_training, bench_context_parallel and saved_activations share
SMOKE_SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=1.0,
                   intermediate_size=128, tie_word_embeddings=False)
GDN_GOALS = {1: 2_000, 16: 20_000}  # batch size: ours gdn's tokens/s at least, default loop
RULE_GOAL = 0.85  # every other rule's tokens/s at least this share of gdn's, default loop
WARMUP_TOKENS = 32  # past the fast loop's first host syncs (one every 16 steps): no first use in a timed call


def load_ours(rule, shape, kernel_backend):
    # from_pretrained applies keyword overrides with setattr after __init__: the fields that
    # config.json's values would otherwise leave inconsistent (layer_types, num_v_heads) are set too.
    config = AutoConfig.from_pretrained(
        REPO, trust_remote_code=True, attn_type=rule, num_v_heads=shape["num_heads"],
        layer_types=["linear_attention"] * shape["num_hidden_layers"], kernel_backend=kernel_backend, **shape)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=DTYPE)
    return model.to(DEVICE).eval()


def load_fla(shape):
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    config = GatedDeltaNetConfig(use_short_conv=True, **shape)
    model = GatedDeltaNetForCausalLM(config).to(device=DEVICE, dtype=DTYPE).eval()
    if model.generation_config.pad_token_id is None:  # else every generate call warns that it picks one
        model.generation_config.pad_token_id = config.eos_token_id
    return model


def parameters(model):
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"


# label: (config.generate_fast_path, the settings changed from the modules' own: (context manager of
# common, the kernels module beside the model's it takes, on)) of the loops a model of ours may run
# (--loops); "fast" is the default loop, whose row the goals read.
LOOPS = {"fast": (True, ()), "hf": (False, ()),
         "pdl": (True, ((programmatic_launch, "kernels_reslin_triton_launch", True),)),
         "no-pdl": (True, ((programmatic_launch, "kernels_reslin_triton_launch", False),)),
         "split": (True, ((split_k, "kernels_reslin_triton_gemv", True),))}


def sibling_module(model, name):
    """The kernels module `name` beside the model's own modeling module (remote code loads its own
    copy)."""
    return importlib.import_module(type(model).__module__.rpartition(".")[0] + "." + name)


def weight_read_bytes(model, batch):
    """Bytes of the parameters a step reads once: all of them, but of an input embedding that is
    not also the output layer only the rows of the batch's tokens."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        rows = min(batch, embedding.shape[0])
        total -= (embedding.shape[0] - rows) * embedding.shape[1] * embedding.element_size()
    return total


def tensor_bytes(obj, seen=None):
    """Bytes of the distinct tensors reachable from `obj` through lists, tuples, dicts and the
    attributes of plain objects (modules excepted): a generation cache, whatever its layout."""
    seen = set() if seen is None else seen
    key = (obj.untyped_storage().data_ptr(), obj.storage_offset()) if isinstance(obj, torch.Tensor) else id(obj)
    if key in seen:
        return 0
    seen.add(key)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        items = vars(obj).values()
    else:
        return 0
    return sum(tensor_bytes(item, seen) for item in items)


def state_bytes(model, prompt):
    """Bytes a step moves for the states: every tensor of the cache after a short forward, read
    and written once."""
    with torch.no_grad():
        output = model(prompt[:, :4], use_cache=True)
    cache = next(output[name] for name in ("cache", "past_key_values") if output.get(name) is not None)
    return 2 * tensor_bytes(cache)


def busy_us(intervals):
    """Length of the union of (start, end) intervals: the time the GPU ran anything."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


@dataclasses.dataclass
class Activity:
    busy_us: float  # the union of the operations' intervals
    ops: float
    us_by_name: collections.Counter


def activity(ops):
    """The Activity of operations [(name, start us, end us)]."""
    us_by_name = collections.Counter()
    for name, start, end in ops:
        us_by_name[name] += end - start
    return Activity(busy_us((start, end) for _, start, end in ops), len(ops), us_by_name)


def kineto_ops(profile, device_type):
    """[(name, start us, end us)] of a finished torch.profiler profile's operations on `device_type`,
    read from kineto's results: torch's own events (profile.events()) would first build an object
    apiece, seconds for a generate call's ~10^5 kernels."""
    return [(event.name(), event.start_ns() / 1e3, (event.start_ns() + event.duration_ns()) / 1e3)
            for event in profile.profiler.kineto_results.events() if event.device_type() == device_type]


def gpu_activity(run):
    """What `run()` queues on the GPU (kernels, copies, sets; graph replays kernel by kernel)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    return activity(kineto_ops(profile, torch.autograd.DeviceType.CUDA))


@dataclasses.dataclass
class Measurement:
    tokens_per_s: float
    step_us: float
    prefill_ms: float
    first_step_ms: float
    capture_ms: float = None  # our loop's only
    gpu: Activity = None  # a step's, on CUDA only


def generate(model, prompt, new_tokens):
    output = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    if output.shape[1] != prompt.shape[1] + new_tokens:
        raise RuntimeError(f"generated {output.shape[1] - prompt.shape[1]} tokens, asked for {new_tokens}")


def median_seconds(run, repeats):
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model, prompt, new_tokens, repeats, whole_repeats):
    """The decode of generate(new_tokens) after generate(1) on `prompt`: see the module docstring."""
    first = lambda: generate(model, prompt, 1)  # noqa: E731
    two = lambda: generate(model, prompt, 2)  # noqa: E731
    whole = lambda: generate(model, prompt, new_tokens)  # noqa: E731
    steps = new_tokens - 1
    with torch.no_grad():
        generate(model, prompt, min(WARMUP_TOKENS, new_tokens))
        prefill = median_seconds(first, repeats)
        first_step = median_seconds(two, repeats) - prefill
        decode = median_seconds(whole, whole_repeats) - prefill
        capture = None
        if getattr(model.config, "generate_fast_path", False):
            released = lambda: (model.release_generation_graph(), two())  # noqa: E731
            capture = median_seconds(released, repeats) - prefill - first_step
        gpu = None
        if DEVICE == "cuda":
            before, after = gpu_activity(first), gpu_activity(whole)
            us_by_name = collections.Counter({name: (us - before.us_by_name[name]) / steps
                                              for name, us in after.us_by_name.items()})
            gpu = Activity((after.busy_us - before.busy_us) / steps, (after.ops - before.ops) / steps, us_by_name)
    return Measurement(steps * prompt.shape[0] / decode, 1e6 * decode / steps, 1e3 * prefill, 1e3 * first_step,
                       None if capture is None else 1e3 * capture, gpu)


class Table:
    """One row a model, loop and batch, printed as measured; the ratios to FLA and to gdn come
    from rows printed before (FLA's first, then ours gdn's)."""

    COLUMNS = (f"{'model':8} {'loop':7} {'B':>3} {'tok/s':>9} {'us/step':>8} {'prefill ms':>10} {'1st step ms':>11} "
               f"{'capture ms':>10} {'GPU us':>8} {'host us':>8} {'ops':>6} {'limit us':>8} {'of limit':>8} {'+state us':>9} {'of +state':>9} "
               f"{'/FLA':>6} {'/gdn':>6}  goal")

    def __init__(self, copy_bw, top):
        self.copy_bw, self.top = copy_bw, top
        self.fla = {}  # batch: FLA's tokens/s
        self.gdn = {}  # (loop, batch): ours gdn's tokens/s
        self.verdicts = []
        print(self.COLUMNS)

    def row(self, name, loop, default_loop, B, measured, weights, states):
        if name == "FLA gdn":
            self.fla[B] = measured.tokens_per_s
        elif name == "gdn":
            self.gdn[loop, B] = measured.tokens_per_s
        limit_us = 1e6 * weights / self.copy_bw
        state_limit_us = 1e6 * (weights + states) / self.copy_bw
        gpu = measured.gpu
        gpu_text = (f"{'-':>8} {'-':>8} {'-':>6}" if gpu is None else
                    f"{gpu.busy_us:8.1f} {measured.step_us - gpu.busy_us:8.1f} {gpu.ops:6.0f}")
        print(f"{name:8} {loop:7} {B:3d} {measured.tokens_per_s:9,.0f} {measured.step_us:8.1f} "
              f"{measured.prefill_ms:10.1f} {measured.first_step_ms:11.2f} "
              f"{'-' if measured.capture_ms is None else f'{measured.capture_ms:.1f}':>10} {gpu_text} {limit_us:8.1f} {limit_us / measured.step_us:8.1%} "
              f"{state_limit_us:9.1f} {state_limit_us / measured.step_us:9.1%} "
              f"{self.ratio(measured, self.fla.get(B), name == 'FLA gdn')} "
              f"{self.ratio(measured, self.gdn.get((loop, B)), name in ('gdn', 'FLA gdn'))}  "
              f"{self.goal(name, loop, default_loop, B, measured.tokens_per_s)}", flush=True)
        if gpu is not None:
            for op, us in gpu.us_by_name.most_common(self.top):
                print(f"    {us:8.1f} us a step  {op[:100]}")

    @staticmethod
    def ratio(measured, reference, itself):
        return f"{'':>6}" if itself or reference is None else f"{measured.tokens_per_s / reference:5.2f}x"

    def goal(self, name, loop, default_loop, B, tokens_per_s):
        if loop != default_loop or name == "FLA gdn":
            return ""
        if name == "gdn":
            if B not in GDN_GOALS:
                return ""
            goal, text = GDN_GOALS[B], f">= {GDN_GOALS[B]:,} tok/s"
        else:
            goal, text = RULE_GOAL * self.gdn[loop, B], f">= {RULE_GOAL:.2f}x gdn"
        met = tokens_per_s >= goal
        self.verdicts.append(met)
        return f"{text}: {'met' if met else 'NOT met'}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="400m")
    parser.add_argument("--batches", nargs="+", type=int, help="default 1 16 (--smoke: 1 2)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=["gdn", "kla", "rla", "rdn", "sgla", "rkla"])
    parser.add_argument("--repeats", type=int, default=3, help="calls timed a measure, the median kept")
    parser.add_argument("--loops", nargs="+", choices=list(LOOPS), default=["fast", "hf"],
                        help="our loops to time, fast first where given (pdl, no-pdl: fast with programmatic "
                             "dependent launch at every batch size, at none; split: fast with K split in the "
                             "products where their tiles are few, at every batch size)")
    parser.add_argument("--no-fla", action="store_true", help="leave FLA's generate out (the longest part of a run)")
    parser.add_argument("--top", type=int, default=0, help="list the TOP operations by GPU time a step under each row")
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="our config's kernel_backend (auto: what a user gets)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few tokens, to check the script itself")
    args = parser.parse_args(argv)
    shape = SMOKE_SHAPE if args.smoke else SHAPES[args.shape]
    copy_bytes = 2**31
    if args.smoke:
        args.prompt_tokens, args.new_tokens, args.kernel_backend, copy_bytes = 16, 8, "torch", 2**24
    args.batches = args.batches or ([1, 2] if args.smoke else [1, 16])
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: the decode is timed as generate(N) - generate(1)")

    fla = None if args.no_fla else import_fla()
    if DEVICE == "cuda":
        # A CUDA graph captured before the profiler's first session may be broken under it (pytorch issue
        # 75504; torch.profiler._utils._init_for_cuda_graphs does this): start and end one before any capture.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            pass
    copy_bw = copy_bandwidth(copy_bytes)
    print_header(f"generate: prompt {args.prompt_tokens} + {args.new_tokens} new tokens, greedy, "
                 f"{str(DTYPE).removeprefix('torch.')}, random weights, shape {'smoke' if args.smoke else args.shape}: "
                 + ", ".join(f"{k}={v}" for k, v in shape.items())
                 + f"; our kernel_backend {args.kernel_backend!r}; copy bandwidth {copy_bw / 1e12:.3g} TB/s "
                 f"(read + write)" + ("; FLA left out (--no-fla)" if args.no_fla else ""))
    generator = torch.Generator().manual_seed(0)
    # Ids from 3 up: clear of the pad, bos and eos ids 0-2 of our config.json.
    prompts = {B: torch.randint(3, shape["vocab_size"], (B, args.prompt_tokens), generator=generator).to(DEVICE)
               for B in args.batches}
    table = Table(copy_bw, args.top)
    sizes = []

    def run(name, load, whole_repeats):
        torch.manual_seed(0)
        model = load()
        sizes.append(f"{name} {parameters(model)}")
        model_loops = ["eager"] if name == "FLA gdn" else args.loops
        for B in args.batches:
            weights, states = weight_read_bytes(model, B), state_bytes(model, prompts[B])
            for loop in model_loops:
                settings = ()
                if loop in LOOPS:
                    model.config.generate_fast_path, settings = LOOPS[loop]
                with contextlib.ExitStack() as stack:
                    for setting, module, on in settings:
                        stack.enter_context(setting(sibling_module(model, module), on))
                    measured = measure(model, prompts[B], args.new_tokens, args.repeats, whole_repeats)
                table.row(name, loop, "fast" if loop in LOOPS else "eager", B, measured, weights, states)
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    if fla is not None:
        # One call of N tokens: FLA's eager generate takes ~13 s for 256 tokens at the 400m shape.
        run("FLA gdn", lambda: load_fla(shape), whole_repeats=1)
    for rule in dict.fromkeys(["gdn"] + args.rules):
        run(rule, lambda: load_ours(rule, shape, args.kernel_backend), args.repeats)
    print("parameters: " + ", ".join(sizes))
    met = sum(table.verdicts)
    print(f"goals: {met} of {len(table.verdicts)} met")


if __name__ == "__main__":
    main()
