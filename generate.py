"""The main job: load the ResLin model of this repository and complete a prompt, streaming the
new tokens as they come.

    python generate.py "def fibonacci(n):" [--max-new-tokens 64] [--device cpu|cuda] [--sample]
    python generate.py "def fibonacci(n):" --model out/rdn   # a folder that train.py wrote

The model loads through AutoModelForCausalLM with trust_remote_code=True, exactly as a Hub user
loads it, on the GPU when there is one. Until trained weights ship (model.safetensors), the
model is built from config.json with RANDOM weights and says so: its output is noise, the point
is that the machinery runs. Until a tokenizer ships, text is encoded as UTF-8 bytes, byte b as
token id b + 3 (after the pad, bos and eos ids 0-2).
"""

import argparse
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TextStreamer

REPO = os.path.dirname(os.path.abspath(__file__))
BYTE_OFFSET = 3


class ByteCodec:
    """Stands in for a tokenizer until one ships with trained weights."""

    def encode(self, text):
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids, **kwargs):
        """Special ids are always skipped; kwargs are TextStreamer's decode arguments."""
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")


def load(folder, device, dtype):
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype)
    else:
        print("NOTE: no trained weights ship yet (no model.safetensors): the model is built from "
              "config.json with RANDOM weights, so the text below is noise.", file=sys.stderr)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=dtype)
    has_tokenizer = os.path.exists(os.path.join(folder, "tokenizer.json"))
    # trust_remote_code: AutoTokenizer reads config.json, whose classes are remote code.
    codec = AutoTokenizer.from_pretrained(folder, trust_remote_code=True) if has_tokenizer else ByteCodec()
    return model.to(device).eval(), codec


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="def fibonacci(n):")
    parser.add_argument("--model", default=REPO, help="model folder (default: this repository)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sample", action="store_true", help="sample (top-p 0.9) instead of greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model, codec = load(args.model, args.device, getattr(torch, args.dtype))
    config = model.config
    print(f"ResLin {config.attn_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, on {args.device}",
          file=sys.stderr)
    input_ids = torch.tensor([codec.encode(args.prompt)], device=args.device)
    print(args.prompt, end="", flush=True)
    streamer = TextStreamer(codec, skip_prompt=True, skip_special_tokens=True)
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
