"""generate() with ResLin models: greedy, sampling, beam search, padding, cache continuation.

Token comparisons are exact (greedy argmax on fp32 logits that agree to ~1e-6); log-prob
comparisons use atol 1e-4.
"""

import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers import GenerationConfig


def cache_of(output):
    return output.cache if "cache" in output else output.past_key_values


def greedy_reference(model, ids, new_tokens):
    """Greedy decoding by full forwards, no cache."""
    for _ in range(new_tokens):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@torch.no_grad()
def test_greedy_equals_full_forward_argmax(tiny_model, mixer):
    model = tiny_model(mixer)
    ids = torch.randint(1, 100, (2, 6))
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, greedy_reference(model, ids, 6))


@torch.no_grad()
def test_left_padded_generate_equals_rows_alone(tiny_model, make_left_padded, mixer):
    model = tiny_model(mixer)
    torch.manual_seed(7)
    rows = [torch.randint(1, 100, (n,)) for n in (8, 3, 5)]
    ids, mask = make_left_padded(rows)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    logits = torch.stack(out.logits, dim=1)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                               output_logits=True)
        assert torch.equal(out.sequences[i, ids.shape[1]:], alone.sequences[0, len(row):])
        torch.testing.assert_close(logits[i], torch.stack(alone.logits, dim=1)[0], rtol=0, atol=1e-5)


@torch.no_grad()
def test_sampling_is_reproducible_with_a_seed(tiny_model):
    model = tiny_model("rla")
    ids = torch.randint(1, 100, (2, 4))
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(ids, max_new_tokens=8, do_sample=True, top_k=0, temperature=1.5))
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(124)
    assert runs[0].shape == model.generate(ids, max_new_tokens=8, do_sample=True, top_k=0).shape


@torch.no_grad()
def test_num_return_sequences(tiny_model):
    model = tiny_model("hybrid")
    ids = torch.randint(1, 100, (2, 4))
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=5, do_sample=True, num_return_sequences=3)
    assert out.shape == (6, 9)
    assert torch.equal(out[:, :4], ids.repeat_interleave(3, dim=0))


@torch.no_grad()
def test_beam_search_with_one_beam_is_greedy(tiny_model):
    model = tiny_model("rdn")
    ids = torch.randint(1, 100, (2, 5))
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=1), greedy)


