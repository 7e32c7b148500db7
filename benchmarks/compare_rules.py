"""The papers' comparisons, small (issue 6): every rule pretrained with one config on one token
budget (validation loss, bits per byte), and the KLA paper's MQAR at 1x-8x the train length.
One markdown table at the end, with the command that reproduces each of its rows.

    python benchmarks/compare_rules.py                                # both parts, seed 0
    python benchmarks/compare_rules.py --parts lm --seeds 0 1 2       # the LM part, three seeds
    python benchmarks/compare_rules.py --rules gdn rdn --seeds 1      # a subset
    python benchmarks/compare_rules.py --table --seeds 0 1 2          # only the table of what exists

1. LM part: train.py's `main` once per rule and seed, with the same flags but --attn-type and
   --seed: the same data, the same batches for a seed, and a fixed --max-steps (never a time
   budget), so every rule sees exactly the same tokens. Each run writes its own folder,
   <results>/lm/<rule>-seed<seed>/ (train.py's output: metrics.json, model, checkpoint). The
   table takes the final validation loss and bits per byte over all held-out files, and tokens/s
   at the median training step (a short run's mean would weigh the first step's Triton compiles).
2. MQAR part: benchmarks/mqar.py's `main` once per rule and seed, the KLA paper's task under
   --mqar-protocol (default kla-authors, the KLA authors' protocol: 2 layers, 32 pairs, train
   length 256, lr 1e-3 constant, at most 10K steps, early stopping on the validation accuracy, the
   best checkpoint tested; reslin-gap: this comparison's earlier variant, see mqar.py), each into
   <results>/mqar/<rule>-seed<seed>.json; the table takes the test accuracy at 1x, 2x, 4x and 8x
   and names the protocol of each row. The seed sets the initial weights and the batch order
   (and, under reslin-gap only, the data). The protocol is one of the part's recorded flags (see
   below), so one results folder never mixes the protocols' results: the runs of the other
   protocol go in another --results folder.
3. The table: per rule, mean ± sample standard deviation over the seeds present and which seeds
   those are; "missing" where a requested run has no result, "—" where none was asked for. Below
   it: the setting each part ran in, each paper's claim beside the measured difference, and one
   command per row and part. --table prints it without running anything; every run ends with it.

Rules: --rules picks them (default: all six for both parts; the KLA paper's MQAR has gdn and
kla, ResLin's other rules run the same task). A run finished in --results is not run again, so
a comparison can be split over several processes (one GPU call each) and a stopped one
continued; an LM run stopped after a checkpoint resumes from it (train.py --resume), a
kla-authors MQAR run from the state it saved at its last validation (mqar.py keeps it beside the
run's JSON, in <results>/mqar/<rule>-seed<seed>.partial.pt, and removes it once the JSON is
written). A run with such a state counts as started, not done: "missing" in the table, "started"
in the last line printed, "compare: N of M runs done[, K more started ...]". A rule
whose LM run fails (a non-finite loss) is reported and the others still run. The first run in a
--results folder records the flags of each part in comparison.json; a later command with other
flags is refused, so one folder is one comparison. Extra flags go to every run through
--train-args / --mqar-args, written with "=" (argparse takes a lone "--smoke" after a space for a
flag of its own): --mqar-args=--smoke, --train-args="--hidden-size 32 --layers 2".

The LM config, sized for one H200: train.py's default model (rdn: 18.6M parameters with tied
embeddings, hidden 384, 8 layers, 6 heads of 64), rows of 1024 tokens, 8 rows a step, 500 steps
(50 of warm-up, cosine to 0.1 x 1e-3): 4.1M tokens per run. The corpus is the data, not the GPU
time, that bounds the budget: the default corpus (train.py's, the interpreter's standard
library) holds 2.5M training tokens on the H200's Python 3.12 (8.2M with 3.11.7 here), and a
94M-token run there overfit (validation loss best 4.16 at 13M tokens, 7.8 at the end). So the
budget stays under 2 epochs of it (1.6 there), with small batches so that 500 optimizer steps
fit in it. Each LM part prints its epochs and warns above 2. A longer comparison needs a bigger
corpus: --corpus FOLDER (any folder of *.py files; torch's own package holds ~46 MB, ~12M tokens)
with a higher --max-steps.

GPU time, measured (2026-12-05, 30a5ef8), one H100: the whole comparison, 18 LM runs and 18
kla-authors MQAR runs (fp32 weights under bf16 autocast, MQAR compiled), took three calls while
the machine stayed warm: `bash tools/gpu_run.sh compare` twice (572 s: 9 runs done and 4 MQAR runs
started; 523 s: 27 done, every MQAR run among them), then the last 9 LM runs all at once
(--jobs 9 --start-within 1) in 134 s, so the job now runs 8 a GPU at once where it ran 4 in those
calls. A kla-authors run takes at most 10K steps (fewer when it stops early) and 50 validations
of 0.5M tokens (forward only, ~0.1 s each); its steps run are in the table's notes. A GPU call is
at most 10 minutes, so repeat one command until the table is whole, bringing back only the small
JSON files.
--start-within holds back only the runs that would start over if cut: the LM runs (their first
checkpoint, at train.py's --save-interval 1000, comes after their 500 steps) and reslin-gap's
MQAR runs; a kla-authors MQAR run starts whenever a slot frees, and one that the call's end cuts
continues in the next call from its last validation (every 200 steps), if that call finds the
machine still warm: the saved states (54-72 MB each, git-ignored) stay in the working tree there
and are not brought back, so a fresh machine starts those runs over. At the call's end `timeout`
sends SIGTERM: the runs stop, and the table and its last line, the job's summary, still print.
The default --results, benchmarks/results/compare/, is in the repository (its .gitignore keeps
the JSON files only): what is committed there travels to the GPU machine with the tree, so a
rerun makes only what is missing.

    bash tools/gpu_run.sh compare    # on the GPU machine: the runs, then $OUT/compare.tgz
    # then here, in the repository's root: tar xzf <files_at>/compare.tgz, and commit the results;
    # python benchmarks/compare_rules.py --table --seeds 0 1 2 prints the table at any point.

Noise: initial weights and batch order come from the seed, the data split from the file paths,
so a rerun on a CPU repeats a run bit for bit (train.py's tests check it); bf16 GPU kernels need
not. The spread over seeds is the noise to read the differences against; MQAR's CPU calibration
saw seed-to-seed differences as large as the GDN-KLA gap, hence --seeds 0 1 2 for the table.
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import mqar  # noqa: E402  (a sibling script: benchmarks/ is on sys.path)
import train  # noqa: E402

LM_RULES = ("sgla", "rla", "gdn", "kla", "rdn", "rkla")
MQAR_RULES = LM_RULES  # the KLA paper's MQAR has gdn and kla; ResLin's other rules run it too
PARTS = ("lm", "mqar")
LM_STEPS = 500
DEFAULT_RESULTS = REPO / "benchmarks" / "results" / "compare"
# The comparison's train.py flags besides --max-steps (the rest are train.py's defaults): see the
# module docstring for why the batch is small.
LM_CONFIG = ["--tie-word-embeddings", "--batch-size", "8", "--seq-len", "1024", "--warmup-steps", "50"]
# What compare_rules itself sets in every LM run: --train-args must leave them alone. A time budget
# or --resume from the command line would make the runs see different tokens.
OWNED_TRAIN_FLAGS = ("attn_type", "seed", "out_dir", "data_dir", "corpus", "max_steps", "time_budget", "resume")
OWNED_MQAR_FLAGS = ("--attn-types", "--seed", "--out", "--protocol")
CONFIG_FILE = "comparison.json"
MAX_EPOCHS = 2
# (part, metric, rule, baseline, what the paper measured): the paper found the rule better.
PAPER_CLAIMS = (
    ("lm", "loss", "rdn", "gdn", "RDN 16.57 vs GDN 17.27 WikiText perplexity, 1.5B parameters, 100B tokens"),
    ("lm", "loss", "rla", "sgla", "RLA 17.35 vs sGLA 17.63 WikiText perplexity, 1.5B parameters, 100B tokens"),
    ("lm", "loss", "kla", "gdn", "KLA 8.09 vs GDN 8.50 validation perplexity, 0.4B parameters, 1B tokens"),
    ("mqar", "8x", "kla", "gdn", "KLA 73.84% vs GDN 66.81% at 8x the train length, the kla-authors protocol"),
)
# An MQAR run whose test accuracy at the train length stays below this (in %) never left chance (1 in
# 4096 under kla-authors): early stopping ended it on the plateau that precedes learning. Its
# extrapolation says nothing about the rule, so the claims leave it out and name it.
LEARNED_ABOVE = 1.0


def fail(message):
    raise SystemExit(f"compare_rules.py: error: {message}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="the comparison's folder (default: the repository's, benchmarks/results/compare)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--rules", nargs="+", choices=LM_RULES,
                        help=f"default: {' '.join(LM_RULES)} (LM), {' '.join(MQAR_RULES)} (MQAR)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--corpus", type=Path, help="LM corpus folder (default: train.py's, the standard library)")
    parser.add_argument("--max-steps", type=int, default=LM_STEPS, help=f"LM training steps (default {LM_STEPS})")
    parser.add_argument("--train-args", default="", help="more train.py flags for every LM run, as one string")
    parser.add_argument("--mqar-protocol", choices=mqar.PROTOCOLS, default=mqar.PROTOCOLS[0],
                        help=f"benchmarks/mqar.py's --protocol (default {mqar.PROTOCOLS[0]}, the KLA authors')")
    parser.add_argument("--mqar-args", default="", help="more benchmarks/mqar.py flags for every MQAR run")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each its own process (default 1), spread over the visible GPUs")
    parser.add_argument("--start-within", type=float, default=None, metavar="MINUTES",
                        help="with --jobs: start no run that would start over if cut (LM runs, reslin-gap MQAR "
                             "runs) after this many minutes, so that a time-limited call ends with whole runs; "
                             "kla-authors MQAR runs save their state at each validation and may start later")
    parser.add_argument("--table", action="store_true", help="print the table of the results present; run nothing")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) < len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds must be distinct and >= 0, got {' '.join(map(str, args.seeds))}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.start_within is not None and args.jobs == 1:
        parser.error("--start-within needs --jobs 2 or more")
    return args


# ---------------------------------------------------------------------------------------------
# Where results live


def lm_run_dir(results, rule, seed):
    return results / "lm" / f"{rule}-seed{seed}"


def mqar_result_path(results, rule, seed):
    return results / "mqar" / f"{rule}-seed{seed}.json"


def saved_state_path(results, part, rule, seed):
    """Where a run stopped before its end keeps the state it resumes from: an LM run's checkpoint
    (train.py writes one every --save-interval steps), an MQAR run's state saved at its last
    validation (mqar.py, kla-authors)."""
    if part == "lm":
        return lm_run_dir(results, rule, seed) / train.CHECKPOINT
    return mqar.partial_state_path(mqar_result_path(results, rule, seed))


def finished_lm_run(run_dir):
    """The run's metrics if it finished (train.py writes the final validation last), else None."""
    path = run_dir / "metrics.json"
    metrics = json.loads(path.read_text()) if path.is_file() else {}
    return metrics if "final_validation" in metrics else None


