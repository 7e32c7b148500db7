"""ResLin model forward: every mixer, loss, caches, padding masks, initialisation, training paths.

Tolerances: fp32 comparisons of two computations of the same logits use atol 1e-5 (the
chunked kernel sums in a different order than token-by-token decoding).
"""

import math

import pytest
import torch
import torch.nn.functional as F

ATOL = 1e-5


def cache_of(output):
    return output.cache if "cache" in output else output.past_key_values


def test_forward_every_mixer(tiny_model, mixer):
    model = tiny_model(mixer)
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (2, 11))
    out = model(ids)
    assert out.logits.shape == (2, 11, 100)
    assert torch.isfinite(out.logits).all()


def test_parameter_names_follow_fla(tiny_model, tiny_config):
    model = tiny_model("rdn")
    params = dict(model.named_parameters())
    prefix = "model.layers.0.attn."
    for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "gamma_proj", "g_proj", "o_proj"):
        assert prefix + name + ".weight" in params, name
        assert prefix + name + ".bias" not in params, name
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        assert params[prefix + name + ".weight"].shape[1:] == (1, 4)
    assert params[prefix + "A_log"].shape == (2,) and params[prefix + "dt_bias"].shape == (2,)
    assert params[prefix + "o_norm.weight"].shape == (16,)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.1.attn_norm.weight",
                 "model.layers.1.mlp_norm.weight", "model.layers.1.mlp.gate_proj.weight",
                 "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert name in params, name
    assert not any("gamma_proj" in name for name, _ in tiny_model("gdn").named_parameters())
    hybrid = dict(tiny_model("hybrid").named_parameters())
    assert hybrid["model.layers.1.attn.k_proj.weight"].shape == (2 * 8, 32)  # 2 kv heads of 32 // 4


def test_initialisation(tiny_model):
    model = tiny_model("rdn", initializer_range=0.02, num_v_heads=64, num_heads=4, head_dim=8)
    attn = model.model.layers[0].attn
    A = attn.A_log.detach().exp()
    assert (A > 0).all() and (A <= 16).all()
    dt = F.softplus(attn.dt_bias.detach())
    assert (dt >= 1e-4 * 0.999).all() and (dt <= 0.1 * 1.001).all()
    assert attn.A_log._no_weight_decay and attn.dt_bias._no_weight_decay
    assert torch.equal(attn.o_norm.weight, torch.ones_like(attn.o_norm.weight))
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert abs(attn.q_proj.weight.std().item() - 0.02) < 0.004
    assert abs(model.model.embed_tokens.weight.std().item() - 0.02) < 0.004


def test_loss_is_shifted_cross_entropy(tiny_model):
    model = tiny_model("kla")
    torch.manual_seed(2)
    ids = torch.randint(0, 100, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 100), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected, rtol=0, atol=1e-6)


def test_logits_to_keep(tiny_model):
    model = tiny_model("rla")
    ids = torch.randint(0, 100, (2, 7))
    full = model(ids).logits
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits, full[:, -1:], rtol=0, atol=1e-6)
    assert model(ids, logits_to_keep=0).logits.shape == full.shape


def test_inputs_embeds_and_tuple_output(tiny_model):
    model = tiny_model("hybrid")
    ids = torch.randint(0, 100, (2, 6))
    ref = model(ids).logits
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, ref, rtol=0, atol=1e-6)
    as_tuple = model(ids, return_dict=False, use_cache=False)
    torch.testing.assert_close(as_tuple[0], ref, rtol=0, atol=1e-6)
    hidden = model(ids, output_hidden_states=True).hidden_states
    assert len(hidden) == model.config.num_hidden_layers + 1
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, inputs_embeds=embeds)


def test_tied_embeddings(tiny_model):
    model = tiny_model("gdn", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(tiny_model, mixer):
    model = tiny_model(mixer)
    torch.manual_seed(3)
    ids = torch.randint(1, 100, (2, 12))
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :5], use_cache=True)
    pieces, cache = [out.logits], cache_of(out)
    # Two single-token decode steps, then a multi-token chunk continuing from the cache, then decode again.
    for start, end in ((5, 6), (6, 7), (7, 10), (10, 11), (11, 12)):
        out = model(ids[:, start:end], cache=cache, use_cache=True)
        pieces.append(out.logits)
        cache = cache_of(out)
    assert cache.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=ATOL)


