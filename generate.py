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
import re
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

REPO = os.path.dirname(os.path.abspath(__file__))
# What the Hub accepts as a repository id: "owner/name".
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def fail(message):
    print(f"generate.py: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def model_source(name):
    """The folder or Hub id that --model names; a missing folder fails here, in one line, rather
    than in the Hub client (a traceback, or its retries when there is no network)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            fail(f"--model {name}: the folder holds no config.json (give a folder that train.py or "
                 f"save_pretrained wrote, or a Hub id)")
        if not any((path / file).is_file() for file in ("tokenizer.json", "tokenizer_config.json")):
            fail(f"--model {name}: the folder holds a model but no tokenizer (tokenizer.json, tokenizer_config.json): "
                 f"save the tokenizer beside it (tokenizer.save_pretrained)")
        return str(path)
    if path.exists():
        fail(f"--model {name}: not a folder (give a folder that train.py or save_pretrained wrote, or a Hub id)")
    # "owner/name" may be a Hub id, unless "owner" is a folder here: then it is a path into it.
    if HUB_ID.fullmatch(name) and not Path(name.split("/")[0]).is_dir():
        return name
    fail(f"--model {name}: no such folder" + ("" if path.is_absolute() else f" (looked for {os.path.abspath(path)})"))


def check_device(parser, name):
    """--device `name` as a torch.device this machine and this PyTorch can use, or the parser's
    error naming what is wrong (train.py checks its --device here too)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"--device {name}: not a device (cpu, cuda, cuda:1, ...)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: CUDA is not available here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), numbered from 0")
    try:  # a kind of device this PyTorch was not built for (mps, xpu, ...); not CUDA, which would start a context
        if device.type != "cuda":
            torch.empty(0, device=device)
    except Exception as error:  # torch raises RuntimeError, AssertionError or NotImplementedError here
        reason = str(error).splitlines()[0].split(". ")[0]
        parser.error(f"--device {name}: this PyTorch cannot use it here ({reason})")
    return device


def load(source, device, dtype):
    try:
        model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True, dtype=dtype)
    except OSError as error:
        if os.path.isdir(source):
            raise
        fail(f"--model {source}: no such folder here, and no such model on the Hub: {str(error).splitlines()[0]}")
    # trust_remote_code: transformers 5 reads config.json, whose config class is remote code, even
    # for the tokenizer; it asks whether to run that code otherwise.
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True)
    return model.to(device).eval(), tokenizer


def encode_prompt(tokenizer, prompt):
    """The prompt's token ids. It is text: a special token's spelling in it ("<eos>" in code about
    tokenizers) is characters, as train.py tokenized the training files, not the token. An empty
    prompt of a tokenizer that adds no <bos> itself starts from its <bos>."""
    ids = tokenizer(prompt, split_special_tokens=True).input_ids
    if ids:
        return ids
    if tokenizer.bos_token_id is None:
        fail("the prompt is empty and the tokenizer has no <bos> token to start from: give a prompt")
    return [tokenizer.bos_token_id]


def main(argv=None):
    parser = argparse.ArgumentParser(description="Complete a prompt with a ResLin model, streaming the new tokens.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="def fibonacci(n):", help="the text to complete")
    parser.add_argument("--model", default=REPO, help="model folder or Hub id (owner/name)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    parser.add_argument("--sample", action="store_true", help="sample (top-p 0.9) instead of greedy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_device(parser, args.device)
    source = model_source(args.model)

    torch.manual_seed(args.seed)
    model, tokenizer = load(source, args.device, getattr(torch, args.dtype))
    config = model.config
    # Any causal LM loads; the mixer is named for a ResLin model only.
    name = f"ResLin {config.attn_type}" if config.model_type == "reslin" else config.model_type
    print(f"{name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, on {args.device}",
          file=sys.stderr)
    input_ids = torch.tensor([encode_prompt(tokenizer, args.prompt)], device=args.device)
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