def finished_runs(results, part):
    """{rule: {seed: result}} of the finished runs of a part in `results`: an LM run's metrics,
    or an MQAR run's record (the best lr's, when mqar.py swept several)."""
    runs = {}
    pattern = "lm/*-seed*/" if part == "lm" else "mqar/*-seed*.json"
    for path in sorted(results.glob(pattern)):
        rule, seed = path.name.removesuffix(".json").rsplit("-seed", 1)
        if rule not in LM_RULES:
            continue
        if part == "lm":
            result = finished_lm_run(path)
        else:
            saved = json.loads(path.read_text())
            # A result without a protocol predates mqar.py's --protocol: reslin-gap made it.
            result = {**saved["runs"][saved["best"][rule]], "task": saved["task"], "device": saved["device"],
                      "eval_lengths": saved["eval_lengths"], "protocol": saved.get("protocol", "reslin-gap")}
        if result is not None:
            runs.setdefault(rule, {})[int(seed)] = result
    return runs


# ---------------------------------------------------------------------------------------------
# Running


def lm_flags(args):
    """The compare_rules flags that fix the LM part's config (for its record and its commands)."""
    corpus = ["--corpus", str(args.corpus)] if args.corpus else []
    extra = [f"--train-args={args.train_args}"] if args.train_args else []
    return [*corpus, "--max-steps", str(args.max_steps), *extra]


