"""How often the residual rules' clip bites (issue 58): r_t = clip(v_t - S_{t-1}^T k_t, -c, c).

    python benchmarks/residual_clip.py                                  # rla and rdn, c = 1 and off, seeds 0 1 2
    python benchmarks/residual_clip.py --rules rla --clips 1 off --seeds 0 1 2
    python benchmarks/residual_clip.py --lm-runs benchmarks/results/compare --jobs 8   # the GPU job
    python benchmarks/residual_clip.py --summary                        # only the summary of what exists

Each run trains with train.py's `main` at the comparison's LM recipe (compare_rules.py: its
train.py flags, 500 steps of 8 x 1024 tokens, peak lr 1e-3), with the model's `residual_clip` set to
c through train.py's --residual-clip ("off": c = 1e9, which no residual reaches; the config takes
finite values only). Before and after training the script
measures, on the first --measure-tokens validation tokens in fp32, for every residual layer:

- clipped_fraction: the share of the residual's entries with |v - pred| > c, pred = S_{t-1}^T k_t
  (the base state before the token, the reference's definition, DESIGN.md section 1);
- max_abs_error, mean_abs_error: |v - pred|; mean_abs_residual: |r|, after the clip;
- value_rms, mean_abs_value, max_abs_value: the scale of v, which the clip is read against;
- error_exceeding: [threshold, share of entries with |v - pred| >= threshold] at the powers of
  two from 2^-12 to 2^3, so the share a clip of another c would cut reads off without a rerun.

pred is recomputed from the q, k, v, g and beta that the layer hands to `reslin_attention` (the
call is wrapped while measuring, the kernels are unchanged), by the torch reference's chunked
form (kernels_reslin_torch), one packed sequence at a time. Each run writes train.py's output
and its record, residual_clip.json, into <results>/<rule>-clip<c>-seed<seed>/; a finished run is
not run again, a stopped one resumes from its checkpoint. <results>/residual_clip.json gathers
every run's record and a summary per rule and clip: final validation loss (mean and sample
standard deviation over the seeds) and the clip's activity per layer at init and at the end.
--train-args passes more train.py flags, written with "=" (--train-args="--hidden-size 32").

The comparison trains RLA and RDN at c = 1 with these very flags: with --lm-runs naming its
results folder, a run it finished with the same train.py flags (its recorded arguments, folders
aside) and whose model is still there is measured in place, not trained again (the record says
where, under "trained_in"; the initial model is rebuilt from the seed). --jobs N runs N at once,
each its own process, as compare_rules.py --jobs does, with --start-within likewise.
"""

import argparse
import inspect
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import compare_rules  # noqa: E402  (a sibling script: benchmarks/ is on sys.path)
import kernels_reslin_torch as torch_reference  # noqa: E402
import train  # noqa: E402

RESIDUAL_RULES = ("rla", "rdn", "rkla")
DEFAULT_RULES = ("rla", "rdn")
OFF = "off"
NO_CLIP = 1e9  # "off": far above any residual the runs produce
DEFAULT_RESULTS = REPO / "benchmarks" / "results" / "residual_clip"
RECORD = "residual_clip.json"
EXCEEDING_EXPONENTS = range(-12, 4)  # thresholds 2^-12 .. 2^3 of error_exceeding


def clip_value(text):
    if text == OFF:
        return NO_CLIP
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a clip must be a finite number > 0 or {OFF!r}, got {text!r}")
    return value


def clip_label(clip):
    return OFF if clip == NO_CLIP else f"{clip:g}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="the runs' folder (default: benchmarks/results/residual_clip)")
    parser.add_argument("--rules", nargs="+", choices=RESIDUAL_RULES, default=list(DEFAULT_RULES))
    parser.add_argument("--clips", nargs="+", type=clip_value, default=[1.0, NO_CLIP],
                        help=f"clip thresholds c, {OFF!r} for none (default: 1 {OFF})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--corpus", type=Path, help="LM corpus folder (default: train.py's, the standard library)")
    parser.add_argument("--max-steps", type=int, default=compare_rules.LM_STEPS,
                        help=f"training steps (default {compare_rules.LM_STEPS})")
    parser.add_argument("--train-args", default="", help="more train.py flags for every run, as one string")
    parser.add_argument("--measure-tokens", type=int, default=65536,
                        help="validation tokens the clip's activity is measured on (default 65536)")
    parser.add_argument("--lm-runs", type=Path,
                        help="a compare_rules.py results folder: a run it finished with exactly this run's train.py "
                             "flags (its c = 1 runs) is measured there, not trained again")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each its own process (default 1), spread over the visible GPUs")
    parser.add_argument("--start-within", type=float, default=None, metavar="MINUTES",
                        help="with --jobs: start no run after this many minutes")
    parser.add_argument("--summary", action="store_true", help="only gather the records present; run nothing")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.start_within is not None and args.jobs == 1:
        parser.error("--start-within needs --jobs 2 or more")
    if args.lm_runs is not None and not args.lm_runs.is_dir():
        parser.error(f"--lm-runs {args.lm_runs} is not a folder")
    if len(set(args.seeds)) < len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds must be distinct and >= 0, got {' '.join(map(str, args.seeds))}")
    if len(set(args.clips)) < len(args.clips):
        parser.error("--clips must be distinct")
    if args.measure_tokens < 1:
        parser.error(f"--measure-tokens must be at least 1, got {args.measure_tokens}")
    return args