@torch.no_grad()
def test_every_cache_keyword_decodes_identically(tiny_model):
    """`cache`, `past_key_values`, Mamba's `cache_params` and older models' `past_key_value`, on
    the causal LM and on the base model."""
    model = tiny_model("hybrid")
    ids = torch.randint(1, 100, (2, 8))
    keywords = ("cache", "past_key_values", "cache_params", "past_key_value")
    logits = {}
    for keyword in keywords:
        out = model(ids[:, :4], use_cache=True)
        steps = [out.logits]
        for t in range(4, 8):
            out = model(ids[:, t:t + 1], use_cache=True, **{keyword: cache_of(out)})
            steps.append(out.logits)
        logits[keyword] = torch.cat(steps, dim=1)
    for keyword in keywords[1:]:
        assert torch.equal(logits[keyword], logits["cache"]), keyword
    torch.testing.assert_close(logits["cache"], model(ids).logits, rtol=0, atol=ATOL)
    for keyword in keywords:
        cache = cache_of(model(ids[:, :4]))
        model.model(ids[:, 4:5], **{keyword: cache})
        assert cache.get_seq_length() == 5, keyword
    first = cache_of(model(ids[:, :4]))
    second = cache_of(model(ids[:, :4]))
    for keyword in keywords[1:]:
        with pytest.raises(ValueError, match="under one name"):
            model(ids[:, 4:5], cache=first, **{keyword: second})
    model(ids[:, 4:5], cache=first, cache_params=first)  # the same cache twice is no conflict


def test_kernel_backend_assigned_after_building_is_refused(tiny_model):
    """The layers choose their kernels when built: a later config.kernel_backend would go unread."""
    model = tiny_model("rdn")
    ids = torch.randint(1, 100, (1, 5))
    model.config.kernel_backend = "recurrent"
    with pytest.raises(ValueError, match="after the model was built"):
        model(ids)


def test_cache_from_another_model_is_refused(tiny_model):
    model = tiny_model("rdn")
    ids = torch.randint(1, 100, (2, 4))
    cases = {
        "gdn (no residual state)": tiny_model("gdn"),
        "hybrid (other layer types)": tiny_model("hybrid"),
        "three layers": tiny_model("rdn", num_hidden_layers=3),
        "wider heads": tiny_model("rdn", head_dim=8, num_heads=4),
    }
    for name, other in cases.items():
        foreign = cache_of(other(ids))
        with pytest.raises(ValueError, match="another model"):
            model(ids[:, :1], cache=foreign)
    with pytest.raises(ValueError, match="batch of 2"):
        model(ids[:1, :1], cache=cache_of(model(ids)))


@torch.no_grad()
def test_left_padded_batch_equals_rows_alone(tiny_model, make_left_padded, mixer):
    model = tiny_model(mixer)
    torch.manual_seed(4)
    rows = [torch.randint(1, 100, (n,)) for n in (9, 4, 1, 6)]
    ids, mask = make_left_padded(rows)
    batched = model(ids, attention_mask=mask).logits
    for i, row in enumerate(rows):
        alone = model(row[None]).logits[0]
        torch.testing.assert_close(batched[i, ids.shape[1] - len(row):], alone, rtol=0, atol=ATOL)


@torch.no_grad()
def test_left_padded_decode_equals_rows_alone(tiny_model, make_left_padded, mixer):
    model = tiny_model(mixer)
    torch.manual_seed(5)
    rows = [torch.randint(1, 100, (n,)) for n in (7, 3)]
    nxt = torch.randint(1, 100, (2, 3))
    ids, mask = make_left_padded(rows)
    cache = cache_of(model(ids, attention_mask=mask, use_cache=True))
    steps = []
    for t in range(3):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        out = model(nxt[:, t:t + 1], attention_mask=mask, cache=cache)
        steps.append(out.logits)
    steps = torch.cat(steps, dim=1)
    for i, row in enumerate(rows):
        alone = model(torch.cat([row, nxt[i]])[None]).logits[0, -3:]
        torch.testing.assert_close(steps[i], alone, rtol=0, atol=ATOL)