def lm_train_args(args):
    """train.py's flags shared by every LM run, refused if --train-args sets what compare_rules
    sets (it would be overridden or make the rules see different tokens)."""
    corpus = ["--corpus", str(args.corpus)] if args.corpus else []
    shared = [*LM_CONFIG, *corpus, "--max-steps", str(args.max_steps)]
    extra = shlex.split(args.train_args)
    without, with_extra = train.parse_args(shared), train.parse_args(shared + extra)
    overridden = [name for name in OWNED_TRAIN_FLAGS if getattr(without, name) != getattr(with_extra, name)]
    if overridden:
        fail(f"--train-args must not set {', '.join('--' + name.replace('_', '-') for name in overridden)}: "
             f"compare_rules sets the rule, seed, folders, corpus and steps (--rules, --seeds, --results, --corpus, "
             f"--max-steps), and every rule trains on the same steps")
    return shared + extra


def lm_run_argv(train_args, rule, seed, results):
    argv = [*train_args, "--attn-type", rule, "--seed", str(seed), "--out-dir", str(lm_run_dir(results, rule, seed)),
            "--data-dir", str(results / "data")]
    if (lm_run_dir(results, rule, seed) / train.CHECKPOINT).exists():
        argv.append("--resume")  # a run stopped after a checkpoint: train.py continues it exactly
    return argv


