"""Loading through the Auto classes with trust_remote_code, saving and reloading, device_map.

Save/reload comparisons are exact (torch.equal): the same fp32 weights through the same code.
"""

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig

# Every module: modeling_reslin.py imports each directly, as loaders before transformers 5.10 need.
REMOTE_FILES = {"configuration_reslin.py", "constants_reslin.py", "modeling_reslin.py", "cache_reslin.py",
                "kernels_reslin.py", "kernels_reslin_torch.py", "context_parallel_reslin.py", "kernels_reslin_triton.py",
                *(f"kernels_reslin_triton_{role}.py" for role in ("backward", "common", "decode", "forward", "launch",
                                                                  "layers", "output", "state", "tuning", "wy"))}


def tiny_hub_folder(folder, tiny_config):
    """Write a tiny model's config.json into a copy of the repository code (no weights)."""
    tiny_config("hybrid_window").to_json_file(folder / "config.json")
    return folder


def test_auto_classes_from_repository_folder(repo_copy, load_remote):
    config = AutoConfig.from_pretrained(repo_copy, trust_remote_code=True)
    assert config.model_type == "reslin" and type(config).__name__ == "ResLinConfig"
    import transformers

    for auto_class, expected in (("AutoModel", "ResLinModel"), ("AutoModelForCausalLM", "ResLinForCausalLM")):
        model = getattr(transformers, auto_class).from_config(config, trust_remote_code=True)
        assert type(model).__name__ == expected
        assert type(model).__module__.endswith("modeling_reslin")
    if (repo_copy / "model.safetensors").exists():  # the shipped weights, once there are some
        assert type(load_remote(repo_copy)).__name__ == "ResLinForCausalLM"


def test_save_pretrained_folder_loads_with_identical_logits(repo_copy, tiny_config, load_remote, tmp_path):
    import transformers

    config = AutoConfig.from_pretrained(tiny_hub_folder(repo_copy, tiny_config), trust_remote_code=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    files = {p.name for p in saved.iterdir()}
    assert REMOTE_FILES <= files, files  # the code and its `from .x import` siblings travel with the weights
    assert any(name.startswith("kernels_reslin_") for name in files)

    reloaded = load_remote(saved).eval()
    ids = torch.randint(1, 100, (2, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    base = load_remote(saved, auto_class="AutoModel")
    assert type(base).__name__ == "ResLinModel"
    with torch.no_grad():
        assert torch.equal(base(ids).last_hidden_state, model.model(ids).last_hidden_state)


def test_locally_imported_model_saves_a_loadable_folder(tiny_model, load_remote, tmp_path):
    """A model built from the imported classes (not through remote code) saves its code too."""
    model = tiny_model("rkla", tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert REMOTE_FILES <= {p.name for p in tmp_path.iterdir()}
    reloaded = load_remote(tmp_path).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(1, 100, (2, 7))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    # from_pretrained must load the initialisation-special parameters, not re-initialise them.
    for name in ("model.layers.0.attn.A_log", "model.layers.1.attn.dt_bias"):
        assert torch.equal(reloaded.get_parameter(name), model.get_parameter(name)), name
        assert reloaded.get_parameter(name)._no_weight_decay, name


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_folder_saved_under_the_earlier_embedding_name_loads_and_saves_under_todays(tiny_model, load_remote,
                                                                                        tmp_path, tied):
    """Earlier versions (and the shipped weights) named the input embedding FLA's `model.embeddings`:
    such a folder loads exactly, and saves under `model.embed_tokens` (transformers would otherwise
    save under the loaded name again; 5.0 writes the renaming's pattern as the name)."""
    model = tiny_model("rdn", tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "earlier")
    weights = safetensors.torch.load_file(tmp_path / "earlier" / "model.safetensors")
    weights["model.embeddings.weight"] = weights.pop("model.embed_tokens.weight")
    safetensors.torch.save_file(weights, tmp_path / "earlier" / "model.safetensors", metadata={"format": "pt"})

    loaded = load_remote(tmp_path / "earlier").eval()
    ids = torch.randint(1, 100, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    loaded.save_pretrained(tmp_path / "today")
    saved = safetensors.torch.load_file(tmp_path / "today" / "model.safetensors")
    assert "model.embed_tokens.weight" in saved and not any("embeddings" in name for name in saved), sorted(saved)
    with torch.no_grad():
        assert torch.equal(load_remote(tmp_path / "today").eval()(ids).logits, model(ids).logits)


def test_device_map_auto(tiny_model, load_remote, tmp_path):
    model = tiny_model("hybrid")
    model.save_pretrained(tmp_path)
    loaded = load_remote(tmp_path, device_map="auto").eval()
    assert set(loaded._no_split_modules) == {"ResLinBlock"}
    # Wherever accelerate puts the blocks (the CPU here, one or several GPUs elsewhere), it never
    # splits one.
    for block in loaded.model.layers:
        assert len({p.device for p in block.parameters()}) == 1
    ids = torch.randint(1, 100, (1, 6))
    with torch.no_grad():
        logits = loaded(ids.to(loaded.device)).logits.cpu()
    torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=1e-5)  # fp32, CPU or GPU


def test_generate_through_remote_code(tiny_model, load_remote, make_left_padded, tmp_path):
    model = tiny_model("rdn")
    model.save_pretrained(tmp_path)
    loaded = load_remote(tmp_path).eval()
    ids, mask = make_left_padded([torch.randint(1, 100, (n,)) for n in (5, 2)])
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert torch.equal(loaded.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), expected)
