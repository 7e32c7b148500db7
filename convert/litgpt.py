"""NVlabs' GatedDeltaNet (lit_gpt) -> ResLin.

Layout: transformer.wte, transformer.h.{i} blocks with norm_1 / attn / norm_2 / mlp,
transformer.ln_f and lm_head (tied to wte when the two tensors are equal or lm_head is absent).
The attention is GatedDeltaNet: q/k/v/g/o_proj, q/k/v_conv1d, gk_proj (FLA's a_proj, Mamba2
gate), b_proj with a bias (ResLin's write_gate_bias), A_log, dt_bias, g_norm_swish_gate (o_norm)
and D, which that code reads only with use_residual (refused), so it is dropped. The MLP is
xformers' SwiGLU: w3(silu(w1 x) * w2 x), i.e. gate_proj, up_proj, down_proj.

lit_gpt checkpoints carry no config.json: the sizes come from a small JSON file (LITGPT_FIELDS).
"""

import re
from pathlib import Path

import torch

from .common import ConversionError, iter_tensors, read_json

# Keys of the --litgpt-config JSON; None: required. Defaults are lit_gpt GatedDeltaNet's own.
LITGPT_FIELDS = {
    "n_embd": None, "n_layer": None, "padded_vocab_size": None, "intermediate_size": None, "num_heads": None,
    "expand_k": 0.75, "expand_v": 1.5, "conv_size": 4, "norm_eps": 1e-5, "gdn_norm_eps": 1e-5,
    "block_size": 2048, "use_residual": False,
}
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
RENAMES = [
    (r"transformer\.wte\.weight", "model.embed_tokens.weight"),
    (r"transformer\.ln_f\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"transformer\.h\.(\d+)\.norm_1\.weight", r"model.layers.\1.attn_norm.weight"),
    (r"transformer\.h\.(\d+)\.norm_2\.weight", r"model.layers.\1.mlp_norm.weight"),
    (r"transformer\.h\.(\d+)\.attn\.((q|k|v|g|o)_proj\.weight|(q|k|v)_conv1d\.weight|A_log|dt_bias|b_proj\.bias)",
     r"model.layers.\1.attn.\2"),
    (r"transformer\.h\.(\d+)\.attn\.b_proj\.weight", r"model.layers.\1.attn.b_proj.weight"),
    (r"transformer\.h\.(\d+)\.attn\.gk_proj\.weight", r"model.layers.\1.attn.a_proj.weight"),
    (r"transformer\.h\.(\d+)\.attn\.g_norm_swish_gate\.weight", r"model.layers.\1.attn.o_norm.weight"),
    (r"transformer\.h\.(\d+)\.mlp\.swiglu\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"transformer\.h\.(\d+)\.mlp\.swiglu\.w2\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"transformer\.h\.(\d+)\.mlp\.swiglu\.w3\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]
DROPPED = re.compile(r"transformer\.h\.\d+\.attn\.D")


class LitGPTLayout:
    name = "NVlabs lit_gpt GatedDeltaNet"

    def __init__(self, config_path):
        self.config_path = Path(config_path)
        self.tie_word_embeddings = True

    def resolve_source(self, src):
        path = Path(src)
        if not path.exists():
            raise ConversionError(f"--src {src} does not exist (lit_gpt checkpoints are read from local files)")
        return path.resolve()

    def weight_files(self, src):
        if src.is_file():
            return [src]
        files = sorted(p for p in src.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        if len(files) != 1:
            raise ConversionError(f"{src} must hold exactly one checkpoint file ({', '.join(WEIGHT_SUFFIXES)}), "
                                  f"found {[p.name for p in files]}: pass the file itself as --src")
        return files

    def reslin_config(self, src, weight_files):
        given = read_json(self.config_path)
        unknown = sorted(set(given) - set(LITGPT_FIELDS))
        missing = sorted(k for k, v in LITGPT_FIELDS.items() if v is None and k not in given)
        if unknown or missing:
            raise ConversionError(f"{self.config_path}: unknown keys {unknown}, missing keys {missing}; "
                                  f"the keys are {sorted(LITGPT_FIELDS)}")
        c = {**LITGPT_FIELDS, **given}
        if c["use_residual"]:
            raise ConversionError("use_residual=True (lit_gpt's o + D * v skip) has no ResLin equivalent")
        if c["gdn_norm_eps"] != c["norm_eps"]:
            raise ConversionError(f"gdn_norm_eps {c['gdn_norm_eps']} differs from norm_eps {c['norm_eps']}: ResLin "
                                  "uses one norm_eps for the blocks' and the output RMSNorm")
        key_dim, value_dim = int(c["n_embd"] * c["expand_k"]), int(c["n_embd"] * c["expand_v"])
        if key_dim % c["num_heads"] or value_dim % c["num_heads"]:
            raise ConversionError(f"num_heads {c['num_heads']} must divide the key and value sizes "
                                  f"{key_dim} and {value_dim}")
        head_dim = key_dim // c["num_heads"]
        self.tie_word_embeddings = lm_head_is_tied(weight_files[0])
        return {
            "vocab_size": c["padded_vocab_size"], "hidden_size": c["n_embd"], "num_hidden_layers": c["n_layer"],
            "num_heads": c["num_heads"], "head_dim": head_dim, "expand_v": value_dim // c["num_heads"] / head_dim,
            "num_v_heads": c["num_heads"], "conv_size": c["conv_size"], "intermediate_size": c["intermediate_size"],
            "hidden_act": "swish", "norm_eps": c["norm_eps"], "max_position_embeddings": c["block_size"],
            "tie_word_embeddings": self.tie_word_embeddings, "write_gate_bias": True,
        }

    def target_names(self, name):
        if DROPPED.fullmatch(name):
            return []
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return []
        for pattern, target in RENAMES:
            if re.fullmatch(pattern, name):
                return [re.sub(pattern, target, name)]
        raise ConversionError(f"unexpected tensor {name!r}: not part of the lit_gpt GatedDeltaNet layout ResLin "
                              "converts (attention layers, biases other than b_proj's, or another model?)")


def lm_head_is_tied(path):
    """lit_gpt ties lm_head to wte; a checkpoint may store both (equal) or only wte."""
    wte = lm_head = None
    for name, tensor in iter_tensors(path):
        if name == "transformer.wte.weight":
            wte = tensor
        elif name == "lm_head.weight":
            lm_head = tensor
    return lm_head is None or (wte is not None and wte.shape == lm_head.shape and torch.equal(wte, lm_head))