def mqar_flags(args):
    """The compare_rules flags that fix the MQAR part's config (for its record and its commands)."""
    return ["--mqar-protocol", args.mqar_protocol, *([f"--mqar-args={args.mqar_args}"] if args.mqar_args else [])]


def mqar_args(args):
    """mqar.py's flags shared by every MQAR run, the protocol first: it is part of the recorded
    config, so that a results folder refuses runs of another protocol."""
    extra = shlex.split(args.mqar_args)
    owned = [token for token in extra if token.split("=")[0] in OWNED_MQAR_FLAGS]
    if owned:
        fail(f"--mqar-args must not set {', '.join(owned)}: compare_rules sets them (--rules, --seeds, --results, "
             f"--mqar-protocol)")
    return ["--protocol", args.mqar_protocol, *extra]


def record_config(results, configs):
    """Write each part's config into results/comparison.json, or refuse one that differs from
    the config its earlier runs there were made with. "jobs" keeps the most runs ever made at
    once: those runs' tokens/s were measured on a shared GPU."""
    path = results / CONFIG_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    for part, config in configs.items():
        if part in record and record[part]["argv"] != config["argv"]:
            fail(f"{results} holds {part} runs made with the flags {shlex.join(record[part]['argv'])}; this "
                 f"command gives {shlex.join(config['argv'])}: repeat their flags, or choose another --results")
        jobs = max(record.get(part, {}).get("jobs", 1), config.get("jobs", 1))
        record[part] = {**config, "jobs": jobs}
    results.mkdir(parents=True, exist_ok=True)
    train.write_json(path, record)


def print_epochs(run_argv):
    """The LM budget in epochs of the train split (preparing the data, cached for the runs)."""
    run_args = train.parse_args(run_argv)
    meta = train.prepare_data(run_args)[2]
    tokens = run_args.max_steps * run_args.batch_size * run_args.seq_len
    train_tokens = meta["splits"]["train"]["tokens"]
    epochs = tokens / train_tokens
    print(f"compare: each LM run: {run_args.max_steps} steps x {run_args.batch_size} x {run_args.seq_len} = "
          f"{tokens:,} tokens, {epochs:.2f} epochs of the train split ({train_tokens:,} tokens of "
          f"{meta['corpus_name']})", flush=True)
    if epochs > MAX_EPOCHS:
        print(f"compare: WARNING: more than {MAX_EPOCHS} epochs: the validation loss will measure overfitting too; "
              f"give a bigger --corpus or fewer --max-steps", flush=True)


def run_lm_part(train_args, rules, seeds, results):
    """Train each rule at each seed not finished yet, seed by seed (a cut comparison then holds
    whole seeds). Returns the runs that failed, with train.py's message."""
    pending = [(rule, seed) for seed in seeds for rule in rules if not finished_lm_run(lm_run_dir(results, rule, seed))]
    print(f"compare: lm: {len(rules) * len(seeds) - len(pending)} of {len(rules) * len(seeds)} runs finished already",
          flush=True)
    if pending:
        print_epochs(lm_run_argv(train_args, *pending[0], results))
    failures = []
    for rule, seed in pending:
        print(f"compare: lm {rule} seed {seed}", flush=True)
        try:
            train.main(lm_run_argv(train_args, rule, seed, results))
        except SystemExit as error:  # e.g. a non-finite loss: the other rules still run
            print(f"compare: lm {rule} seed {seed} FAILED: {error}", flush=True)
            failures.append(f"lm {rule} seed {seed}: {error}")
    return failures


def run_mqar_part(extra_args, rules, seeds, results):
    """Run each rule at each seed not finished yet, seed by seed; mqar.py resumes a run from its
    saved state, writes its JSON whole and then removes the state."""
    pending = [(rule, seed) for seed in seeds for rule in rules if not mqar_result_path(results, rule, seed).is_file()]
    started = sum(saved_state_path(results, "mqar", rule, seed).is_file() for rule, seed in pending)
    print(f"compare: mqar: {len(rules) * len(seeds) - len(pending)} of {len(rules) * len(seeds)} runs finished "
          f"already, {started} to resume from their saved state", flush=True)
    for rule, seed in pending:
        print(f"compare: mqar {rule} seed {seed}", flush=True)
        mqar.main([*extra_args, "--attn-types", rule, "--seed", str(seed), "--out",
                   str(mqar_result_path(results, rule, seed))])


def visible_gpus():
    """The GPUs to spread concurrent runs over, as values of CUDA_VISIBLE_DEVICES; [None] without
    CUDA (the runs then share the CPU)."""
    count = torch.cuda.device_count()
    if count == 0:
        return [None]
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",")[:count] if listed else [str(index) for index in range(count)]


