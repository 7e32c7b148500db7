"""ResLinConfig: presets, defaults, validation and serialisation."""

import json

import pytest

PRESETS = {
    "sgla": ("additive", "gated", False),
    "gdn": ("delta", "gated", False),
    "kla": ("delta", "kaczmarz", False),
    "rla": ("additive", "gated", True),
    "rdn": ("delta", "gated", True),
    "rkla": ("delta", "kaczmarz", True),
}


@pytest.mark.parametrize("attn_type", list(PRESETS))
def test_preset_fills_settings(reslin, attn_type):
    config = reslin.ResLinConfig(attn_type=attn_type)
    assert (config.update_rule, config.step_rule, config.use_residual) == PRESETS[attn_type]
    assert config.model_type == "reslin"


@pytest.mark.parametrize("attn_type", list(PRESETS))
def test_preset_accepts_repeated_settings(reslin, attn_type):
    update_rule, step_rule, use_residual = PRESETS[attn_type]
    config = reslin.ResLinConfig(attn_type=attn_type, update_rule=update_rule, step_rule=step_rule,
                                 use_residual=use_residual)
    assert config.attn_type == attn_type


@pytest.mark.parametrize("setting, value", [("update_rule", "additive"), ("step_rule", "kaczmarz"),
                                            ("use_residual", False)])
def test_preset_contradiction_names_both(reslin, setting, value):
    with pytest.raises(ValueError, match=rf"attn_type='rdn'.*{setting}"):
        reslin.ResLinConfig(attn_type="rdn", **{setting: value})


def test_custom_needs_every_setting(reslin):
    with pytest.raises(ValueError, match="step_rule, use_residual"):
        reslin.ResLinConfig(attn_type=None, update_rule="delta")
    config = reslin.ResLinConfig(attn_type=None, update_rule="additive", step_rule="kaczmarz", use_residual=True)
    assert (config.update_rule, config.step_rule, config.use_residual) == ("additive", "kaczmarz", True)


def test_defaults(reslin):
    config = reslin.ResLinConfig(hidden_size=1024, num_hidden_layers=3, num_heads=4, head_dim=64)
    assert config.attn_type == "rdn"
    assert config.intermediate_size == 2816  # 8/3 * 1024 = 2730.7, rounded up to a multiple of 256
    assert config.num_v_heads == 4 and config.head_v_dim == 64
    assert config.layer_types == ["linear_attention"] * 3
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 4
    assert config.attention_head_dim == 256
    assert config.conv_size == 4 and config.residual_clip == 1.0 and config.kaczmarz_eps == 1e-6
    assert config.kernel_backend == "auto" and config.sliding_window is None
    assert set(config.auto_map) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}


def test_value_head_dim(reslin):
    assert reslin.ResLinConfig(head_dim=64, expand_v=2).head_v_dim == 128
    assert reslin.ResLinConfig(head_dim=64, expand_v=0.5).head_v_dim == 32


INVALID = [
    ({"attn_type": "mamba"}, "attn_type"),
    ({"attn_type": None, "update_rule": "hebbian", "step_rule": "gated", "use_residual": False}, "update_rule"),
    ({"attn_type": None, "update_rule": "delta", "step_rule": "newton", "use_residual": False}, "step_rule"),
    ({"attn_type": None, "update_rule": "delta", "step_rule": "gated", "use_residual": "yes"}, "use_residual"),
    ({"residual_clip": 0.0}, "residual_clip"),
    ({"residual_clip": -1.0}, "residual_clip"),
    ({"kaczmarz_eps": 0}, "kaczmarz_eps"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"hidden_size": -4}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_heads": 0}, "num_heads"),
    ({"head_dim": 0}, "head_dim"),
    ({"head_dim": 257}, "head_dim"),
    ({"head_dim": 64, "expand_v": 4.5}, "value head size"),
    ({"head_dim": 5, "expand_v": 0.5}, "value head size"),
    ({"head_dim": 64, "expand_v": 0.0}, "expand_v"),
    ({"num_heads": 4, "num_v_heads": 6}, "num_v_heads"),
    ({"conv_size": 0}, "conv_size"),
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"norm_eps": 0}, "norm_eps"),
    ({"num_hidden_layers": 2, "layer_types": ["linear_attention"]}, "layer_types"),
    ({"num_hidden_layers": 1, "layer_types": ["mamba"]}, "layer_types"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": 30, "num_attention_heads": 4, "num_hidden_layers": 1, "layer_types": ["full_attention"]},
     "attention_head_dim"),
    ({"attention_head_dim": 300}, "attention_head_dim"),
    ({"attention_head_dim": 7}, "attention_head_dim"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": 2.5}, "sliding_window"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"initializer_range": -0.1}, "initializer_range"),
    ({"kernel_backend": "cuda"}, "kernel_backend"),
    ({"vocab_size": 10, "pad_token_id": 10}, "pad_token_id"),
    ({"vocab_size": 10, "bos_token_id": -1}, "bos_token_id"),
    ({"vocab_size": 10, "eos_token_id": [1, 12]}, "eos_token_id"),
]


