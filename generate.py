"""The main job: load the ResLin model of this repository and complete a prompt, streaming the
new tokens as they come.

    python generate.py "def fibonacci(n):" [--max-new-tokens 64] [--device cpu|cuda] [--sample]
    python generate.py "def fibonacci(n):" --model out/rdn   # a folder that train.py wrote

The model and its tokenizer load through AutoModelForCausalLM and AutoTokenizer with
trust_remote_code=True, exactly as a Hub user loads them, on the GPU when there is one. The
repository's own model is an 18.6M-parameter RDN trained by train.py on Python source (README.md,
"The shipped model").
"""

import argparse
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

REPO = os.path.dirname(os.path.abspath(__file__))


def load(folder, device, dtype):
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype)
    # trust_remote_code: AutoTokenizer reads config.json, whose classes are remote code.
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    return model.to(device).eval(), tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="def fibonacci(n):")
    parser.add_argument("--model", default=REPO, help="model folder or Hub id (default: this repository)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sample", action="store_true", help="sample (top-p 0.9) instead of greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    if os.path.isdir(args.model) and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model}: the folder holds no config.json (give a folder that train.py or "
                     f"save_pretrained wrote, or a Hub id)")

    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model, args.device, getattr(torch, args.dtype))
    config = model.config
    print(f"ResLin {config.attn_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, on {args.device}",
          file=sys.stderr)
    input_ids = torch.tensor([tokenizer(args.prompt).input_ids], device=args.device)
    print(args.prompt, end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    with torch.no_grad():
        sampling = dict(do_sample=True, top_p=0.9) if args.sample else dict(do_sample=False)
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=args.max_new_tokens, streamer=streamer, **sampling)
    seconds = time.perf_counter() - start
    new_tokens = output.shape[1] - input_ids.shape[1]
    print(f"{new_tokens} new tokens in {seconds:.2f} s ({new_tokens / seconds:.1f} tokens/s)", file=sys.stderr)


if __name__ == "__main__":
    main()
