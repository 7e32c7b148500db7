"""train.py's training step eager and through torch.compile (`--compile`: block by block), same
model, same batches, one process each: tokens/s at the median step, the seconds until the first
step ended (the compilation's cost), and the first losses, which should agree within bf16 noise.

    python benchmarks/bench_compile.py [--rule rdn] [--steps 100] [--backend inductor]
        [train.py flags after --, e.g. -- --corpus FOLDER --batch-size 32]

The model is train.py's default (the shipped model's config: hidden 384, 8 layers, 6 heads of 64)
unless flags say otherwise; the data is train.py's default corpus (the standard library).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# A sibling script: benchmarks/ is on sys.path.
from compare_rules import median_step_tokens_per_second, timed_run_flags

REPO = Path(__file__).resolve().parent.parent


def train(compile_flags, args, out_dir, data_dir):
    command = [sys.executable, str(REPO / "train.py"), *timed_run_flags(args.rule, args.steps, out_dir, data_dir),
               *args.train_args, *compile_flags]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    return json.loads((out_dir / "metrics.json").read_text())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rule", default="rdn")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("train_args", nargs="*", help="more train.py flags, after --")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        runs = {label: train(flags, args, folder / label, folder / "data")
                for label, flags in (("eager", []), (f"compiled ({args.backend})", ["--compile", args.backend]))}
    shape = runs["eager"]["args"]
    table = [f"{args.rule}: hidden {shape['hidden_size']}, {shape['layers']} layers, {shape['heads']} heads of "
             f"{shape['head_dim']}, {shape['batch_size']} x {shape['seq_len']} tokens a step, {args.steps} steps, "
             f"{runs['eager']['device']}",
             f"{'run':20}  {'tokens/s':>9}  {'speed-up':>8}  {'first step s':>12}  first losses"]
    for label, metrics in runs.items():
        speed = median_step_tokens_per_second(metrics)
        losses = " ".join(f"{entry['loss']:.4f}" for entry in metrics["train"][:5])
        table.append(f"{label:20}  {speed:9,.0f}  {speed / median_step_tokens_per_second(runs['eager']):7.2f}x  "
                     f"{metrics['train'][0]['seconds']:12.1f}  {losses}")
    print("\n" + "\n".join(table))
    return runs


if __name__ == "__main__":
    main()
