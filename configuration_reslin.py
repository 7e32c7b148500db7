"""ResLinConfig: the configuration of ResLin causal language models.

A ResLin model is a stack of blocks whose token mixer is a recurrent linear-attention layer
(RLA, RDN, KLA and their baselines GDN and sGLA), optionally interleaved with full softmax
attention layers. `attn_type` names a preset; every preset is shorthand for three orthogonal
settings a user can also set directly:

    attn_type  update_rule  step_rule  use_residual
    sgla       additive     gated      False
    gdn        delta        gated      False
    kla        delta        kaczmarz   False
    rla        additive     gated      True
    rdn        delta        gated      True
    rkla       delta        kaczmarz   True

Every value is validated here, when the config is built, so that a bad value fails with a
message naming the field instead of a shape error deep inside the model.
"""

import math

import transformers
from packaging import version
from transformers import PretrainedConfig

# The oldest transformers these files are tested with (CI runs it and the newest, 5.25). Older
# ones lack what the model uses (transformers.initialization, 5.x weight loading): say so here,
# the first module any Auto class imports, rather than fail somewhere inside.
MIN_TRANSFORMERS_VERSION = "5.0.0"
if version.parse(transformers.__version__) < version.parse(MIN_TRANSFORMERS_VERSION):
    raise ImportError(f"ResLin needs transformers >= {MIN_TRANSFORMERS_VERSION}, but {transformers.__version__} "
                      f"is installed: pip install -U 'transformers>={MIN_TRANSFORMERS_VERSION}'")

# What the kernels take, checked against the same constants as the kernels' own arguments.
try:
    from .constants_reslin import BACKENDS as KERNEL_BACKENDS
    from .constants_reslin import MAX_HEAD_DIM, UPDATE_RULES
except ImportError:  # imported as a plain module, the repository on sys.path
    from constants_reslin import BACKENDS as KERNEL_BACKENDS
    from constants_reslin import MAX_HEAD_DIM, UPDATE_RULES