@pytest.mark.parametrize("kwargs, field", INVALID, ids=[f"{f}-{i}" for i, (_, f) in enumerate(INVALID)])
def test_invalid_values_raise_naming_the_field(reslin, kwargs, field):
    with pytest.raises(ValueError, match=field):
        reslin.ResLinConfig(**kwargs)


def test_save_and_load_roundtrip(reslin, tiny_config, tmp_path):
    config = tiny_config("hybrid_window")
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "reslin"
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_reslin.ResLinForCausalLM"
    loaded = reslin.ResLinConfig.from_pretrained(tmp_path)
    for key in ("attn_type", "update_rule", "step_rule", "use_residual", "layer_types", "sliding_window",
                "num_key_value_heads", "attention_head_dim", "num_v_heads", "head_dim", "expand_v"):
        assert getattr(loaded, key) == getattr(config, key), key


def test_repository_config_is_valid(reslin):
    config = reslin.ResLinConfig.from_pretrained(reslin.repo_root)
    assert config.num_hidden_layers == len(config.layer_types)
    assert set(config.auto_map) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}


def test_from_pretrained_overrides_switch_presets_and_are_checked(reslin, tiny_config, tmp_path):
    """from_pretrained(..., field=value) sets fields with setattr after __init__: attn_type must
    still switch the whole preset, and a bad value must fail there, naming the field."""
    tiny_config("rdn").save_pretrained(tmp_path)
    kla = reslin.ResLinConfig.from_pretrained(tmp_path, attn_type="kla")
    assert (kla.update_rule, kla.step_rule, kla.use_residual) == ("delta", "kaczmarz", False)
    model = reslin.ResLinForCausalLM(kla)
    assert model.model.layers[0].attn.step_rule == "kaczmarz"
    assert not hasattr(model.model.layers[0].attn, "gamma_proj")
    config, unused = reslin.ResLinConfig.from_pretrained(tmp_path, residual_clip=0.5, not_a_field=1,
                                                         return_unused_kwargs=True)
    assert config.residual_clip == 0.5 and unused == {"not_a_field": 1}

    for override, field in (({"attn_type": "foo"}, "attn_type"), ({"residual_clip": -1}, "residual_clip"),
                            ({"head_dim": 1000}, "head_dim"), ({"layer_types": ["mamba", "mamba"]}, "layer_types"),
                            ({"num_v_heads": 3}, "num_v_heads")):
        with pytest.raises(ValueError, match=field):
            reslin.ResLinConfig.from_pretrained(tmp_path, **override)


def test_a_new_layer_count_resizes_a_stack_of_one_layer_type(reslin, tiny_config, tmp_path):
    """As transformers' models allow: from_pretrained(path, num_hidden_layers=n), or the field
    assigned before building; a stack mixing layer types needs its layer_types given anew."""
    tiny_config("rdn").save_pretrained(tmp_path)
    config = reslin.ResLinConfig.from_pretrained(tmp_path, num_hidden_layers=1)
    assert config.layer_types == ["linear_attention"]
    config.num_hidden_layers = 3
    assert len(reslin.ResLinForCausalLM(config).model.layers) == 3
    mixed = reslin.ResLinConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    mixed.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="layer_types given with a new num_hidden_layers"):
        reslin.ResLinConfig.from_pretrained(tmp_path, num_hidden_layers=3)
    config = reslin.ResLinConfig.from_pretrained(tmp_path, num_hidden_layers=1, layer_types=["full_attention"])
    assert config.layer_types == ["full_attention"]


def test_auto_classes_check_overrides(reslin, repo_copy, load_remote):
    """The same through the Auto classes and the remote-code loader, before any weight is read."""
    with pytest.raises(ValueError, match="attn_type"):
        load_remote(repo_copy, "AutoConfig", attn_type="foo")
    with pytest.raises(ValueError, match="residual_clip"):
        load_remote(repo_copy, residual_clip=-1)


def test_fields_assigned_after_loading_are_checked_when_the_model_is_built(reslin, tiny_config, tmp_path):
    tiny_config("rdn").save_pretrained(tmp_path)
    contradiction = reslin.ResLinConfig.from_pretrained(tmp_path, attn_type="gdn")
    contradiction.use_residual = True
    with pytest.raises(ValueError, match="use_residual"):
        reslin.ResLinForCausalLM(contradiction)


def test_heads_that_do_not_divide_the_width_need_no_attention_head_size_without_attention_layers(reslin):
    """num_heads sizes the linear layers by head_dim: only full attention layers derive a head size
    from hidden_size / num_attention_heads."""
    config = reslin.ResLinConfig(hidden_size=384, num_heads=5, head_dim=64)
    assert config.attention_head_dim is None
    assert reslin.ResLinForCausalLM(config).config.num_heads == 5
    with pytest.raises(ValueError, match="set attention_head_dim"):
        reslin.ResLinConfig(hidden_size=384, num_heads=5, head_dim=64, num_hidden_layers=2,
                            layer_types=["linear_attention", "full_attention"])
