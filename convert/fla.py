"""FLA's GatedDeltaNetForCausalLM (model_type "gated_deltanet") -> ResLin.

ResLin's parameter names are FLA's but for the input embedding (FLA's `model.embeddings`,
transformers' `model.embed_tokens`), so weights copy by name; the work is the configuration.
Defaults are those of FLA 0.6.0's GatedDeltaNetConfig, for fields a config.json leaves out.
Options ResLin cannot reproduce exactly are refused by name.
"""

import math
import re

from .common import ConversionError, hf_weight_files, read_json, resolve_hf_source

FLA_DEFAULTS = {
    "hidden_size": 2048, "num_hidden_layers": 21, "vocab_size": 32000, "num_heads": 6, "head_dim": 256,
    "expand_v": 2.0, "num_v_heads": None, "conv_size": 4, "hidden_ratio": 4, "intermediate_size": None,
    "hidden_act": "swish", "norm_eps": 1e-6, "attn": None, "tie_word_embeddings": False,
    "max_position_embeddings": 2048, "initializer_range": 0.02, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "use_gate": True, "use_short_conv": True, "allow_neg_eigval": False,
    "output_gate_activation": "swish", "attnres_block_size": None,
}
# Source settings ResLin has no equivalent for, with the value ResLin computes.
REQUIRED = {
    "use_gate": (True, "ResLin always gates the output: RMSNorm(o) * SiLU(g_proj x)"),
    "use_short_conv": (True, "ResLin always has the short convolutions"),
    "allow_neg_eigval": (False, "ResLin's beta is sigmoid(b_proj x) in [0, 1], not 2 * sigmoid"),
    "hidden_act": ("swish", "ResLin's MLP is SwiGLU"),
    "attnres_block_size": (None, "ResLin has no attention residuals (AttnRes)"),
}
ATTENTION_FIELDS = ("num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta")
# FLA names that ResLin shares; the attention layers' q/k/v/o projections are covered too.
SHARED_NAME = re.compile(
    r"model\.norm\.weight|lm_head\.weight|"
    r"model\.layers\.\d+\.(attn_norm|mlp_norm)\.weight|"
    r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight|"
    r"model\.layers\.\d+\.attn\.((q|k|v|a|b|g|o)_proj\.(weight|bias)|(q|k|v)_conv1d\.weight|o_norm\.weight|A_log|dt_bias)")


class FLALayout:
    name = "FLA GatedDeltaNet"

    def __init__(self, revision=None):
        self.revision = revision  # Hub repo ids only: a branch, tag or commit
        self.tie_word_embeddings = False

    def resolve_source(self, src):
        return resolve_hf_source(src, self.revision)

    def weight_files(self, src):
        return hf_weight_files(src)

    def reslin_config(self, src, weight_files):
        if not (src / "config.json").is_file():
            raise ConversionError(f"{src} has no config.json")
        source = read_json(src / "config.json")
        if source.get("model_type") != "gated_deltanet":
            raise ConversionError(f"{src / 'config.json'} has model_type {source.get('model_type')!r}: this layout "
                                  "converts FLA's 'gated_deltanet' (GatedDeltaNetForCausalLM); for NVlabs lit_gpt "
                                  "checkpoints use --layout litgpt")
        source = {**FLA_DEFAULTS, **source}
        for field, (value, why) in REQUIRED.items():
            if source[field] != value:
                raise ConversionError(f"the source sets {field}={source[field]!r}, which ResLin cannot reproduce "
                                      f"({why})")
        if source["output_gate_activation"] not in ("swish", "silu"):
            raise ConversionError(f"the source sets output_gate_activation={source['output_gate_activation']!r}: "
                                  "ResLin's output gate is SiLU (swish)")
        hidden_size = source["hidden_size"]
        intermediate_size = source["intermediate_size"]
        if intermediate_size is None:  # FLA's GatedMLP rule
            intermediate_size = 256 * math.ceil(int(hidden_size * (source["hidden_ratio"] or 4) * 2 / 3) / 256)
        self.tie_word_embeddings = source["tie_word_embeddings"]
        config = {
            "vocab_size": source["vocab_size"], "hidden_size": hidden_size,
            "num_hidden_layers": source["num_hidden_layers"], "num_heads": source["num_heads"],
            "head_dim": source["head_dim"], "expand_v": source["expand_v"],
            "num_v_heads": source["num_v_heads"] or source["num_heads"], "conv_size": source["conv_size"],
            "intermediate_size": intermediate_size, "hidden_act": "swish", "norm_eps": source["norm_eps"],
            "max_position_embeddings": source["max_position_embeddings"],
            "initializer_range": source["initializer_range"], "tie_word_embeddings": self.tie_word_embeddings,
            "pad_token_id": source["pad_token_id"], "bos_token_id": source["bos_token_id"],
            "eos_token_id": source["eos_token_id"],
        }
        config.update(attention_config(source["attn"], source["num_hidden_layers"], hidden_size))
        return config

    def target_names(self, name):
        if name == "model.embeddings.weight":
            return ["model.embed_tokens.weight"]  # transformers' name for the input embedding
        if not SHARED_NAME.fullmatch(name):
            raise ConversionError(f"unexpected tensor {name!r}: not a parameter of FLA's GatedDeltaNetForCausalLM "
                                  "as ResLin reproduces it")
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return []  # the embeddings, saved again
        return [name]


def attention_config(attn, num_hidden_layers, hidden_size):
    """FLA's hybrid `attn` spec (a dict, or a list of dicts with their own layers) -> ResLin fields."""
    if attn is None:
        return {}
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) and "layers" in s and "num_heads" in s
                                              for s in specs):
        raise ConversionError(f"the source's attn spec must be a dict or a list of dicts with 'layers' and "
                              f"'num_heads', got {attn!r}")
    settings = {(s["num_heads"], s.get("num_kv_heads") or s["num_heads"], s.get("qkv_bias", False),
                 s.get("window_size"), s.get("rope_theta", 10000.0)) for s in specs}
    if len(settings) > 1:
        raise ConversionError(f"the source's attention layers differ in {ATTENTION_FIELDS}: {sorted(settings, key=str)}; "
                              "ResLin has one setting for all its attention layers")
    num_heads, num_kv_heads, qkv_bias, window_size, rope_theta = settings.pop()
    if hidden_size % num_heads:
        raise ConversionError(f"the source's attention has {num_heads} heads, which do not divide hidden_size "
                              f"{hidden_size}")
    layer_types = ["linear_attention"] * num_hidden_layers
    for spec in specs:
        for layer in spec["layers"]:
            if not (isinstance(layer, int) and 0 <= layer < num_hidden_layers):
                raise ConversionError(f"the source's attn spec names layer {layer!r}, not in [0, {num_hidden_layers})")
            layer_types[layer] = "full_attention"
    return {"layer_types": layer_types, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "attention_head_dim": hidden_size // num_heads, "attention_bias": qkv_bias,
            "sliding_window": window_size, "rope_theta": rope_theta}
