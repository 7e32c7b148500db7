"""Bad input to forward and generate: each gives a ValueError or TypeError that names the
argument, found from types, dtypes and shapes alone (no tensor value is read in a generation
step, where that would cost a device sync per token)."""

import pytest
import torch
from transformers import DynamicCache

IDS = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(0))


def with_value(value, at=(0, 1)):
    """IDS with one entry replaced."""
    ids = IDS.clone()
    ids[at] = value
    return ids


def embeds(hidden_size=32, dtype=torch.float32):
    return torch.ones(2, 5, hidden_size, dtype=dtype)


# (keyword arguments, error type, a pattern of the message); each also goes through generate
# unless marked forward-only.
BAD_INPUTS = {
    "3-D input_ids": ({"input_ids": IDS[None]}, ValueError, r"input_ids must have shape \[batch, tokens\]"),
    "1-D input_ids": ({"input_ids": IDS[0]}, ValueError, r"input_ids must have shape \[batch, tokens\]"),
    "float input_ids": ({"input_ids": IDS.float()}, TypeError, "input_ids must hold integers"),
    "bool input_ids": ({"input_ids": IDS > 50}, TypeError, "input_ids must hold integers"),
    "list input_ids": ({"input_ids": IDS.tolist()}, TypeError, "input_ids must be a torch.Tensor"),
    "no tokens": ({"input_ids": IDS[:, :0]}, ValueError, r"input_ids is empty \(shape \(2, 0\)\)"),
    "no rows": ({"input_ids": IDS[:0]}, ValueError, r"input_ids is empty \(shape \(0, 5\)\)"),
    "mask too short": ({"input_ids": IDS, "attention_mask": torch.ones(2, 4, dtype=torch.long)}, ValueError,
                       r"attention_mask must have shape \[batch, past \+ new tokens\] = \[2, 5\]"),
    "4-D mask": ({"input_ids": IDS, "attention_mask": torch.ones(2, 1, 5, 5)}, ValueError,
                 "attention_mask must have shape"),
    "list mask": ({"input_ids": IDS, "attention_mask": [[1] * 5] * 2}, TypeError,
                  "attention_mask must be a torch.Tensor"),
    "complex mask": ({"input_ids": IDS, "attention_mask": torch.ones(2, 5, dtype=torch.complex64)}, TypeError,
                     "attention_mask must hold 0"),
    "embeds of another width": ({"inputs_embeds": embeds(16)}, ValueError,
                                r"inputs_embeds must have shape \[batch, tokens, hidden_size=32\]"),
    "2-D embeds": ({"inputs_embeds": embeds()[0]}, ValueError, "inputs_embeds must have shape"),
    "integer embeds": ({"inputs_embeds": embeds(dtype=torch.long)}, TypeError, "inputs_embeds must be floating"),
    "empty embeds": ({"inputs_embeds": embeds()[:, :0]}, ValueError, "inputs_embeds is empty"),
    "ids and embeds": ({"input_ids": IDS, "inputs_embeds": embeds()}, ValueError,
                       "exactly one of input_ids and inputs_embeds, not both"),
    "neither": ({}, ValueError, "exactly one of input_ids and inputs_embeds, got neither"),
    "1-D position_ids": ({"input_ids": IDS, "position_ids": torch.arange(5)}, ValueError,
                         r"position_ids must have shape \[batch, tokens\]"),
    "short position_ids": ({"input_ids": IDS, "position_ids": torch.arange(4).expand(2, 4)}, ValueError,
                           r"position_ids must have shape \[batch, tokens\] = \[2, 5\]"),
    "float position_ids": ({"input_ids": IDS, "position_ids": torch.arange(5.0)[None]}, TypeError,
                           "position_ids must hold integers"),
    "transformers' cache": ({"input_ids": IDS, "cache": DynamicCache()}, TypeError,
                            "cache must be a ResLinCache, got DynamicCache"),
    "labels of another shape": ({"input_ids": IDS, "labels": IDS[:, :4]}, ValueError,
                                r"labels must have the inputs' shape \[batch, tokens\] = \[2, 5\]"),
    "float labels": ({"input_ids": IDS, "labels": IDS.float()}, TypeError, "labels must hold integers"),
    "labels without every logit": ({"input_ids": IDS, "labels": IDS, "logits_to_keep": 1}, ValueError,
                                   "labels need the logits of every position"),
    "shift_labels of another shape": ({"input_ids": IDS, "labels": IDS, "shift_labels": IDS[:1]}, ValueError,
                                      "shift_labels must have the inputs' shape"),
    "uint8 input_ids": ({"input_ids": IDS.to(torch.uint8)}, TypeError, "input_ids must hold integers as torch.long"),
    "uint8 labels": ({"input_ids": IDS, "labels": IDS.to(torch.uint8)}, TypeError, "labels must hold integers"),
    "labels past the vocabulary": ({"input_ids": IDS, "labels": with_value(100)}, ValueError,
                                   r"labels must lie in \[0, vocab_size=100\) or be -100 \(ignored\), got \[100"),
    "negative labels": ({"input_ids": IDS, "labels": with_value(-1)}, ValueError,
                        r"labels must lie in .* got \[-1"),
    "embeds of another dtype": ({"inputs_embeds": embeds(dtype=torch.float64)}, TypeError,
                                "inputs_embeds have dtype torch.float64, the model torch.float32"),
    "mask with a hole": ({"input_ids": IDS, "attention_mask": torch.tensor([[1, 1, 0, 1, 1]] * 2)}, ValueError,
                         "attention_mask has padding between tokens"),
    "pad token inside a prompt without mask": ({"input_ids": with_value(0, at=(0, 2))}, ValueError,
                                                "generate, given no attention_mask, makes one from pad_token_id"),
    "negative logits_to_keep": ({"input_ids": IDS, "logits_to_keep": -2}, ValueError, "logits_to_keep must be >= 0"),
    "float logits_to_keep": ({"input_ids": IDS, "logits_to_keep": 1.0}, TypeError,
                             "logits_to_keep must be an int or a tensor"),
}
FORWARD_ONLY = {"ids and embeds", "neither", "labels of another shape", "float labels", "labels without every logit",
                "shift_labels of another shape", "uint8 labels", "labels past the vocabulary", "negative labels",
                "negative logits_to_keep", "float logits_to_keep"}