@pytest.mark.parametrize("mixer_name", ["rdn", "hybrid_window"])
@torch.no_grad()
def test_beam_search_scores_match_a_forward(tiny_model, mixer_name):
    """The returned beams' scores are the sums of their tokens' log-probs under one full forward."""
    model = tiny_model(mixer_name)
    ids = torch.randint(1, 100, (2, 5))
    new = 5
    out = model.generate(ids, max_new_tokens=new, num_beams=3, num_return_sequences=3, do_sample=False,
                         length_penalty=0.0, early_stopping=True, return_dict_in_generate=True,
                         output_scores=True)
    seqs = out.sequences
    assert seqs.shape == (6, 5 + new)
    logprobs = model(seqs).logits.log_softmax(-1)[:, 4:-1]
    total = logprobs.gather(-1, seqs[:, 5:, None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(out.sequences_scores, total, rtol=0, atol=1e-4)
    # Beams of one prompt come best first, and the best beam is at least as good as greedy.
    assert (out.sequences_scores.view(2, 3).diff(dim=-1) <= 1e-6).all()
    greedy = model.generate(ids, max_new_tokens=new, do_sample=False)
    greedy_lp = model(greedy).logits.log_softmax(-1)[:, 4:-1].gather(-1, greedy[:, 5:, None]).squeeze(-1).sum(-1)
    assert (out.sequences_scores.view(2, 3)[:, 0] >= greedy_lp - 1e-4).all()


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
@torch.no_grad()
def test_continue_from_returned_cache(tiny_model, make_left_padded, keyword):
    model = tiny_model("hybrid")
    rows = [torch.randint(1, 100, (n,)) for n in (6, 3)]
    ids, mask = make_left_padded(rows)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                           return_dict_in_generate=True)
    cache = cache_of(first)
    # generate returns the tokens it sampled last without feeding them through the model.
    assert cache.get_seq_length() == first.sequences.shape[1] - 1
    extra = torch.randint(1, 100, (2, 2))
    extended = torch.cat([first.sequences, extra], dim=1)
    extended_mask = torch.cat([mask, torch.ones(2, extended.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    continued = model.generate(extended, attention_mask=extended_mask, max_new_tokens=4, do_sample=False,
                               **{keyword: cache})
    fresh = model.generate(extended, attention_mask=extended_mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(continued, fresh)


@torch.no_grad()
@pytest.mark.parametrize("with_mask", [False, True])
def test_continued_logits_equal_fresh_ones(tiny_model, mixer, with_mask):
    """generate(sequences, cache=...) feeds only the tokens the cache has not seen: the same logits
    as generating from the whole sequence afresh (compared as logits: a greedy token can hide a
    wrong state behind a wide margin, or flip on a near-tie). No pad token: without a mask,
    generate would take a generated pad id for padding."""
    model = tiny_model(mixer, pad_token_id=None)
    ids = torch.randint(1, 100, (1, 5))
    first = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    mask = {"attention_mask": torch.ones_like(first.sequences)} if with_mask else {}
    settings = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True, **mask)
    continued = model.generate(first.sequences, cache=cache_of(first), **settings)
    fresh = model.generate(first.sequences, **settings)
    assert torch.equal(continued.sequences, fresh.sequences)
    for step, (got, expected) in enumerate(zip(continued.logits, fresh.logits)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f"step {step}")


ASSISTED = {
    "assistant_model": lambda tiny_model: {"assistant_model": tiny_model("rdn", seed=1)},
    "prompt_lookup_num_tokens": lambda tiny_model: {"prompt_lookup_num_tokens": 2},
    "assistant_early_exit": lambda tiny_model: {"assistant_early_exit": 1},
    "generation_config": lambda tiny_model: {"generation_config": GenerationConfig(prompt_lookup_num_tokens=2,
                                                                                  max_new_tokens=3)},
}


@pytest.mark.parametrize("how", list(ASSISTED))
@torch.no_grad()
def test_assisted_decoding_is_refused_with_our_error(tiny_model, how):
    """Ours on every transformers version: 5.24 refused stateful models with its own message, 5.25
    fails later with "Assisted decoding requires a cache"."""
    model = tiny_model("rdn")
    ids = torch.randint(1, 100, (1, 5))
    with pytest.raises(ValueError, match="ResLinForCausalLM cannot run assisted or speculative decoding"):
        model.generate(ids, **{"max_new_tokens": 3, **ASSISTED[how](tiny_model)})


@torch.no_grad()
def test_assisted_decoding_set_in_the_model_generation_config_is_refused(tiny_model):
    model = tiny_model("rdn")
    model.generation_config.prompt_lookup_num_tokens = 2
    with pytest.raises(ValueError, match="cannot run assisted"):
        model.generate(torch.randint(1, 100, (1, 5)), max_new_tokens=3)
    # A keyword setting overrides the config's, as in generate.
    assert model.generate(torch.randint(1, 100, (1, 5)), max_new_tokens=3, prompt_lookup_num_tokens=None).shape == (1, 8)


@torch.no_grad()
def test_output_attentions_warns_once_and_gives_none(tiny_model, reslin, caplog):
    """Recurrent layers have no attention weights, and the full attention layers run SDPA: no layer
    returns any, and the model says so once rather than returning None silently."""
    model = tiny_model("hybrid")
    ids = torch.randint(1, 100, (2, 5))
    type(reslin.modeling.logger).warning_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert model(ids, output_attentions=True).attentions is None
        assert model(ids, output_attentions=True).attentions is None
        out = model.generate(ids, max_new_tokens=2, do_sample=False, output_attentions=True,
                             return_dict_in_generate=True)
    assert all(step is None for step in out.attentions)
    warnings = [record.getMessage() for record in caplog.records if "no attention weights" in record.getMessage()]
    assert len(warnings) == 1 and "recurrent layers" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        type(reslin.modeling.logger).warning_once.cache_clear()
        model(ids)
        model(ids, output_attentions=False)
    assert not caplog.records


@torch.no_grad()
def test_generate_without_cache_matches(tiny_model):
    model = tiny_model("hybrid_window")
    ids = torch.randint(1, 100, (2, 5))
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False),
                       model.generate(ids, max_new_tokens=5, do_sample=False))


@torch.no_grad()
def test_bf16_generate_runs(tiny_model, make_left_padded):
    model = tiny_model("rdn").to(torch.bfloat16)
    ids, mask = make_left_padded([torch.randint(1, 100, (n,)) for n in (5, 2)])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=2)
    assert out.shape == (2, 9)


@torch.no_grad()
def test_exhaustive_beam_search_finds_the_best_continuation(tiny_model):
    """With as many beams as tokens, two steps of beam search are exhaustive: compare with brute force."""
    model = tiny_model("rkla", vocab_size=24)
    ids = torch.randint(1, 24, (1, 4))
    out = model.generate(ids, max_new_tokens=2, num_beams=24, do_sample=False, length_penalty=0.0,
                         return_dict_in_generate=True, output_scores=True)
    pairs = torch.cartesian_prod(torch.arange(24), torch.arange(24))
    candidates = torch.cat([ids.expand(len(pairs), -1), pairs], dim=1)
    logprobs = model(candidates).logits.log_softmax(-1)[:, 3:-1].gather(-1, pairs[..., None]).squeeze(-1).sum(-1)
    best = logprobs.argmax()
    assert torch.equal(out.sequences[0], candidates[best])
    torch.testing.assert_close(out.sequences_scores[0], logprobs[best], rtol=0, atol=1e-4)


@torch.no_grad()
def test_generate_from_inputs_embeds(tiny_model):
    model = tiny_model("hybrid")
    ids = torch.randint(1, 100, (2, 5))
    from_ids = model.generate(ids, max_new_tokens=4, do_sample=False)
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(from_embeds, from_ids[:, 5:])  # generate returns only the new tokens here


@torch.no_grad()
def test_generate_into_a_user_built_cache(tiny_model, reslin):
    model = tiny_model("hybrid")
    ids = torch.randint(1, 100, (2, 5))
    cache = reslin.ResLinCache(model.config, batch_size=2)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))
    assert cache.get_seq_length() == out.shape[1] - 1
    with pytest.raises(ValueError, match="batch of 2"):
        model.generate(ids[:1], max_new_tokens=2, cache=reslin.ResLinCache(model.config, batch_size=2))