@torch.no_grad()
def test_right_padded_batch_equals_rows_alone(tiny_model):
    model = tiny_model("hybrid")
    rows = [torch.randint(1, 100, (n,)) for n in (6, 3)]
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    batched = model(ids, attention_mask=mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(batched[i, :len(row)], model(row[None]).logits[0], rtol=0, atol=ATOL)


def test_invalid_masks_and_ids_raise(tiny_model):
    model = tiny_model("rdn")
    ids = torch.randint(1, 100, (2, 5))
    with pytest.raises(ValueError, match="contiguous"):
        model(ids, attention_mask=torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="shape"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        model(ids, attention_mask=torch.ones(2, 1, 5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="only 0"):
        model(ids, attention_mask=torch.full((2, 5), 2))
    cache = cache_of(model(ids, use_cache=True))
    with pytest.raises(ValueError, match=r"\[2, 6\]"):  # with a cache the mask covers past + new tokens
        model(ids[:, :1], cache=cache, attention_mask=torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size=100"):
        model(torch.tensor([[1, 100]]))
    with pytest.raises(ValueError, match="vocab_size=100"):
        model(torch.tensor([[-1, 3]]))


def test_gradient_checkpointing_gives_same_gradients(tiny_model):
    ids = torch.randint(1, 100, (2, 10))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model("hybrid").train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@torch.no_grad()
def test_bf16_forward_close_to_fp32(tiny_model):
    model = tiny_model("rdn")
    ids = torch.randint(1, 100, (2, 16))
    ref = model(ids).logits
    out = model.to(torch.bfloat16)(ids).logits
    assert out.dtype == torch.bfloat16
    # Tiny weights give logits ~0.1; bf16 keeps ~3 significant digits.
    assert (out.float() - ref).abs().max() < 2e-2 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("mixer_name", ["rdn", "rkla", "hybrid"])
def test_bf16_training_step_matches_fp32_gradients(tiny_model, mixer_name):
    """bf16 weights and activations train: finite loss and gradients close to fp32's (the
    recurrence itself accumulates in fp32; bf16 rounding elsewhere keeps ~2-3 digits)."""
    ids = torch.randint(1, 100, (2, 24))
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(mixer_name).to(dtype).train()
        loss = model(ids, labels=ids).loss
        assert torch.isfinite(loss)  # transformers computes the loss in fp32 either way
        loss.backward()
        grads[dtype] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    assert torch.isfinite(grads[torch.bfloat16]).all()
    error = (grads[torch.bfloat16] - grads[torch.float32]).norm() / grads[torch.float32].norm()
    # Measured 0.005 for rdn and hybrid, 0.064 for rkla, whose raw keys enter its step squared.
    assert error < 1e-1, error


def test_supports_default_dynamic_cache_is_false(reslin):
    assert reslin.ResLinForCausalLM._supports_default_dynamic_cache() is False
    assert reslin.ResLinForCausalLM._no_split_modules == ["ResLinBlock"]
    assert reslin.ResLinForCausalLM.supports_gradient_checkpointing


def test_crop_is_refused(tiny_model):
    model = tiny_model("rdn")
    cache = cache_of(model(torch.randint(1, 100, (1, 4))))
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(2)


@torch.no_grad()
def test_beam_reorder_cache(tiny_model):
    model = tiny_model("hybrid")
    ids = torch.randint(1, 100, (3, 5))
    cache = cache_of(model(ids))
    order = torch.tensor([2, 2, 0])
    cache.reorder_cache(order)
    nxt = torch.randint(1, 100, (3, 1))
    got = model(nxt, cache=cache).logits
    expected = model(torch.cat([ids[order], nxt], dim=1)).logits[:, -1:]
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    assert math.isfinite(got.sum().item())


@pytest.mark.parametrize("mixer_name,value_heads", [("gdn", 2), ("kla", 2), ("rdn", 2), ("rkla", 2), ("rkla", 4)])
@torch.no_grad()
def test_kernel_inputs_follow_the_step_rule(tiny_model, reslin, monkeypatch, mixer_name, value_heads):
    """What the layer hands reslin_attention: normalised q, keys and write strengths per step rule
    (the Kaczmarz step of a key head shared by its value heads)."""
    model = tiny_model(mixer_name, initializer_range=0.2,  # features well above the L2 norm's eps
                       num_v_heads=value_heads, expand_v=2 / value_heads)
    attn = model.model.layers[0].attn
    calls = []
    kernel = reslin.modeling.reslin_attention

    def spy(q, k, v, g, beta, gamma=None, **kwargs):
        calls.append(dict(q=q, k=k, g=g, beta=beta, gamma=gamma, **kwargs))
        return kernel(q, k, v, g, beta, gamma, **kwargs)

    monkeypatch.setattr(reslin.modeling, "reslin_attention", spy)
    x = torch.randn(2, 6, 32)
    attn(x)
    call = calls[0]
    torch.testing.assert_close(call["q"].norm(dim=-1), torch.ones(2, 6, 2), rtol=0, atol=1e-5)
    assert call["update"] == model.config.update_rule and call["clip"] == 1.0
    assert (call["g"] <= 0).all() and call["g"].dtype == torch.float32
    eta = attn.b_proj(x).sigmoid()
    gamma = attn.gamma_proj(x).sigmoid() if model.config.use_residual else None
    if model.config.step_rule == "kaczmarz":
        norm2 = call["k"].pow(2).sum(-1).repeat_interleave(value_heads // 2, dim=-1)
        assert not torch.allclose(norm2, torch.ones_like(norm2))  # raw keys
        torch.testing.assert_close(call["beta"], eta / (norm2 + 1e-6))
        if gamma is not None:
            torch.testing.assert_close(call["gamma_write"], gamma / (norm2 + 1e-6))
    else:
        torch.testing.assert_close(call["k"].norm(dim=-1), torch.ones(2, 6, 2), rtol=0, atol=1e-5)
        torch.testing.assert_close(call["beta"], eta)
        assert call["gamma_write"] is None
    if gamma is None:
        assert call["gamma"] is None
    else:
        torch.testing.assert_close(call["gamma"], gamma)


def test_autocast_training_feeds_the_kernels_low_precision_and_builds_no_cache(tiny_model, reslin, monkeypatch):
    """fp32 weights under bf16 autocast (what Trainer(bf16=True) does): q, k, v reach the kernels in
    bf16 (fp32 short-convolution taps used to promote them to fp32, the kernels' slow exact
    path), and a training forward builds no cache unless asked."""
    model = tiny_model("rdn").train()
    dtypes = []
    kernel = reslin.modeling.reslin_attention

    def spy(q, k, v, *args, **kwargs):
        dtypes.append((q.dtype, k.dtype, v.dtype))
        return kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(reslin.modeling, "reslin_attention", spy)
    ids = torch.randint(3, 100, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    assert dtypes and all(d == (torch.bfloat16,) * 3 for d in dtypes)
    assert out.past_key_values is None
    assert model(ids, use_cache=True).past_key_values is not None


@torch.no_grad()
def test_rkla_stays_finite_with_large_keys(tiny_model):
    model = tiny_model("rkla", initializer_range=0.5)
    logits = model(torch.randint(1, 100, (2, 64))).logits
    assert torch.isfinite(logits).all()


PACKED_LENGTHS = [5, 1, 9, 4]  # a one-token sequence, and sequences shorter than the conv window


@torch.no_grad()
def test_packed_sequences_equal_each_sequence_alone(tiny_model, mixer):
    """One row of packed sequences (position_ids restarting at 0, or cu_seq_lens_q) gives each
    sequence's logits alone: no state, conv window or attention crosses a boundary (fp32, 1e-5)."""
    model = tiny_model(mixer)
    rows = [torch.randint(1, 100, (n,)) for n in PACKED_LENGTHS]
    ids = torch.cat(rows)[None]
    position_ids = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]
    alone = torch.cat([model(row[None]).logits[0] for row in rows])
    torch.testing.assert_close(model(ids, position_ids=position_ids).logits[0], alone, rtol=0, atol=1e-5)
    cu = torch.tensor([0] + PACKED_LENGTHS).cumsum(0)
    torch.testing.assert_close(model(ids, position_ids=position_ids, cu_seq_lens_q=cu).logits[0], alone,
                               rtol=0, atol=1e-5)


def test_padding_free_collator_trains_on_packed_sequences(tiny_model):
    """transformers' DataCollatorWithFlattening: the packed loss is the token-weighted mean of the
    sequences' own losses, and its gradients are theirs."""
    from transformers import DataCollatorWithFlattening

    rows = [torch.randint(1, 100, (n,)) for n in (6, 3, 8)]
    batch = DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": r.tolist()} for r in rows])
    model = tiny_model("hybrid").train()
    model(**batch).loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = sum(len(r) - 1 for r in rows)
    sum(model(r[None], labels=r[None]).loss * (len(r) - 1) / total for r in rows).backward()
    for packed, separate in zip(packed_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-6)


@torch.no_grad()
def test_packed_sequences_need_no_position_ids_beside_cu_seq_lens_q(tiny_model):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False): the
    positions, which the short convolutions and RoPE read, restart at each sequence's start."""
    from transformers import DataCollatorWithFlattening

    rows = [torch.randint(1, 100, (n,)) for n in (6, 3, 8)]
    features = [{"input_ids": r.tolist()} for r in rows]
    with_positions = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(features)
    without = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)(features)
    assert "position_ids" not in without
    model = tiny_model("hybrid")
    expected = model(**with_positions)
    got = model(**without)
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)


def test_packed_sequences_refuse_a_cache_and_padding(tiny_model, reslin):
    model = tiny_model("rdn")
    ids = torch.randint(1, 100, (1, 6))
    packed = dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), cu_seq_lens_q=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="cannot use a cache"):
        model(ids, cache=reslin.ResLinCache(model.config, 1), **packed)
    with pytest.raises(ValueError, match="no padding"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]), **packed)
    assert model(ids, **packed).past_key_values is None