def run_concurrently(args, configs, lm_rules, mqar_rules):
    """Each pending run as its own compare_rules.py process (one part, rule and seed), --jobs at
    once, its output in <results>/logs/. Returns the runs that failed, with the end of their log."""
    pending = []
    for seed in args.seeds:  # seed by seed, as run_lm_part: a cut comparison then holds whole seeds
        pending += [("mqar", rule, seed) for rule in mqar_rules if not mqar_result_path(args.results, rule, seed).is_file()]
        pending += [("lm", rule, seed) for rule in lm_rules if not finished_lm_run(lm_run_dir(args.results, rule, seed))]
    first_lm = next((run for run in pending if run[0] == "lm"), None)
    if first_lm:
        print_epochs(lm_run_argv(configs["lm"]["argv"], *first_lm[1:], args.results))  # the data, once for all
    runs = [(f"{part}-{rule}-seed{seed}",
             [sys.executable, __file__, "--results", str(args.results), "--parts", part, "--rules", rule,
              "--seeds", str(seed), *configs[part]["flags"]]) for part, rule, seed in pending]
    # kla-authors' MQAR runs save their state at each validation (every 200 steps): one cut by the
    # call's end continues in the next. An LM run checkpoints every --save-interval steps (train.py's
    # default, 1000, is past the comparison's 500): it would start over.
    resumable = {f"mqar-{rule}-seed{seed}" for part, rule, seed in pending
                 if part == "mqar" and args.mqar_protocol == "kla-authors"}
    return run_processes(runs, args.jobs, args.start_within, args.results / "logs", "compare", resumable)


class Stopped(Exception):
    """SIGTERM reached run_processes: the GPU call's time limit (`timeout` signals every process)."""


def raise_stopped(signum, frame):
    raise Stopped


def run_processes(runs, jobs, start_within, logs, tag, resumable=()):
    """Each (name, command) of `runs` as its own process, `jobs` at once, in order, its output in
    logs/<name>.log. After `start_within` minutes (None: no limit) no run starts but those named
    in `resumable` (they save their state as they go: what a call's end cuts, the next call
    continues), so that a time-limited call ends with whole runs. Runs go to the visible GPU
    running the fewest. On SIGTERM the runs are stopped and it returns, so that the caller can
    still report. Returns the runs that failed, with the end of their log."""
    print(f"{tag}: {len(runs)} runs to make, {jobs} at once (logs in {logs})", flush=True)
    logs.mkdir(parents=True, exist_ok=True)
    # One thread per run: PyTorch would otherwise start a thread per core in each process.
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    gpus = visible_gpus()
    if gpus != [None]:
        print(f"{tag}: runs spread over {len(gpus)} GPU(s), each on the one running the fewest", flush=True)
    waiting, running, failures = list(runs), [], []
    start = time.monotonic()
    previous_handler = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        while waiting or running:
            if start_within is not None and time.monotonic() - start > 60 * start_within:
                late = [name for name, _ in waiting if name not in resumable]
                if late:
                    print(f"{tag}: {len(late)} runs not started: --start-within {start_within:g} minutes has passed"
                          + (f" ({len(waiting) - len(late)} that resume where stopped still start)"
                             if len(late) < len(waiting) else ""), flush=True)
                    waiting = [(name, command) for name, command in waiting if name in resumable]
            while waiting and len(running) < jobs:
                name, command = waiting.pop(0)
                log = logs / f"{name}.log"
                gpu = min(gpus, key=[entry[3] for entry in running].count)
                run_environment = environment if gpu is None else {**environment, "CUDA_VISIBLE_DEVICES": gpu}
                with open(log, "w") as output:
                    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=run_environment)
                running.append((name, log, process, gpu))
            finished = next((entry for entry in running if entry[2].poll() is not None), None)
            if finished is None:
                time.sleep(1)
                continue
            running.remove(finished)
            name, log, process, _ = finished
            if process.returncode == 0:
                print(f"{tag}: {name} done", flush=True)
            else:
                tail = "\n".join(log.read_text().splitlines()[-5:])
                print(f"{tag}: {name} FAILED (exit {process.returncode}):\n{tail}", flush=True)
                failures.append(f"{name}: exit {process.returncode}, see {log}")
    except Stopped:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop is enough: report what was made
        print(f"{tag}: stopped by SIGTERM: {len(running)} runs cut short ("
              f"{', '.join(name for name, *_ in running) or 'none'}; those that save their state resume in the next "
              f"call), {len(waiting)} not started", flush=True)
        for _, _, process, _ in running:
            process.terminate()  # `timeout` has signalled them already; a `kill` of this process alone has not
        for _, _, process, _ in running:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    return failures