def test_tokenizer_loads_without_remote_code_and_pads_left(repo_copy):
    """tokenizer_config.json names a stock class (transformers 4.57 then never reads config.json)
    and pads on the left, as batched generation needs. transformers 5's AutoTokenizer reads
    config.json first whatever the tokenizer config says, and asks whether to run the config's
    remote code: with trust_remote_code=False it asks nothing and falls back to a plain config,
    with stdin closed it falls back without waiting. PreTrainedTokenizerFast reads no config."""
    script = """
import sys
import transformers
tokenizer = getattr(transformers, sys.argv[2]).from_pretrained(sys.argv[1], **eval(sys.argv[3]))
batch = tokenizer(["a", "def f(x): return x"], padding=True)
print(tokenizer.padding_side, batch.input_ids[0][:2], batch.attention_mask[0][:2])
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for loader, kwargs in (("AutoTokenizer", "{}"), ("AutoTokenizer", "{'trust_remote_code': False}"),
                           ("PreTrainedTokenizerFast", "{}")):
        result = subprocess.run([sys.executable, "-c", script, str(repo_copy), loader, kwargs],
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stderr
        # (After the prompt's text, on its line, when transformers asks.)
        assert result.stdout.endswith("left [0, 0] [0, 0]\n"), result.stdout
        if kwargs != "{}" or loader == "PreTrainedTokenizerFast":
            assert "Do you wish to run the custom code" not in result.stdout + result.stderr


@torch.no_grad()
def test_batched_generate_with_the_repository_tokenizer(tiny_model, reslin):
    """The user's path: the tokenizer pads a batch of prompts on the left, and each row generates
    what it generates alone."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(reslin.repo_root)
    model = tiny_model("rdn", vocab_size=len(tokenizer))
    prompts = ["def f(x):", "import os\nprint(os.getcwd())"]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    assert (batch.attention_mask[:, -1] == 1).all()
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    for i, prompt in enumerate(prompts):
        alone = model.generate(**tokenizer([prompt], return_tensors="pt"), max_new_tokens=4, do_sample=False)
        assert torch.equal(out[i, -4:], alone[0, -4:])


def test_main_command_says_a_model_folder_is_missing(reslin, tmp_path, monkeypatch, capsys):
    """generate.py --model with a missing folder: one line and a failing exit code, at once,
    rather than a traceback or the Hub client's retries; "owner/name" still goes to the Hub."""
    import generate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    for name, message in ((str(tmp_path / "missing_folder"), f"--model {tmp_path / 'missing_folder'}: no such folder"),
                          ("missing_folder", f"no such folder (looked for {tmp_path / 'missing_folder'})"),
                          ("out/rdn", f"no such folder (looked for {tmp_path / 'out' / 'rdn'})"),
                          ("./rdn", "no such folder")):
        with pytest.raises(SystemExit):
            generate.model_source(name)
        assert message in capsys.readouterr().err
    assert generate.model_source("some-org/some-model") == "some-org/some-model"
    with pytest.raises(SystemExit):
        generate.model_source("out")
    assert "--model out: the folder holds no config.json" in capsys.readouterr().err
    result = subprocess.run([sys.executable, str(reslin.repo_root / "generate.py"), "--model", "no_such_folder/", "--device",
                             "cpu"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    assert result.stderr == f"generate.py: error: --model no_such_folder/: no such folder (looked for " \
                            f"{tmp_path / 'no_such_folder'})\n"
    result = subprocess.run([sys.executable, str(reslin.repo_root / "generate.py"), "--model", "no-such-owner/no-such-model",
                             "--device", "cpu"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    assert result.stderr.startswith("generate.py: error: --model no-such-owner/no-such-model: no such folder here, "
                                    "and no such model on the Hub: ") and result.stderr.count("\n") == 1
