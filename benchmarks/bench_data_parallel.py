"""Training tokens/s of train.py on 1 GPU and on P GPUs under `accelerate launch` (DDP by
default, or FSDP2 with --config accelerate_configs/fsdp2.yaml), same global batch, same model.

Each launch trains --steps steps on the standard library (train.py's default corpus) and writes
its metrics.json; the table takes tokens/s at the median step (the first steps compile Triton
kernels), the speed-up of P GPUs over 1, and each launch's first losses, which should agree
within bf16 noise (the global batch is the same rows, split over the processes).

    python benchmarks/bench_data_parallel.py [--gpus 2] [--config accelerate_configs/ddp.yaml]
        [--rule gdn] [--steps 40] [train.py flags after --, e.g. -- --hidden-size 1024 --layers 12]
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

# A sibling script: benchmarks/ is on sys.path.
from compare_rules import median_step_tokens_per_second, timed_run_flags

REPO = Path(__file__).resolve().parent.parent
# A model big enough that a step is GPU-bound at the per-GPU batch: 12 layers of width 1024
# (8 heads of 128), 16 x 2048 tokens a step.
MODEL = ["--hidden-size", "1024", "--layers", "12", "--heads", "8", "--head-dim", "128"]
BATCH = ["--batch-size", "16", "--seq-len", "2048"]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(processes, args, out_dir, data_dir):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(args.config),
               "--num_processes", str(processes), "--main_process_port", str(free_port()),
               str(REPO / "train.py"), *MODEL, *BATCH, "--warmup-steps", "5",
               *timed_run_flags(args.rule, args.steps, out_dir, data_dir), *args.train_args]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    return json.loads((out_dir / "metrics.json").read_text())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--config", type=Path, default=REPO / "accelerate_configs" / "ddp.yaml")
    parser.add_argument("--rule", default="gdn")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("train_args", nargs="*", help="more train.py flags, after --")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        runs = {p: launch(p, args, folder / f"p{p}", folder / "data") for p in (1, args.gpus)}
    shape = runs[1]["args"]
    table = [f"{args.config.name}, {args.rule}: hidden {shape['hidden_size']}, {shape['layers']} layers, "
             f"{shape['heads']} heads of {shape['head_dim']}, {shape['batch_size']} x {shape['seq_len']} tokens a step, "
             f"{args.steps} steps, {runs[1]['device']}", "GPUs  tokens/s  speed-up  first losses"]
    for processes, metrics in runs.items():
        speed = median_step_tokens_per_second(metrics)
        losses = " ".join(f"{entry['loss']:.4f}" for entry in metrics["train"][:5])
        table.append(f"{processes:4d}  {speed:8,.0f}  {speed / median_step_tokens_per_second(runs[1]):7.2f}x  {losses}")
    print("\n" + "\n".join(table))
    return runs


if __name__ == "__main__":
    main()