# ---------------------------------------------------------------------------------------------
# The table


def mean_and_spread(values, digits):
    """'mean ± sample standard deviation' of the values; the mean alone for one value."""
    mean = f"{statistics.fmean(values):.{digits}f}"
    return f"{mean} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else mean


def seeds_cell(present, requested):
    missing = [seed for seed in requested if seed not in present]
    parts = [" ".join(map(str, sorted(present)))] if present else []
    if missing:
        parts.append("missing " + " ".join(map(str, missing)))
    return ", ".join(parts) or "—"


def timed_run_flags(rule, steps, out_dir, data_dir):
    """train.py flags for a short run timed by its median step (median_step_tokens_per_second):
    no evaluation nor checkpoint before its end."""
    return ["--attn-type", rule, "--max-steps", str(steps), "--eval-interval", str(10 * steps),
            "--save-interval", str(10 * steps), "--eval-tokens", "65536", "--out-dir", str(out_dir),
            "--data-dir", str(data_dir)]


def median_step_tokens_per_second(metrics):
    """Training tokens per second at the median step: the first step's compiles and the
    evaluations between steps would weigh heavily in a short run's mean."""
    seconds = [0.0] + [entry["seconds"] for entry in metrics["train"]]
    step_seconds = statistics.median(b - a for a, b in zip(seconds, seconds[1:]))
    return metrics["args"]["batch_size"] * metrics["args"]["seq_len"] / step_seconds


def lm_setting(metrics):
    data, final, args = metrics["data"], metrics["final_validation"], metrics["args"]
    train_split = data["splits"]["train"]
    return (f"{data['corpus_name']}: {train_split['files']} train files ({train_split['tokens']:,} tokens), "
            f"{data['splits']['validation']['files']} held-out files ({final['tokens']:,} predicted tokens); "
            f"{metrics['step']} steps of {args['batch_size']} x {args['seq_len']} tokens = {metrics['tokens_seen']:,} "
            f"tokens ({metrics['tokens_seen'] / train_split['tokens']:.2f} epochs), {metrics['precision']} on "
            f"{metrics['device']}")


def mqar_setting(record):
    task = record["task"]
    if record["protocol"] == "kla-authors":
        training = (f"at most {task['steps']} steps of {task['batch_size']} at a constant lr {record['lr']:g}, "
                    f"validated every {task['eval_interval']} steps, stopped after {task['patience']} validations "
                    f"without a gain, the best checkpoint tested")
    else:
        training = (f"{task['steps']} steps of {task['batch_size']}, lr {record['lr']:g} (warm-up, cosine decay), "
                    f"the last model tested")
    return (f"protocol {record['protocol']}: {task['kv_pairs']} pairs, trained at length {task['train_length']}, "
            f"{training}; {task['eval_examples']} test sequences per length, on {record['device']}")


def protocol_cell(mqar_runs_of_rule):
    """The MQAR protocol(s) of a rule's runs; "—" without any."""
    return " + ".join(sorted({record["protocol"] for record in mqar_runs_of_rule.values()})) or "—"


def metric_values(lm_runs, mqar_runs):
    """{(part, metric): {rule: {seed: its value}}}, seeds in increasing order."""
    values = defaultdict(dict)
    for rule, by_seed in lm_runs.items():
        seeds = sorted(by_seed)
        for metric in ("loss", "bits_per_byte"):
            values[("lm", metric)][rule] = {seed: by_seed[seed]["final_validation"][metric] for seed in seeds}
        values[("lm", "tokens_per_second")][rule] = {seed: median_step_tokens_per_second(by_seed[seed])
                                                     for seed in seeds}
    for rule, by_seed in mqar_runs.items():
        for length in (f"{factor}x" for factor in mqar.LENGTH_FACTORS):
            values[("mqar", length)][rule] = {seed: 100 * by_seed[seed]["accuracy"][length]
                                              for seed in sorted(by_seed)}
    return values


