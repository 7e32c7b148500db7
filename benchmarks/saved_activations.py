"""The activations autograd keeps for the backward of one ResLin block, per token: the fused layer
kernels (kernels_reslin_triton_layers.py) against the torch code they replace. A count, not a
timing: it runs anywhere, on a CPU through Triton's interpreter (slow at large T).

Each kept storage is counted once, parameters not at all; the zero initial states (one per
sequence, [heads, Dk, Dv] fp32 each) are included, so short T overstates the per-token figure.
The block has the shape of bench_generate.py's 400M model (hidden 1024, 8 heads of 128, SwiGLU
of 2816), in bf16, with the attention through the Triton kernels.

    python benchmarks/saved_activations.py [--rules gdn rdn] [--length 128]
"""

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported

from bench_generate import SHAPE  # noqa: E402
from common import DEVICE, REPO, RULES  # noqa: E402


def load_modeling():
    """modeling_reslin as a module of a package (its imports are relative), from the repository."""
    import importlib
    import sys
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    (folder / "reslin_repo").symlink_to(REPO, target_is_directory=True)
    sys.path.insert(0, str(folder))
    return (importlib.import_module("reslin_repo.modeling_reslin"),
            importlib.import_module("reslin_repo.configuration_reslin"))


def kept_bytes_per_token(block, x):
    """Bytes of the activations autograd keeps for the backward of block(x), per token (each
    storage counted once, parameters not counted)."""
    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(kept.values()) / (x.shape[0] * x.shape[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=["gdn", "rdn"])
    parser.add_argument("--length", type=int, default=128, help="tokens of the one sequence")
    args = parser.parse_args()
    modeling, configuration = load_modeling()
    # On the CPU the modeling file runs the torch code: take the fused kernels there too, interpreted.
    modeling.runs_fused = lambda fused, x: fused
    shape = {k: SHAPE[k] for k in ("hidden_size", "num_heads", "head_dim", "intermediate_size")}
    print(f"activations kept per token by one block, bf16, T = {args.length}, {shape}")
    print(f"{'rule':6} {'fused KB':>9} {'torch code KB':>14}")
    for rule in args.rules:
        config = configuration.ResLinConfig(attn_type=rule, num_hidden_layers=1, kernel_backend="triton", **shape)
        block = modeling.ResLinBlock(config, 0).to(device=DEVICE, dtype=torch.bfloat16)
        x = torch.randn(1, args.length, shape["hidden_size"], device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        counts = []
        for fused in (True, False):
            for module in block.modules():
                if hasattr(module, "fused"):
                    module.fused = fused
            counts.append(kept_bytes_per_token(block, x) / 1024)
        print(f"{rule:6} {counts[0]:9.1f} {counts[1]:14.1f}", flush=True)


if __name__ == "__main__":
    main()
