"""Command line: python -m convert --src DIR_OR_HUB_ID --dst DIR --attn-type gdn|kla|rdn|rkla."""

import argparse
import sys

from .common import ConversionError, convert
from .fla import FLALayout
from .litgpt import LITGPT_FIELDS, LitGPTLayout

DTYPES = ("fp32", "bf16", "fp16")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert a Gated DeltaNet checkpoint (FLA or NVlabs lit_gpt) into a ResLin model folder.")
    parser.add_argument("--src", required=True,
                        help="FLA: a checkpoint folder or a Hub repo id; lit_gpt: a checkpoint file or a folder holding one")
    parser.add_argument("--revision", help="FLA from the Hub only: a branch, tag or commit hash (default: the "
                        "repository's default branch)")
    parser.add_argument("--dst", required=True, help="the ResLin folder to write (must not exist unless --force)")
    parser.add_argument("--attn-type", required=True, choices=("gdn", "kla", "rdn", "rkla"),
                        help="gdn reproduces the source; kla, rdn and rkla upcycle it (then fine-tune)")
    parser.add_argument("--layout", default="fla", choices=("fla", "litgpt"), help="the source layout (default fla)")
    parser.add_argument("--litgpt-config", help="lit_gpt only: a JSON file with the model's sizes, keys "
                        + ", ".join(f"{key}={default}" if default is not None else f"{key} (required)"
                                    for key, default in LITGPT_FIELDS.items()))
    parser.add_argument("--dtype", choices=DTYPES, help="dtype of the written weights (default: the source's)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    parser.add_argument("--force", action="store_true",
                        help="replace --dst if it is a model folder (files only, a config.json among them)")
    parser.add_argument("--no-probe", action="store_true", help="skip the probe that compares upcycled logits")
    args = parser.parse_args(argv)

    if args.layout == "litgpt":
        if args.litgpt_config is None:
            parser.error("--layout litgpt needs --litgpt-config (lit_gpt checkpoints carry no config.json)")
        if args.revision is not None:
            parser.error("--revision is for Hub repo ids; lit_gpt checkpoints are read from local files")
        layout = LitGPTLayout(args.litgpt_config)
    else:
        if args.litgpt_config is not None:
            parser.error("--litgpt-config is only for --layout litgpt")
        layout = FLALayout(revision=args.revision)
    try:
        convert(args.src, args.dst, args.attn_type, layout, dtype=args.dtype, max_shard_size=args.max_shard_size,
                force=args.force, probe=not args.no_probe)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