def table_lines(values, lm_runs, mqar_runs, lm_rules, mqar_rules, seeds):
    any_mqar = next((record for by_seed in mqar_runs.values() for record in by_seed.values()), None)
    lengths = [f"{f}x" + (f" ({any_mqar['eval_lengths'][f'{f}x']})" if any_mqar else "") for f in mqar.LENGTH_FACTORS]
    lines = ["| rule | val loss (nats/token) | bits/byte | tokens/s | LM seeds | "
             + " | ".join(f"MQAR {length}" for length in lengths) + " | MQAR seeds | MQAR protocol |",
             "|---|" + "---|" * (6 + len(lengths))]
    columns = (("lm", (("loss", 4), ("bits_per_byte", 4), ("tokens_per_second", 0)), lm_rules, lm_runs),
               ("mqar", tuple((f"{f}x", 2) for f in mqar.LENGTH_FACTORS), mqar_rules, mqar_runs))
    for rule in LM_RULES:
        if not any(rule in group for group in (lm_rules, mqar_rules, lm_runs, mqar_runs)):
            continue
        cells = [rule]
        for part, metrics, requested_rules, runs in columns:
            requested = rule in requested_rules
            for metric, digits in metrics:
                present = list(values[(part, metric)].get(rule, {}).values())
                cells.append(mean_and_spread(present, digits) if present else "missing" if requested else "—")
            cells.append(seeds_cell(runs.get(rule, {}), seeds if requested else []))
        cells.append(protocol_cell(mqar_runs.get(rule, {})))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def setting_lines(lm_runs, mqar_runs, jobs):
    lines = ["Mean ± sample standard deviation over the seeds listed; MQAR in % of the answers right. tokens/s: "
             "training tokens per second at the median step."]
    if jobs > 1:
        lines.append(f"Up to {jobs} runs at once shared the GPU(s): tokens/s are lower than a run alone, and noisy.")
    for part, runs, setting in (("LM", lm_runs, lm_setting), ("MQAR", mqar_runs, mqar_setting)):
        settings = sorted({setting(result) for by_seed in runs.values() for result in by_seed.values()})
        warning = " (WARNING: its runs differ)" if len(settings) > 1 else ""
        lines += [f"{part}{warning}: {text}" for text in settings]
    steps = [f"{rule} seed {seed} {record['steps_run']} ({record['best_step']})" for rule in LM_RULES
             for seed, record in sorted(mqar_runs.get(rule, {}).items()) if "steps_run" in record]
    if steps:
        lines.append("MQAR steps run (best step): " + ", ".join(steps))
    return lines


