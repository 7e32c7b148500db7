"""Generation throughput of a ~400M-parameter model: ResLin (as GDN) against FLA's GatedDeltaNetForCausalLM.

Both models have random weights, bf16, on CUDA, and the same shape: hidden size 1024, 24 layers,
8 heads of size 128 (value heads as large), short convolutions, a SwiGLU MLP of 2816, vocabulary
32000 (FLA's default). Each generates --new-tokens tokens greedily after the same random prompt of
--prompt-tokens tokens, with min_new_tokens = max_new_tokens so that EOS cannot stop it, after a
short warm-up generate (compilation, autotuning). Throughput = new tokens x batch / seconds,
prefill included. Our model loads as a user loads it: the repository's config.json through
AutoConfig with trust_remote_code, fields overridden, then AutoModelForCausalLM.from_config.
Then every rule in --rules runs alone with the same shape (ours only).

Goals (issue "Bundled Triton kernels for inference"): ours / FLA >= 10x at B = 1 and >= 2x at
B = 16 (FLA measured in the same run when importable).

    python benchmarks/bench_generate.py [--batches 1 16] [--prompt-tokens 512] [--new-tokens 256]
                                        [--rules gdn kla rla rdn sgla rkla] [--kernel-backend auto]
    python benchmarks/bench_generate.py --smoke   # tiny model; runs on a CPU (torch backend, fp32)
"""

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common import DEVICE, DTYPE, REPO, RULES, import_fla, print_header, synchronize

SHAPE = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=8, head_dim=128, expand_v=1.0,
             intermediate_size=2816, tie_word_embeddings=False)
SMOKE_SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=1.0,
                   intermediate_size=128, tie_word_embeddings=False)
GOALS = {1: 10.0, 16: 2.0}  # batch size: ours / FLA at least
WARMUP_TOKENS = 8


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
    return GatedDeltaNetForCausalLM(config).to(device=DEVICE, dtype=DTYPE).eval()


def tokens_per_second(model, prompt, new_tokens):
    def generate(n):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n)

    with torch.no_grad():
        generate(min(WARMUP_TOKENS, new_tokens))
        synchronize()
        start = time.perf_counter()
        output = generate(new_tokens)
        synchronize()
        seconds = time.perf_counter() - start
    if output.shape[1] != prompt.shape[1] + new_tokens:
        raise RuntimeError(f"generated {output.shape[1] - prompt.shape[1]} tokens, asked for {new_tokens}")
    return new_tokens * prompt.shape[0] / seconds


def parameters(model):
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=["gdn", "kla", "rla", "rdn", "sgla", "rkla"])
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="our config's kernel_backend (auto: what a user gets)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few tokens, to check the script itself")
    args = parser.parse_args()
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    if args.smoke:
        args.batches, args.prompt_tokens, args.new_tokens = [1, 2], 16, 8

    fla = import_fla()
    print_header(f"generate: prompt {args.prompt_tokens} + {args.new_tokens} new tokens, greedy, "
                 f"{str(DTYPE).removeprefix('torch.')}, random weights, "
                 + ", ".join(f"{k}={v}" for k, v in shape.items()) + f", our kernel_backend {args.kernel_backend!r}")
    generator = torch.Generator().manual_seed(0)
    # Ids from 3 up: clear of the pad, bos and eos ids 0-2 of our config.json.
    prompts = {B: torch.randint(3, shape["vocab_size"], (B, args.prompt_tokens), generator=generator).to(DEVICE)
               for B in args.batches}

    fla_speed = {}
    if fla is not None:
        model = load_fla(shape)
        print(f"FLA GatedDeltaNetForCausalLM: {parameters(model)} parameters")
        fla_speed = {B: tokens_per_second(model, prompts[B], args.new_tokens) for B in args.batches}
        del model
        torch.cuda.empty_cache()

    for rule in dict.fromkeys(["gdn"] + args.rules):  # gdn first: the comparison with FLA
        model = load_ours(rule, shape, args.kernel_backend)
        if rule == "gdn":
            print(f"ResLin gdn: {parameters(model)} parameters")
        speed = {B: tokens_per_second(model, prompts[B], args.new_tokens) for B in args.batches}
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        if rule == "gdn":
            if fla_speed:
                print(f"{'B':>3} {'ours gdn tok/s':>15} {'FLA tok/s':>10} {'ours/FLA':>9}   goal")
                for B in args.batches:
                    ratio = speed[B] / fla_speed[B]
                    goal = GOALS.get(B)
                    verdict = "none" if goal is None else f">= {goal:g}x {'met' if ratio >= goal else 'NOT met'}"
                    print(f"{B:3d} {speed[B]:15.1f} {fla_speed[B]:10.1f} {ratio:8.2f}x   {verdict}")
            print(f"\nours alone, tokens/s\n{'rule':5} " + " ".join(f"{f'B={B}':>9}" for B in args.batches))
        if rule in args.rules:
            print(f"{rule:5} " + " ".join(f"{speed[B]:9.1f}" for B in args.batches), flush=True)


if __name__ == "__main__":
    main()