GENERATE_ONLY = {"pad token inside a prompt without mask"}  # forward makes no mask of pad tokens


@pytest.mark.parametrize("case", [case for case in BAD_INPUTS if case not in GENERATE_ONLY])
def test_forward_names_the_bad_argument(tiny_model, case):
    kwargs, error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        tiny_model("hybrid")(**kwargs)


@pytest.mark.parametrize("case", [case for case in BAD_INPUTS if case not in FORWARD_ONLY])
@torch.no_grad()
def test_generate_names_the_bad_argument(tiny_model, case):
    kwargs, error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        tiny_model("hybrid").generate(**kwargs, max_new_tokens=2, do_sample=False)


@torch.no_grad()
def test_generate_takes_ids_with_their_embeddings(tiny_model):
    """generate returns input_ids as the prompt of inputs_embeds: their shapes must agree."""
    model = tiny_model("hybrid")
    out = model.generate(IDS, inputs_embeds=model.get_input_embeddings()(IDS), max_new_tokens=2, do_sample=False)
    assert torch.equal(out, model.generate(IDS, max_new_tokens=2, do_sample=False))
    with pytest.raises(ValueError, match=r"input_ids given with inputs_embeds must have their \[batch, tokens\]"):
        model.generate(IDS[:, :4], inputs_embeds=model.get_input_embeddings()(IDS), max_new_tokens=2)


@torch.no_grad()
def test_cache_of_another_batch_size(tiny_model, reslin):
    model = tiny_model("hybrid")
    with pytest.raises(ValueError, match="ResLinCache holds a batch of 3 sequences but the input has 2 rows"):
        model(IDS, cache=reslin.ResLinCache(model.config, batch_size=3))


@pytest.mark.parametrize("mixer_name", ["rdn", "hybrid"])
@torch.no_grad()
def test_a_decode_step_reads_no_tensor_value(tiny_model, make_left_padded, monkeypatch, mixer_name):
    """Every check of a generation step works from shapes: reading a value on the host (.item(),
    .tolist(), a tensor in an `if`) would sync the device at every token. On a CPU nothing syncs,
    so the reads themselves are refused here."""
    model = tiny_model(mixer_name)
    ids, mask = make_left_padded([torch.randint(1, 100, (n,)) for n in (6, 3)])
    output = model(ids, attention_mask=mask, use_cache=True)
    cache = output.cache if "cache" in output else output.past_key_values
    step_ids, step_mask = torch.randint(1, 100, (2, 1)), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    logits = model(step_ids, attention_mask=step_mask, cache=cache).logits
    with pytest.raises(AssertionError, match="read on the host"):  # a prompt's values are checked
        model(ids, attention_mask=mask)
    monkeypatch.undo()
    assert logits.shape == (2, 1, 100)


def test_out_of_range_input_ids_are_named(tiny_model):
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=100\), got \[100, -3\] among them"):
        tiny_model("rdn")(with_value(-3, (1, 0)).where(with_value(100) != 100, 100))


def test_embeds_of_another_dtype_run_under_autocast(tiny_model):
    model = tiny_model("rdn").to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(inputs_embeds=embeds()).logits.shape == (2, 5, 100)