ATTN_PRESETS = {
    "sgla": {"update_rule": "additive", "step_rule": "gated", "use_residual": False},
    "gdn": {"update_rule": "delta", "step_rule": "gated", "use_residual": False},
    "kla": {"update_rule": "delta", "step_rule": "kaczmarz", "use_residual": False},
    "rla": {"update_rule": "additive", "step_rule": "gated", "use_residual": True},
    "rdn": {"update_rule": "delta", "step_rule": "gated", "use_residual": True},
    "rkla": {"update_rule": "delta", "step_rule": "kaczmarz", "use_residual": True},
}
STEP_RULES = ("gated", "kaczmarz")
LAYER_TYPES = ("linear_attention", "full_attention")
HIDDEN_ACTS = ("swish", "silu")
# Written into every saved config, so that a folder written by save_pretrained loads through
# every Auto class with trust_remote_code (save_pretrained itself only records the saved class).
AUTO_MAP = {
    "AutoConfig": "configuration_reslin.ResLinConfig",
    "AutoModel": "modeling_reslin.ResLinModel",
    "AutoModelForCausalLM": "modeling_reslin.ResLinForCausalLM",
}


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive_float(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _head_size(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_HEAD_DIM:
        raise ValueError(f"{name} must be an integer between 1 and {MAX_HEAD_DIM} (the kernels' limit), got {value!r}")


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


class ResLinConfig(PretrainedConfig):
    r"""
    Configuration of a ResLin model ([`ResLinModel`], [`ResLinForCausalLM`]).

    Args:
        vocab_size (`int`, defaults to 32000): vocabulary size.
        hidden_size (`int`, defaults to 1024): model width.
        num_hidden_layers (`int`, defaults to 24): number of blocks.
        attn_type (`str` or `None`, defaults to `"rdn"`): preset, one of `rla`, `rdn`, `kla`, `gdn`,
            `sgla`, `rkla` (table in the module docstring), or `None` for a custom combination of
            `update_rule`, `step_rule` and `use_residual`, which must then all be given.
        update_rule (`str`, *optional*): `"delta"` or `"additive"`; filled from the preset.
        step_rule (`str`, *optional*): `"gated"` (beta = sigmoid(b_proj x), q and k L2-normalised) or
            `"kaczmarz"` (beta = sigmoid(b_proj x) / (||k||^2 + eps), raw keys, normalised queries; with
            the residual state, it is written with gamma / (||k||^2 + eps) and read with gamma).
        use_residual (`bool`, *optional*): add the residual state R with correction gate gamma.
        residual_clip (`float`, defaults to 1.0): clip threshold c of the residual error; finite, as
            config.json holds no infinity (a value far above the residuals, say 1e9, clips nothing).
        kaczmarz_eps (`float`, defaults to 1e-6): eps of the Kaczmarz step size.
        write_gate_bias (`bool`, defaults to False): `b_proj` (and `gamma_proj`) carry a bias, as in
            NVlabs' Gated DeltaNet checkpoints.
        num_heads (`int`, defaults to 8): query/key heads of the linear attention layers.
        head_dim (`int`, defaults to 128): query/key head size (1..256).
        expand_v (`float`, defaults to 1.0): value head size = head_dim * expand_v (an integer, 1..256).
        num_v_heads (`int`, *optional*): value heads, a multiple of `num_heads` (default `num_heads`).
        conv_size (`int`, defaults to 4): kernel size of the causal short convolutions.
        intermediate_size (`int`, *optional*): SwiGLU width; default 8/3 * hidden_size rounded up to
            a multiple of 256.
        hidden_act (`str`, defaults to `"swish"`): MLP activation.
        norm_eps (`float`, defaults to 1e-6): RMSNorm epsilon.
        layer_types (`list[str]`, *optional*): per block, `"linear_attention"` or `"full_attention"`;
            default all linear.
        num_attention_heads (`int`, *optional*): query heads of full attention layers (default `num_heads`).
        num_key_value_heads (`int`, *optional*): key/value heads of full attention layers (GQA),
            a divisor of `num_attention_heads` (default `num_attention_heads`).
        attention_head_dim (`int`, *optional*): head size of full attention layers
            (default hidden_size // num_attention_heads; needed only with such layers).
        rope_theta (`float`, defaults to 10000.0): RoPE base of full attention layers.
        sliding_window (`int`, *optional*): if set, full attention layers see only the last
            `sliding_window` tokens (the query's own included).
        attention_bias (`bool`, defaults to False): full attention layers' q, k and v projections
            carry a bias (FLA's `qkv_bias`).
        max_position_embeddings (`int`, defaults to 2048): nominal context length (informational:
            linear layers have no position limit).
        initializer_range (`float`, defaults to 0.02): std of the normal weight initialisation.
        kernel_backend (`str`, defaults to `"auto"`): `reslin_attention` backend: `auto`, `torch`,
            `triton` or `recurrent`. With `auto` and `triton` the norms, short convolutions and
            SwiGLU also run fused Triton kernels on CUDA (kernels_reslin_triton_layers.py); `torch`
            and `recurrent` keep every layer in torch code. Read when the model is built: pass it to
            `from_pretrained` (a model refuses to run after `model.config.kernel_backend` changes).
        decode_cuda_graphs (`bool`, defaults to `True`): on CUDA, replay each generation step of a model
            whose layers are all linear attention from a CUDA graph captured at the cache's first step
            (see `ResLinDecodeGraph` in modeling_reslin.py); `False` runs every step eagerly. Read at
            every forward, so `model.config.decode_cuda_graphs = False` takes effect at once.
        generate_fast_path (`bool`, defaults to `True`): greedy decoding and sampling through `generate` run
            the model's own loop (generation_reslin.py): the token is chosen on the device, a CUDA
            step feeds it back to itself, and the host reads tokens every few steps instead of at
            every one. Settings that loop does not take (beam search, stop strings, logits
            processors other than temperature, top-k, top-p, min-p and minimum lengths, scores in
            the output, hooks on the model, ...) run transformers' loop, as does `False`.
        tie_word_embeddings (`bool`, defaults to False): share `lm_head` with the input embeddings.
    """

    model_type = "reslin"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=24,
        attn_type="rdn",
        update_rule=None,
        step_rule=None,
        use_residual=None,
        residual_clip=1.0,
        kaczmarz_eps=1e-6,
        write_gate_bias=False,
        num_heads=8,
        head_dim=128,
        expand_v=1.0,
        num_v_heads=None,
        conv_size=4,
        intermediate_size=None,
        hidden_act="swish",
        norm_eps=1e-6,
        layer_types=None,
        num_attention_heads=None,
        num_key_value_heads=None,
        attention_head_dim=None,
        rope_theta=10000.0,
        sliding_window=None,
        attention_bias=False,
        max_position_embeddings=2048,
        initializer_range=0.02,
        kernel_backend="auto",
        decode_cuda_graphs=True,
        generate_fast_path=True,
        use_cache=True,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **kwargs,
    ):
        update_rule, step_rule, use_residual = self._resolve_preset(attn_type, update_rule, step_rule, use_residual)
        # The sizes that other fields' defaults derive from are checked before deriving from them.
        for name, value in (("hidden_size", hidden_size), ("num_hidden_layers", num_hidden_layers),
                            ("num_heads", num_heads)):
            _positive_int(name, value)
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if intermediate_size is None:
            intermediate_size = 256 * math.ceil(hidden_size * 8 / 3 / 256)
        if layer_types is None:
            layer_types = ["linear_attention"] * num_hidden_layers
        if not isinstance(layer_types, (list, tuple)):
            raise ValueError(f"layer_types must be a list of {LAYER_TYPES}, got {layer_types!r}")
        num_attention_heads = num_heads if num_attention_heads is None else num_attention_heads
        _positive_int("num_attention_heads", num_attention_heads)
        num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        if attention_head_dim is None and hidden_size % num_attention_heads == 0:
            attention_head_dim = hidden_size // num_attention_heads  # else needed only with attention layers

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.attn_type = attn_type
        self.update_rule = update_rule
        self.step_rule = step_rule
        self.use_residual = use_residual
        self.residual_clip = residual_clip
        self.kaczmarz_eps = kaczmarz_eps
        self.write_gate_bias = write_gate_bias
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.expand_v = expand_v
        self.num_v_heads = num_v_heads
        self.conv_size = conv_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.norm_eps = norm_eps
        self.layer_types = list(layer_types)
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.attention_head_dim = attention_head_dim
        self.rope_theta = rope_theta
        self.sliding_window = sliding_window
        self.attention_bias = attention_bias
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.kernel_backend = kernel_backend
        self.decode_cuda_graphs = decode_cuda_graphs
        self.generate_fast_path = generate_fast_path
        self.use_cache = use_cache
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
        # Our checks first: their messages name our fields, where transformers' own would not.
        self.check_fields()
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            **kwargs,
        )

    def __setattr__(self, name, value):
        # attn_type names a preset, so assigning it assigns the preset's settings too. This is also
        # what makes from_pretrained(..., attn_type="kla") work: transformers applies such keyword
        # overrides with setattr after __init__.
        super().__setattr__(name, value)
        if name == "attn_type" and value in ATTN_PRESETS:
            for setting, preset_value in ATTN_PRESETS[value].items():
                super().__setattr__(setting, preset_value)
        # A stack of one layer type follows a new layer count (from_pretrained(path,
        # num_hidden_layers=2), as transformers' models allow); a mixed stack's types must be given anew.
        if name == "num_hidden_layers" and isinstance(value, int):
            layer_types = getattr(self, "layer_types", None)
            if layer_types and len(set(layer_types)) == 1:
                super().__setattr__("layer_types", layer_types[:1] * value)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        # from_pretrained(path, field=value) lands here: transformers builds the config from the
        # file, then applies the keyword overrides with setattr, past __init__'s checks. Check the
        # result, so that a bad override fails now rather than when a model is built.
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if kwargs.get("return_unused_kwargs") else loaded
        config.check_fields()
        return loaded

    def validate(self):
        """transformers' validation hook (it runs it on save); the model runs it too when it is
        built, since fields may have been assigned one by one since the config was made."""
        self.check_fields()
        if hasattr(super(), "validate"):  # early 5.x releases have no such hook
            super().validate()

    def check_fields(self):
        """Every ResLin field, with a ValueError that names the field and what is allowed."""
        _positive_int("vocab_size", self.vocab_size)
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("num_hidden_layers", self.num_hidden_layers)
        self._resolve_preset(self.attn_type, self.update_rule, self.step_rule, self.use_residual)
        _positive_float("residual_clip", self.residual_clip)
        _positive_float("kaczmarz_eps", self.kaczmarz_eps)
        _choice("write_gate_bias", self.write_gate_bias, (False, True))

        _positive_int("num_heads", self.num_heads)
        _head_size("head_dim", self.head_dim)
        _positive_float("expand_v", self.expand_v)
        head_v_dim = self.head_dim * self.expand_v
        if head_v_dim != int(head_v_dim):
            raise ValueError(f"head_dim * expand_v (the value head size) must be an integer, got "
                             f"{self.head_dim} * {self.expand_v} = {head_v_dim}")
        _head_size("head_dim * expand_v (the value head size)", int(head_v_dim))
        _positive_int("num_v_heads", self.num_v_heads)
        if self.num_v_heads % self.num_heads:
            raise ValueError(f"num_v_heads must be a multiple of num_heads ({self.num_heads}), got {self.num_v_heads}")
        _positive_int("conv_size", self.conv_size)

        _positive_int("intermediate_size", self.intermediate_size)
        _choice("hidden_act", self.hidden_act, HIDDEN_ACTS)
        _positive_float("norm_eps", self.norm_eps)

        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types must have one entry per layer (num_hidden_layers = "
                             f"{self.num_hidden_layers}), got {len(self.layer_types)}: a stack that mixes "
                             f"layer types needs layer_types given with a new num_hidden_layers")
        for layer_type in self.layer_types:
            _choice("layer_types entries", layer_type, LAYER_TYPES)
        _positive_int("num_attention_heads", self.num_attention_heads)
        _positive_int("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads must divide num_attention_heads ({self.num_attention_heads}), "
                             f"got {self.num_key_value_heads}")
        if self.attention_head_dim is not None:
            _head_size("attention_head_dim", self.attention_head_dim)
            if self.attention_head_dim % 2:
                raise ValueError(f"attention_head_dim must be even (RoPE rotates pairs), got {self.attention_head_dim}")
        elif "full_attention" in self.layer_types:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                             f"({self.num_attention_heads}): set attention_head_dim, the full attention layers' head size")
        _positive_float("rope_theta", self.rope_theta)
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        _choice("attention_bias", self.attention_bias, (False, True))

        _positive_int("max_position_embeddings", self.max_position_embeddings)
        initializer_range = self.initializer_range
        if isinstance(initializer_range, bool) or not isinstance(initializer_range, (int, float)) or initializer_range < 0:
            raise ValueError(f"initializer_range must be a number >= 0, got {initializer_range!r}")
        _choice("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        _choice("decode_cuda_graphs", self.decode_cuda_graphs, (False, True))
        _choice("generate_fast_path", self.generate_fast_path, (False, True))
        for name in ("pad_token_id", "bos_token_id"):
            token_id = getattr(self, name)
            if token_id is not None and not (isinstance(token_id, int) and 0 <= token_id < self.vocab_size):
                raise ValueError(f"{name} must be None or an integer in [0, vocab_size={self.vocab_size}), "
                                 f"got {token_id!r}")
        eos_token_id = self.eos_token_id
        for token_id in eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]:
            if token_id is not None and not (isinstance(token_id, int) and 0 <= token_id < self.vocab_size):
                raise ValueError(f"eos_token_id must be None, an integer or a list of integers in "
                                 f"[0, vocab_size={self.vocab_size}), got {eos_token_id!r}")

    @property
    def head_v_dim(self):
        return int(self.head_dim * self.expand_v)

    @staticmethod
    def _resolve_preset(attn_type, update_rule, step_rule, use_residual):
        """Fill unset settings from the preset; an explicit setting may only repeat it."""
        given = {"update_rule": update_rule, "step_rule": step_rule, "use_residual": use_residual}
        if attn_type is None:
            missing = [name for name, value in given.items() if value is None]
            if missing:
                raise ValueError(f"attn_type=None means a custom layer: set {', '.join(missing)} explicitly "
                                 f"(or choose a preset attn_type from {tuple(ATTN_PRESETS)})")
        else:
            _choice("attn_type", attn_type, tuple(ATTN_PRESETS) + (None,))
            for name, preset_value in ATTN_PRESETS[attn_type].items():
                if given[name] is None:
                    given[name] = preset_value
                elif given[name] != preset_value:
                    raise ValueError(f"attn_type={attn_type!r} means {name}={preset_value!r}, but {name}="
                                     f"{given[name]!r} was given: set attn_type=None for a custom combination")
        _choice("update_rule", given["update_rule"], UPDATE_RULES)
        _choice("step_rule", given["step_rule"], STEP_RULES)
        if not isinstance(given["use_residual"], bool):
            raise ValueError(f"use_residual must be True or False, got {given['use_residual']!r}")
        return given["update_rule"], given["step_rule"], given["use_residual"]


# save_pretrained copies this file (and writes auto_map) only for classes registered to an Auto class.
ResLinConfig.register_for_auto_class()

__all__ = ["ResLinConfig"]
