"""PEFT LoRA on ResLin models: training, adapter save/reload, merging.

Merged-vs-unmerged logits differ only by fp32 rounding of W + BA (atol 1e-5); reloads are exact.
"""

import pytest
import torch

import kernels_reslin

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "gate_proj", "up_proj", "down_proj"]


def lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=True)
    return peft.get_peft_model(model, config)


def trained_lora(tiny_model, mixer, steps=5):
    model = lora(tiny_model(mixer)).train()
    torch.manual_seed(11)
    ids = torch.randint(1, 100, (4, 12))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.eval(), ids, losses


@pytest.mark.parametrize("mixer_name", ["rdn", "hybrid"])
def test_lora_targets_and_training_lowers_loss(tiny_model, mixer_name):
    model, _, losses = trained_lora(tiny_model, mixer_name)
    names = [name for name, _ in model.named_parameters()]
    for target in TARGETS:
        assert any(f".{target}.lora_A." in name for name in names), target
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert losses[-1] < losses[0] - 0.05, losses


def test_adapter_reloads_on_fresh_base(tiny_model, tmp_path):
    model, ids, _ = trained_lora(tiny_model, "rkla")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    fresh = peft.PeftModel.from_pretrained(tiny_model("rkla"), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, expected)


def test_merge_and_unload_then_save_and_reload(tiny_model, load_remote, tmp_path):
    model, ids, _ = trained_lora(tiny_model, "hybrid")
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        merged_model = model.merge_and_unload()
        merged = merged_model(input_ids=ids).logits
    assert type(merged_model).__name__ == "ResLinForCausalLM"
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-5)
    merged_model.save_pretrained(tmp_path / "merged")
    reloaded = load_remote(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, merged)


def test_short_convolutions_train_as_modules_to_save_and_reload(tiny_model, tmp_path):
    """The depthwise short convolutions take no LoRA (PEFT refuses a rank not divisible by their
    groups); as modules_to_save they train, and the adapter folder carries their trained copies."""
    with pytest.raises(ValueError, match="groups"):
        peft.get_peft_model(tiny_model("rdn"), peft.LoraConfig(r=4, target_modules=["q_conv1d"]))
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["q_conv1d", "k_conv1d", "v_conv1d"])
    model = peft.get_peft_model(tiny_model("rdn"), config).train()
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    convolutions = [p for name, p in model.named_parameters() if "conv1d.modules_to_save" in name]
    assert len(convolutions) == 6 and all(p.requires_grad and p.grad.abs().sum() > 0 for p in convolutions)
    with torch.no_grad():
        for p in convolutions:
            p.add_(0.1)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert not torch.equal(expected, tiny_model("rdn")(input_ids=ids).logits)
    model.save_pretrained(tmp_path / "adapter")
    fresh = peft.PeftModel.from_pretrained(tiny_model("rdn"), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, expected)
        assert torch.equal(model.merge_and_unload()(input_ids=ids).logits, expected)


def test_tied_embeddings_go_by_the_names_peft_ties_and_saves(tiny_model, tmp_path):
    """PEFT knows embeddings by transformers' names (embed_tokens, lm_head): on a tied model, LoRA on
    both kept tied (ensure_weight_tying) reloads exactly, and the usual modules_to_save recipe trains
    the input embedding's copy."""
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    config = peft.LoraConfig(r=4, target_modules=["embed_tokens", "lm_head", "q_proj"], ensure_weight_tying=True)
    model = peft.get_peft_model(tiny_model("rdn", tie_word_embeddings=True), config).eval()
    assert any("embed_tokens.lora_embedding_A" in name for name, _ in model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_()  # LoRA starts as the identity: give it something to save
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    fresh = peft.PeftModel.from_pretrained(tiny_model("rdn", tie_word_embeddings=True), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, expected)

    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    model = peft.get_peft_model(tiny_model("rdn", tie_word_embeddings=True), config).train()
    model(input_ids=ids, labels=ids).loss.backward()
    saved = {name: p for name, p in model.named_parameters() if "modules_to_save" in name}
    assert any("embed_tokens" in name for name in saved), sorted(saved)
    assert all(p.requires_grad and p.grad.abs().sum() > 0 for p in saved.values())


@pytest.mark.skipif(kernels_reslin.triton_chunk_attention is None, reason="needs the triton package")
def test_lora_with_checkpointing_through_the_triton_kernels(tiny_model):
    """LoRA with activation checkpointing through the Triton forward and backward (the interpreter
    on a CPU): the adapters' gradients equal those through the torch kernels (fp32, rel. 1e-5),
    and a few steps lower the loss."""
    ids = torch.randint(1, 100, (1, 40), generator=torch.Generator().manual_seed(3))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grads = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(5)
        model = lora(tiny_model("rdn", kernel_backend=backend, head_dim=16)).to(device).train()
        model.gradient_checkpointing_enable()
        loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for name, grad in grads["triton"].items():
        ref = grads["torch"][name]
        assert (grad - ref).norm() <= 1e-5 * ref.norm() + 1e-12, name
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