# ---------------------------------------------------------------------------------------------
# The clip's activity


def base_predictions(k, v, g, beta, update, cu_seqlens=None):
    """pred_t = S_{t-1}^T k_t, the base state before each token read with its key, fp32 [B, T, HV, Dv];
    k [B, T, H, Dk] (each key head serves HV / H value heads), v [B, T, HV, Dv], g and beta [B, T, HV]."""
    k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    k, v, g, beta = (x.float() for x in (k, v, g, beta))
    if cu_seqlens is None:
        return _predictions(k, v, g, beta, update)
    bounds = torch_reference.sequence_bounds(cu_seqlens)
    pieces = [_predictions(*(x[:, start:end] for x in (k, v, g, beta)), update)
              for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    return torch.cat(pieces, dim=1)


def _predictions(k, v, g, beta, update):
    T, chunk = k.shape[1], torch_reference.CHUNK_SIZE
    kc = torch_reference._to_chunks(k, chunk)
    vc = torch_reference._to_chunks(v, chunk)
    start = k.new_zeros(k.shape[0], v.shape[2], k.shape[3], v.shape[3])
    # exclusive=True returns pred beside the (unused here) outputs of the queries, here the keys.
    _, pred, _ = torch_reference._chunk_scan(kc, kc, vc, torch_reference._to_chunks(g, chunk),
                                             torch_reference._to_chunks(beta, chunk), start, update, exclusive=True)
    return torch_reference._from_chunks(pred, T)


class ResidualStats:
    """One layer's running sums over the residual's entries (token x value channel)."""

    def __init__(self):
        self.entries = self.clipped = 0
        self.max_error = self.max_value = 0.0
        self.sum_error = self.sum_residual = self.sum_value = self.sum_square_value = 0.0
        self.exceeding = torch.zeros(len(EXCEEDING_EXPONENTS), dtype=torch.float64)

    def add(self, error, value, clip):
        magnitude = error.abs()
        self.entries += magnitude.numel()
        self.clipped += int((magnitude > clip).sum())
        self.max_error = max(self.max_error, magnitude.max().item())
        self.sum_error += magnitude.double().sum().item()
        self.sum_residual += magnitude.clamp(max=clip).double().sum().item()
        self.sum_value += value.abs().double().sum().item()
        self.sum_square_value += value.double().square().sum().item()
        self.max_value = max(self.max_value, value.abs().max().item())
        thresholds = torch.tensor([2.0 ** e for e in EXCEEDING_EXPONENTS], device=magnitude.device)
        # How many thresholds each entry reaches, counted, then summed from the top: entries >= each one.
        reached = torch.bucketize(magnitude.flatten(), thresholds, right=True).bincount(minlength=len(thresholds) + 1)
        self.exceeding += reached.flip(0).cumsum(0).flip(0)[1:].double().cpu()

    def summary(self, clip):
        n = self.entries
        return {"clip": clip, "entries": n, "clipped_fraction": self.clipped / n, "max_abs_error": self.max_error,
                "mean_abs_error": self.sum_error / n, "mean_abs_residual": self.sum_residual / n,
                "value_rms": (self.sum_square_value / n) ** 0.5, "mean_abs_value": self.sum_value / n,
                "max_abs_value": self.max_value,
                "error_exceeding": [[2.0 ** e, count / n] for e, count in zip(EXCEEDING_EXPONENTS, self.exceeding.tolist())]}


@torch.no_grad()
def measure(model, batches):
    """The clip's activity per residual layer of `model` (at its own clip) over `batches`, in fp32: a
    list of ResidualStats summaries with the layer's index."""
    layers = [m for m in model.modules() if type(m).__name__ == "ResLinLinearAttention" and m.use_residual]
    if not layers:
        raise ValueError(f"the model ({model.config.attn_type}) has no residual layer: nothing to measure")
    modeling = sys.modules[type(layers[0]).__module__]
    original = modeling.reslin_attention
    signature = inspect.signature(original)
    stats = {layer.layer_idx: ResidualStats() for layer in layers}
    current = []

    def measured(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        error = a["v"].float() - base_predictions(a["k"], a["v"], a["g"], a["beta"], a["update"], a["cu_seqlens"])
        stats[current[-1]].add(error, a["v"].float(), a["clip"])
        return original(*args, **kwargs)

    handles = [layer.register_forward_pre_hook(lambda module, _: current.append(module.layer_idx)) for layer in layers]
    was_training = model.training
    model.eval()
    modeling.reslin_attention = measured
    try:
        for batch in batches:
            model(**batch, use_cache=False)
    finally:
        modeling.reslin_attention = original
        for handle in handles:
            handle.remove()
        model.train(was_training)
    clips = {layer.layer_idx: layer.residual_clip for layer in layers}
    return [{"layer": index, **stats[index].summary(clips[index])} for index in sorted(stats)]


# ---------------------------------------------------------------------------------------------
# Runs


def run_dir(results, rule, clip, seed):
    return results / f"{rule}-clip{clip_label(clip)}-seed{seed}"


def read_record(path):
    return json.loads(path.read_text()) if path.is_file() else {}


def measurement_batches(args, stream, measure_tokens):
    return train.validation_batches(stream, args.seq_len, args.batch_size, measure_tokens, torch.device(args.device))


def comparison_run(lm_runs, args):
    """The folder of the comparison's LM run in `lm_runs` (compare_rules.py's results) trained with
    exactly `args` but for its folders, finished and with its model saved; None if there is none."""
    if lm_runs is None:
        return None
    folder = compare_rules.lm_run_dir(lm_runs, args.attn_type, args.seed)
    metrics = compare_rules.finished_lm_run(folder)
    if metrics is None or not (folder / "config.json").is_file():
        return None
    own_folders = ("out_dir", "data_dir", "resume")
    theirs = {name: value for name, value in metrics["args"].items() if name not in own_folders}
    ours = {name: value for name, value in train.saved_args(args).items() if name not in own_folders}
    return folder if theirs == ours else None


def run_one(train_args, rule, clip, seed, results, measure_tokens, lm_runs=None):
    """Train one run (unless finished, or finished by the comparison in `lm_runs`) and measure the
    clip at init and at the end; returns its record."""
    folder = run_dir(results, rule, clip, seed)
    record_path = folder / RECORD
    record = read_record(record_path)
    if "end" in record:
        print(f"residual_clip: {folder.name} finished already", flush=True)
        return record
    argv = [*train_args, "--attn-type", rule, "--residual-clip", str(clip), "--seed", str(seed),
            "--out-dir", str(folder), "--data-dir", str(results / "data")]
    args = train.parse_args(argv)
    tokenizer, streams, _ = train.prepare_data(args)
    batches = measurement_batches(args, streams["validation"], measure_tokens)
    if "init" not in record:
        # train.build_model seeds itself: this is the run's own initial model.
        model = train.build_model(args, len(tokenizer)).to(args.device)
        record = {"rule": rule, "seed": seed, "clip": clip, "train_argv": argv, "measure_tokens": measure_tokens,
                  "init": measure(model, batches)}
        del model
        folder.mkdir(parents=True, exist_ok=True)
        train.write_json(record_path, record)
    trained = comparison_run(lm_runs, args)
    if trained is not None:
        print(f"residual_clip: {folder.name}: the comparison's run {trained} trained it", flush=True)
        record["trained_in"] = str(trained)
    else:
        trained = folder
        if compare_rules.finished_lm_run(folder) is None:
            resume = ["--resume"] if (folder / train.CHECKPOINT).exists() else []
            train.main(argv + resume)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(trained), trust_remote_code=True, dtype=torch.float32)
    if model.config.residual_clip != clip:
        raise SystemExit(f"residual_clip.py: error: {trained} holds a model with residual_clip "
                         f"{model.config.residual_clip}, not {clip}")
    record["end"] = measure(model.to(args.device), batches)
    record["final_validation"] = compare_rules.finished_lm_run(trained)["final_validation"]
    train.write_json(record_path, record)
    return record


# ---------------------------------------------------------------------------------------------
# Summary


def mean_and_spread(values):
    return {"mean": statistics.fmean(values), "stdev": statistics.stdev(values) if len(values) > 1 else None,
            "values": values}


def summarize(records):
    """Per rule and clip: the final validation loss over the seeds, and per layer the clipped share
    and the scale of errors and values at init and at the end, each over the seeds."""
    groups = {}
    for record in records:
        groups.setdefault((record["rule"], record["clip"]), []).append(record)
    summary = []
    for (rule, clip), group in sorted(groups.items()):
        group.sort(key=lambda record: record["seed"])
        entry = {"rule": rule, "clip": clip_label(clip), "seeds": [record["seed"] for record in group]}
        finished = [record for record in group if "end" in record]
        if finished:
            entry["final_loss"] = mean_and_spread([record["final_validation"]["loss"] for record in finished])
        for moment in ("init", "end"):
            present = [record[moment] for record in group if moment in record]
            if present:
                entry[moment] = [{"layer": layers[0]["layer"],
                                  **{name: mean_and_spread([layer[name] for layer in layers])
                                     for name in ("clipped_fraction", "max_abs_error", "mean_abs_residual", "value_rms")}}
                                 for layers in zip(*present)]
        summary.append(entry)
    return summary


def summary_lines(summary):
    lines = []
    for entry in summary:
        loss = entry.get("final_loss")
        loss_text = (f"final validation loss {loss['mean']:.4f}"
                     + (f" ± {loss['stdev']:.4f}" if loss["stdev"] is not None else "") if loss else "not finished")
        lines.append(f"{entry['rule']} clip {entry['clip']} (seeds {' '.join(map(str, entry['seeds']))}): {loss_text}")
        for moment in ("init", "end"):
            for layer in entry.get(moment, []):
                lines.append(f"  {moment:4} layer {layer['layer']}: clipped {layer['clipped_fraction']['mean']:.2e}, "
                             f"max |v - pred| {layer['max_abs_error']['mean']:.3g}, mean |r| "
                             f"{layer['mean_abs_residual']['mean']:.3g}, rms v {layer['value_rms']['mean']:.3g}")
    return lines


def gather(results, setting=None):
    """Every run's record under `results` and their summary, written to results/residual_clip.json."""
    records = [read_record(path) for path in sorted(results.glob(f"*/{RECORD}"))]
    path = results / RECORD
    saved = read_record(path)
    gathered = {"setting": setting or saved.get("setting"), "runs": records, "summary": summarize(records)}
    results.mkdir(parents=True, exist_ok=True)
    train.write_json(path, gathered)
    print("\n".join(summary_lines(gathered["summary"])), flush=True)
    return gathered


def main(argv=None):
    args = parse_args(argv)
    if args.summary:
        if not args.results.is_dir():
            raise SystemExit(f"residual_clip.py: error: --results {args.results} is not a folder")
        return gather(args.results)
    train_args = compare_rules.lm_train_args(args)
    setting = {"train_args": train_args, "measure_tokens": args.measure_tokens,
               "command": shlex.join(["python", "benchmarks/residual_clip.py", *(sys.argv[1:] if argv is None else argv)])}
    runs = [(rule, clip, seed) for rule in args.rules for clip in args.clips for seed in args.seeds]
    if args.jobs == 1:
        for run in runs:
            run_one(train_args, *run, args.results, args.measure_tokens, args.lm_runs)
        return gather(args.results, setting)
    pending = [run for run in runs if "end" not in read_record(run_dir(args.results, *run) / RECORD)]
    if pending:
        train.prepare_data(train.parse_args(train_args + ["--data-dir", str(args.results / "data")]))  # once for all
    shared = ["--results", str(args.results), "--max-steps", str(args.max_steps), "--measure-tokens",
              str(args.measure_tokens), f"--train-args={args.train_args}",
              *(["--corpus", str(args.corpus)] if args.corpus else []),
              *(["--lm-runs", str(args.lm_runs)] if args.lm_runs else [])]
    commands = [(run_dir(args.results, rule, clip, seed).name,
                 [sys.executable, __file__, *shared, "--rules", rule, "--clips", clip_label(clip), "--seeds", str(seed)])
                for rule, clip, seed in pending]
    failures = compare_rules.run_processes(commands, args.jobs, args.start_within, args.results / "logs", "residual_clip")
    gathered = gather(args.results, setting)
    if failures:
        raise SystemExit("residual_clip.py: error: runs failed:\n" + "\n".join(failures))
    return gathered


if __name__ == "__main__":
    main()