@torch.no_grad()
def test_padded_single_row_is_not_taken_for_packed_sequences(tiny_model, make_left_padded):
    """position_ids with repeated zeros in a padded row (how pads are often numbered) are one
    sequence's positions, not packing: the row equals the unpadded sequence."""
    model = tiny_model("hybrid")
    row = torch.randint(1, 100, (5,))
    ids, mask = make_left_padded([row, torch.randint(1, 100, (8,))])
    ids, mask = ids[:1], mask[:1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=position_ids).logits[0, -5:]
    torch.testing.assert_close(logits, model(row[None]).logits[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "num_items_in_batch", "shift_labels"])
def test_chunked_loss_matches_transformers_loss(reslin, monkeypatch, dtype, reduction):
    """causal_lm_loss (blocks of rows in fp32) against transformers' ForCausalLMLoss: the loss and
    the logits' gradient, with ignored labels, over several blocks and a partial last one."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    monkeypatch.setattr(reslin.modeling.ChunkedCrossEntropy, "BLOCK_ELEMENTS", 3 * 50)  # blocks of 3 rows
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 7, 50)).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 7))
    labels[0, 2] = labels[1, 5] = -100
    kwargs = {"mean": {}, "num_items_in_batch": {"num_items_in_batch": torch.tensor(9)},
              "shift_labels": {"shift_labels": labels.roll(-1, 1)}}[reduction]
    results = []
    for loss_function in (reslin.modeling.causal_lm_loss, ForCausalLMLoss):
        loss = loss_function(logits=logits, labels=labels, vocab_size=50, **kwargs)
        results.append((loss, torch.autograd.grad(loss, logits)[0]))
    (loss, grad), (loss_ref, grad_ref) = results
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "num_items_in_batch"])
def test_a_batch_with_every_label_ignored_gives_zero_gradients(tiny_model, reduction):
    """As transformers' loss: NaN (0 / 0) as the loss, but zero gradients, so that an optimizer step
    on such a batch (prompt-masked fine-tuning can make one) leaves the weights as they were."""
    model = tiny_model("rdn").train()
    ids = torch.randint(3, 100, (2, 8))
    kwargs = {"num_items_in_batch": torch.tensor(0)} if reduction == "num_items_in_batch" else {}
    loss = model(ids, labels=torch.full_like(ids, -100), **kwargs).loss
    assert loss.isnan()
    loss.backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_without_a_mask_equals_the_masked_path(tiny_model, monkeypatch, kv_heads):
    """Causality alone (no padding, no window, no cache), packed or not, takes SDPA's causal path
    with no [T, T] mask: outputs and gradients equal the masked path's (GQA too)."""
    attn = tiny_model("hybrid", num_key_value_heads=kv_heads).model.layers[1].attn
    B, T = 1, 23
    q = torch.randn(B, attn.num_heads, T, attn.head_dim, requires_grad=True)
    k, v = (torch.randn(B, attn.num_kv_heads, T, attn.head_dim, requires_grad=True) for _ in range(2))
    for cu_seqlens in (None, torch.tensor([0, 7, 8, 20, 23])):
        masked = []
        with monkeypatch.context() as patch:  # the masked path: a mask of ones (all tokens real)
            patch.setattr(attn, "sliding_window", 10 ** 9)
            out = attn.attend(q, k, v, None, cu_seqlens)
            masked = [out, *torch.autograd.grad(out.square().sum(), (q, k, v))]
        with monkeypatch.context() as patch:
            patch.setattr(attn, "visibility", lambda *args: pytest.fail("a [T, T] mask was built"))
            out = attn.attend(q, k, v, None, cu_seqlens)
            fast = [out, *torch.autograd.grad(out.square().sum(), (q, k, v))]
        for got, ref in zip(fast, masked, strict=True):  # SDPA's kernels sum in their own orders
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