def by_seed_lines(values):
    """The validation loss and MQAR's accuracy at 1x and 8x seed by seed: a run that failed shows
    here, where a mean hides it."""
    columns = (("lm", "loss", "val loss", 3), ("mqar", "1x", "MQAR 1x", 1), ("mqar", "8x", "MQAR 8x", 1))
    not_learned = not_learned_runs(values)
    lines = ["| rule | " + " | ".join(f"{name} by seed" for _, _, name, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for rule in (r for r in LM_RULES if any(r in values[(part, metric)] for part, metric, _, _ in columns)):
        cells = []
        for part, metric, _, digits in columns:
            marked = not_learned if part == "mqar" else set()
            cells.append(" / ".join(f"{value:.{digits}f}" + ("*" if (rule, seed) in marked else "")
                                    for seed, value in values[(part, metric)].get(rule, {}).items()) or "—")
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    lines.append("Seed by seed in the order of the seeds listed above"
                 + (f"; *: never learned (accuracy at 1x below {LEARNED_ABOVE:g}%)." if not_learned else "."))
    return lines


def not_learned_runs(values):
    """{(rule, seed)} of the MQAR runs that never left chance."""
    return {(rule, seed) for rule, by_seed in values[("mqar", "1x")].items()
            for seed, accuracy in by_seed.items() if accuracy < LEARNED_ABOVE}


def claim_lines(values):
    """Each paper's claim beside the measured differences, seed by seed: a seed fixes the data order
    and the initial weights, so a rule and its baseline pair up at the seeds both have (seed to seed
    variation moves every rule alike, and the spread of one rule's runs overstates the noise of a
    difference). MQAR runs that never learned are left out and named."""
    lines = ["The papers' claims (the rule better than the baseline) beside these results, seed by seed:"]
    not_learned = not_learned_runs(values)
    for part, metric, rule, baseline, paper in PAPER_CLAIMS:
        ours, theirs = values[(part, metric)].get(rule, {}), values[(part, metric)].get(baseline, {})
        name, digits = ("validation loss", 4) if metric == "loss" else (f"MQAR accuracy at {metric} (points)", 2)
        shared = ours.keys() & theirs.keys()
        failed = sorted((r, seed) for r in (rule, baseline) for seed in shared
                        if part == "mqar" and (r, seed) in not_learned)
        seeds = sorted(shared - {seed for _, seed in failed})
        left_out = "".join(f"; {r} seed {seed} never learned, left out" for r, seed in failed)
        if not seeds:
            lines.append(f"- {rule} - {baseline} {name}: missing{left_out} ({paper})")
            continue
        differences = [ours[seed] - theirs[seed] for seed in seeds]
        better = sum(d < 0 if metric == "loss" else d > 0 for d in differences)
        verdict = (f"{rule} better at every seed, as in the paper" if better == len(seeds) else
                   f"{rule} better at no seed, unlike the paper" if not better else
                   f"{rule} better at {better} of {len(seeds)} seeds")
        by_seed = ", ".join(f"{d:+.{digits}f}" for d in differences)
        lines.append(f"- {rule} - {baseline} {name}: {statistics.fmean(differences):+.{digits}f} on average "
                     f"(seeds {' '.join(map(str, seeds))}: {by_seed}){left_out}: {verdict} ({paper})")
    return lines


def command_lines(results, configs, lm_runs, mqar_runs, lm_rules, mqar_rules, seeds):
    shown = results.resolve().relative_to(REPO) if results.resolve().is_relative_to(REPO) else results
    results_flag = [] if results.resolve() == DEFAULT_RESULTS else ["--results", str(shown)]
    lines = [f"Commands, one per row and part (runs finished in {shown} are skipped: give an empty --results "
             f"to recompute); each run's own train.py / mqar.py command is in its metrics.json / JSON:", "```"]
    for part, rules, runs in (("lm", lm_rules, lm_runs), ("mqar", mqar_rules, mqar_runs)):
        flags = configs.get(part, {}).get("flags", [])
        for rule in (r for r in LM_RULES if r in rules or r in runs):
            rule_seeds = sorted(runs.get(rule, {})) or seeds
            lines.append(shlex.join(["python", "benchmarks/compare_rules.py", *results_flag, "--parts", part,
                                     "--rules", rule, "--seeds", *map(str, rule_seeds), *flags]))
    return lines + ["```"]


def comparison_table(results, lm_rules, mqar_rules, seeds):
    """The markdown table of the results in `results`, its settings, the papers' claims beside
    the measured differences, and the commands; runs asked for (rules x seeds) and absent are
    marked missing."""
    lm_runs, mqar_runs = finished_runs(results, "lm"), finished_runs(results, "mqar")
    path = results / CONFIG_FILE
    configs = json.loads(path.read_text()) if path.is_file() else {}
    values = metric_values(lm_runs, mqar_runs)
    return "\n".join([*table_lines(values, lm_runs, mqar_runs, lm_rules, mqar_rules, seeds), "",
                      *by_seed_lines(values), "",
                      *setting_lines(lm_runs, mqar_runs, configs.get("lm", {}).get("jobs", 1)), "", *claim_lines(values), "",
                      *command_lines(results, configs, lm_runs, mqar_runs, lm_rules, mqar_rules, seeds)])


def progress_line(results, lm_rules, mqar_rules, seeds):
    """How many of the runs asked for are done, and how many more were started: stopped with a
    state to resume from."""
    asked = [("lm", rule, seed) for rule in lm_rules for seed in seeds]
    asked += [("mqar", rule, seed) for rule in mqar_rules for seed in seeds]
    finished = {part: finished_runs(results, part) for part in PARTS}
    pending = [run for run in asked if run[2] not in finished[run[0]].get(run[1], {})]
    started = sum(saved_state_path(results, *run).is_file() for run in pending)
    return f"compare: {len(asked) - len(pending)} of {len(asked)} runs done" + (
        f", {started} more started (they resume from their saved state)" if started else "")


def main(argv=None):
    args = parse_args(argv)
    lm_rules = (args.rules or LM_RULES) if "lm" in args.parts else ()
    mqar_rules = (args.rules or MQAR_RULES) if "mqar" in args.parts else ()
    failures = []
    if args.table:
        if not args.results.is_dir():
            fail(f"--results {args.results} is not a folder: nothing to tabulate")
    else:
        # Every part's flags are checked before any run, so a mismatch cannot waste a part's run time.
        train_args = lm_train_args(args) if lm_rules else None
        extra_mqar_args = mqar_args(args) if mqar_rules else None
        configs = {}
        if lm_rules:
            configs["lm"] = {"flags": lm_flags(args), "argv": train_args}
        if mqar_rules:
            configs["mqar"] = {"flags": mqar_flags(args), "argv": extra_mqar_args}
        for config in configs.values():
            config["jobs"] = args.jobs
        record_config(args.results, configs)
        if args.jobs > 1:
            failures = run_concurrently(args, configs, lm_rules, mqar_rules)
        else:
            if lm_rules:
                failures = run_lm_part(train_args, lm_rules, args.seeds, args.results)
            if mqar_rules:
                run_mqar_part(extra_mqar_args, mqar_rules, args.seeds, args.results)
    table = comparison_table(args.results, lm_rules, mqar_rules, args.seeds)
    print(table)
    print(progress_line(args.results, lm_rules, mqar_rules, args.seeds), flush=True)  # the GPU job's summary line
    if failures:
        fail("runs failed:\n" + "\n".join(failures))
    return table


if __name__ == "__main__":
    main()
