"""Where a generation step's GPU time goes: the step's CUDA graph (the 400M shape of
bench_generate.py, after a 512-token prefill) replayed alone, then under torch.profiler; its
kernels summed by name a step, beside the replay's own time. Needs a CUDA GPU.

    python benchmarks/decode_step_profile.py [--batches 1 16] [--rules gdn rdn]
"""
import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import per_call  # noqa: E402
from bench_generate import SHAPE, load_ours  # noqa: E402
from common import RULES  # noqa: E402

STEPS = 20


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=["gdn", "rdn"])
    parser.add_argument("--top", type=int, default=12, help="kernels listed a run")
    args = parser.parse_args()
    for B in args.batches:
        for rule in args.rules:
            model = load_ours(rule, SHAPE, "auto")
            prompt = torch.randint(0, SHAPE["vocab_size"], (B, 512), device="cuda")
            with torch.no_grad():
                output = model(prompt, use_cache=True)
                cache = output.past_key_values
                model(output.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)  # captures the graph
                replay = cache.decode_graph.graph.replay
                wall = per_call(replay, 50) * 1e6
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                    for _ in range(STEPS):
                        replay()
                    torch.cuda.synchronize()
            kernels = collections.defaultdict(lambda: [0, 0.0])
            for event in profile.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    kernels[event.name][0] += 1
                    kernels[event.name][1] += event.device_time
            count = sum(n for n, _ in kernels.values()) / STEPS
            total = sum(us for _, us in kernels.values()) / STEPS
            print(f"B={B} {rule}: the step's graph replays in {wall:.0f} us; {count:.0f} kernels a step, "
                  f"{total:.0f} us of kernel time")
            for name, (n, us) in sorted(kernels.items(), key=lambda item: -item[1][1])[:args.top]:
                print(f"  {n / STEPS:5.1f} a step {us / STEPS:8.1f} us  {name[:100]}")
            del model, cache, output
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
