"""generate's own loop (generation_reslin.DeviceDecoding) against transformers' loop
(`generate_fast_path=False`) on the same model and the same random state: tokens, streamed tokens
and the returned cache equal exactly (on a CPU the two loops draw the same random numbers); the
settings the loop does not take run transformers' loop; sampled tokens follow the model's
distribution (a chi-square test, on the GPU through the CUDA graph as well).
"""

import math
import sys

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from conftest import MIXERS, build_model
from test_cuda_graphs import state_tensors
from test_generate import cache_of

LINEAR_MIXERS = [name for name, fields in MIXERS.items() if "layer_types" not in fields]


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


@pytest.fixture
def fast_loop_runs(reslin, monkeypatch):
    """A list that gets True each time generate's own loop runs."""
    runs = []
    run = reslin.modeling.DeviceDecoding.run

    def recorded(self, *args, **kwargs):
        runs.append(True)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(reslin.modeling.DeviceDecoding, "run", recorded)
    return runs


def generate_both(model, *args, seed=1234, **kwargs):
    """(own loop's, transformers' loop's) outputs of one generate call, each from the same seed."""
    outputs = []
    for fast in (True, False):
        model.config.generate_fast_path = fast
        torch.manual_seed(seed)
        outputs.append(model.generate(*args, **kwargs))
    model.config.generate_fast_path = True
    return outputs


def sequences_of(output):
    return output if torch.is_tensor(output) else output.sequences


def ending_prompt(model, batch, length, steps):
    """(prompt ids [batch, length], end-of-sequence ids) such that greedy decoding ends row i after
    exactly steps[i] tokens: each id is the greedy token there, found nowhere earlier in any row."""
    for seed in range(200):
        ids = torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))
        ids = ids.to(next(model.parameters()).device)
        greedy = model.generate(ids, max_new_tokens=max(steps), do_sample=False)[:, length:].tolist()
        eos = [greedy[row][step - 1] for row, step in enumerate(steps)]
        if all(token not in greedy[row][:steps[row] - 1] for row in range(batch) for token in eos):
            return ids, eos
    raise AssertionError(f"no prompt among 200 ends its rows after {steps} greedy tokens")


SETTINGS = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, temperature=0.7, top_k=12, top_p=0.9),
    "min_p": dict(do_sample=True, top_k=0, min_p=0.05),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@torch.no_grad()
def test_own_loop_equals_transformers_loop(mixer, setting, fast_loop_runs, make_left_padded):
    model = build_model(mixer)
    ids, mask = make_left_padded([torch.randint(3, 100, (n,)) for n in (7, 3, 5)])
    # 37 tokens: three host reads, the last one short.
    fast, slow = generate_both(model, ids, attention_mask=mask, max_new_tokens=37, **SETTINGS[setting])
    assert torch.equal(fast, slow)
    assert fast.shape == (3, ids.shape[1] + 37)
    assert bool(fast_loop_runs) == (mixer in LINEAR_MIXERS)


@pytest.mark.parametrize("min_new_tokens", [0, 25])
@torch.no_grad()
def test_rows_end_at_their_own_ids_as_in_transformers_loop(fast_loop_runs, min_new_tokens):
    model = build_model("rdn")
    # Rows end after 4, 21 and 9 tokens: inside the first read, inside a later one.
    ids, eos = ending_prompt(model, 3, 5, [4, 21, 9])
    fast_loop_runs.clear()
    streams = []
    outputs = []
    for fast in (True, False):
        model.config.generate_fast_path = fast
        streamer = RecordingStreamer()
        outputs.append(model.generate(ids, max_new_tokens=40, min_new_tokens=min_new_tokens, do_sample=False,
                                      eos_token_id=eos, pad_token_id=0, streamer=streamer))
        streams.append(streamer.calls)
    assert torch.equal(outputs[0], outputs[1])
    assert streams[0] == streams[1]
    assert fast_loop_runs == [True]
    if min_new_tokens == 0:
        assert outputs[0].shape[1] == ids.shape[1] + 21  # stops with the last row's end, not at a read


@pytest.mark.parametrize("ends_after", [1, 6, 16, 17])
@torch.no_grad()
def test_returned_cache_has_seen_what_transformers_loop_feeds_it(ends_after):
    model = build_model("rkla")
    ids, eos = ending_prompt(model, 1, 6, [ends_after])
    fast, slow = generate_both(model, ids, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0,
                               return_dict_in_generate=True)
    assert torch.equal(fast.sequences, slow.sequences)
    assert fast.sequences.shape[1] == ids.shape[1] + ends_after
    fast_cache, slow_cache = cache_of(fast), cache_of(slow)
    assert fast_cache.get_seq_length() == slow_cache.get_seq_length() == ids.shape[1] + ends_after - 1
    for a, b in zip(state_tensors(fast_cache), state_tensors(slow_cache)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # And both continue alike.
    longer = torch.cat([fast.sequences, torch.randint(3, 100, (1, 3))], dim=1)
    after_fast, after_slow = (model.generate(longer, cache=cache, max_new_tokens=20, do_sample=False)
                              for cache in (fast_cache, slow_cache))
    assert torch.equal(after_fast, after_slow)


@pytest.mark.parametrize("pad_token_id", [-1, 100])
@torch.no_grad()
def test_a_padding_id_outside_the_vocabulary_when_every_row_ends_at_once(pad_token_id):
    # transformers' loop stops at the end and never embeds the padding id (LLaMA's configs had -1);
    # the steps run on to the end of the read must not embed it either.
    model = build_model("gdn")
    ids, eos = ending_prompt(model, 1, 5, [4])
    fast, slow = generate_both(model, ids, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                               pad_token_id=pad_token_id)
    assert torch.equal(fast, slow)
    assert fast.shape[1] == ids.shape[1] + 4


@torch.no_grad()
def test_sampling_without_a_distribution_fails_as_in_transformers_loop():
    # Every id ends a sequence, and none may come before the 4th token: every score is -inf.
    model = build_model("gdn")
    ids = torch.randint(3, 100, (2, 5))
    for fast in (True, False):
        model.config.generate_fast_path = fast
        with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan`"):
            model.generate(ids, max_new_tokens=8, min_new_tokens=4, do_sample=True, eos_token_id=list(range(100)),
                           pad_token_id=0)
    model.config.generate_fast_path = True


def assert_sampling_leaves_the_random_state_where_transformers_loop_does(model, ends_after):
    # top_k=1 draws the greedy tokens, which end the row after `ends_after` tokens, inside a read:
    # the steps run past the end must not leave their draws in the random state, or the next
    # sampling call from the same state draws other tokens than after transformers' loop.
    ids, eos = ending_prompt(model, 1, 5, [ends_after])
    random_state = torch.get_rng_state if ids.device.type == "cpu" else torch.cuda.get_rng_state
    states = []
    for fast in (True, False):
        model.config.generate_fast_path = fast
        torch.manual_seed(0)
        output = model.generate(ids, max_new_tokens=40, do_sample=True, top_k=1, eos_token_id=eos, pad_token_id=0)
        assert output.shape[1] == ids.shape[1] + ends_after
        states.append(random_state())
    model.config.generate_fast_path = True
    assert torch.equal(*states)


@pytest.mark.parametrize("ends_after", [6, 20])
@torch.no_grad()
def test_sampling_leaves_the_random_state_where_transformers_loop_does(ends_after):
    assert_sampling_leaves_the_random_state_where_transformers_loop_does(build_model("rdn"), ends_after)


def assert_user_built_caches_continue_alike(reslin, model, ids, max_new_tokens=20):
    """Greedy generate from a fresh ResLinCache passed in, by each loop: the same tokens, and the
    caches' states equal. Returns the two caches (own loop's, transformers')."""
    caches = [reslin.ResLinCache(model.config, ids.shape[0]) for _ in range(2)]
    outputs = []
    for fast, cache in zip((True, False), caches):
        model.config.generate_fast_path = fast
        outputs.append(model.generate(ids, cache=cache, max_new_tokens=max_new_tokens, do_sample=False))
    model.config.generate_fast_path = True
    assert torch.equal(*outputs)
    for a, b in zip(state_tensors(caches[0]), state_tensors(caches[1])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    return caches


@torch.no_grad()
def test_a_user_built_cache_is_continued_exactly(reslin):
    ids = torch.randint(3, 100, (2, 5))
    caches = assert_user_built_caches_continue_alike(reslin, build_model("rla"), ids)
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == ids.shape[1] + 19


class AddOne(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1


TRANSFORMERS_LOOP_SETTINGS = {
    "switched off": dict(),
    "beam search": dict(num_beams=2),
    "repetition penalty": dict(repetition_penalty=1.3),
    "no repeated n-grams": dict(no_repeat_ngram_size=2),
    "scores in the output": dict(return_dict_in_generate=True, output_scores=True),
    "a processor of the caller's": dict(logits_processor=LogitsProcessorList([AddOne()])),
    "a time limit": dict(max_time=60.0),
}


@pytest.mark.parametrize("setting", list(TRANSFORMERS_LOOP_SETTINGS))
@torch.no_grad()
def test_settings_it_does_not_take_run_transformers_loop(setting, fast_loop_runs):
    model = build_model("gdn")
    model.config.generate_fast_path = setting != "switched off"
    ids = torch.randint(3, 100, (2, 5))
    output = model.generate(ids, max_new_tokens=6, do_sample=False, **TRANSFORMERS_LOOP_SETTINGS[setting])
    assert sequences_of(output).shape == (2, 11)
    assert fast_loop_runs == []


@pytest.mark.parametrize("where", ["model", "model.model"])
@pytest.mark.parametrize("hook", ["forward hook", "forward pre-hook", "forward replaced"])
@torch.no_grad()
def test_a_hooked_model_runs_transformers_loop(where, hook, fast_loop_runs):
    """The own loop calls the layers and lm_head itself: hooks on the two models, or a forward
    replaced on them, would be skipped at every step but the prompt's, so they take transformers' loop."""
    model = build_model("gdn")
    module = model if where == "model" else model.model
    calls = []
    if hook == "forward hook":
        module.register_forward_hook(lambda *args: calls.append(1))
    elif hook == "forward pre-hook":
        module.register_forward_pre_hook(lambda *args: calls.append(1))
    else:
        forward = module.forward
        module.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    model.generate(torch.randint(3, 100, (2, 5)), max_new_tokens=6, do_sample=False)
    assert fast_loop_runs == [] and len(calls) == 6  # the prompt, then 5 steps


def rank_counts(model, ids, new_tokens, top_k):
    """Sample `new_tokens` tokens after every row of `ids` (one prompt repeated) with top-k, and
    compare the last token's rank in its distribution with the distribution itself: (observed
    counts per rank, expected counts per rank), over the rows whose top-k is not tied at its edge."""
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=True, top_k=top_k, temperature=1.0)
    scores = model(out[:, :-1]).logits[:, -1].float()
    top_scores, top_tokens = scores.topk(top_k + 1, dim=-1)
    clear = top_scores[:, top_k - 1] - top_scores[:, top_k] > 1e-4
    top_scores, top_tokens, drawn = top_scores[clear, :top_k], top_tokens[clear, :top_k], out[clear, -1:]
    assert len(drawn) > 0.9 * len(out)
    assert bool((top_tokens == drawn).any(-1).all()), "a token outside the top-k was drawn"
    ranks = (top_tokens == drawn).float().argmax(-1)
    observed = torch.bincount(ranks, minlength=top_k).double()
    return observed, top_scores.softmax(-1).double().sum(0)  # the top-k warper's distribution, by rank


def chi_square_threshold(dof, z=3.09):
    """The chi-square quantile at the normal quantile z (3.09: 0.999), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_follows_distribution(model, device):
    ids = torch.randint(3, 100, (1, 6), device=device).expand(4000, -1)
    # The fourth token: drawn by a replayed step on CUDA (the first comes from the prompt's
    # logits, the second from the capture's warm-up run).
    observed, expected = rank_counts(model, ids, new_tokens=4, top_k=6)
    kept = expected >= 5
    statistic = float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert statistic < chi_square_threshold(int(kept.sum()) - 1), (observed, expected)


@torch.no_grad()
def test_sampled_tokens_follow_the_model_distribution(fast_loop_runs):
    # No padding id: its embedding row is zero, and after it every token ties.
    assert_follows_distribution(build_model("rdn", pad_token_id=None), "cpu")
    assert fast_loop_runs == [True]


class TestOnGPU:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

    @pytest.mark.parametrize("mixer_name", ["gdn", "rdn", "rkla", "sgla"])
    @torch.no_grad()
    def test_greedy_equals_transformers_loop(self, mixer_name, fast_loop_runs, make_left_padded):
        model = build_model(mixer_name).cuda()
        ids, mask = make_left_padded([torch.randint(3, 100, (n,)) for n in (9, 4, 13)])
        fast, slow = generate_both(model, ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40,
                                   do_sample=False)
        assert torch.equal(fast, slow)
        assert fast_loop_runs == [True]

    @torch.no_grad()
    def test_bf16_greedy_equals_transformers_loop(self, fast_loop_runs):
        model = build_model("rdn", hidden_size=256, num_heads=2, head_dim=128, intermediate_size=512,
                            num_hidden_layers=4).to("cuda", torch.bfloat16)
        ids = torch.randint(3, 100, (4, 64), device="cuda")
        fast, slow = generate_both(model, ids, max_new_tokens=64, do_sample=False)
        assert torch.equal(fast, slow)

    @torch.no_grad()
    def test_sampled_tokens_follow_the_model_distribution(self, fast_loop_runs):
        assert_follows_distribution(build_model("gdn", pad_token_id=None).cuda(), "cuda")
        assert fast_loop_runs == [True]

    @torch.no_grad()
    def test_sampling_leaves_the_random_state_where_transformers_loop_does(self):
        assert_sampling_leaves_the_random_state_where_transformers_loop_does(build_model("rdn").cuda(), 20)

    @torch.no_grad()
    def test_returned_cache_is_exact_when_every_row_ends_inside_a_read(self):
        model = build_model("rdn").cuda()
        ids, eos = ending_prompt(model, 1, 6, [6])
        fast, slow = generate_both(model, ids, max_new_tokens=40, do_sample=False, eos_token_id=eos,
                                   pad_token_id=0, return_dict_in_generate=True)
        assert torch.equal(fast.sequences, slow.sequences)
        for a, b in zip(state_tensors(cache_of(fast)), state_tensors(cache_of(slow))):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def generation_module(reslin):
    """generation_reslin as the model files import it."""
    return sys.modules[reslin.modeling.DeviceDecoding.__module__]


@torch.no_grad()
def test_the_step_embeds_as_the_embedding_module_does(reslin):
    """The own loop's step indexes a plain nn.Embedding's weight, and calls any other embedding (a
    hooked one, PEFT's wrapper, one with max_norm) as the module: the same rows either way."""
    generation = generation_module(reslin)
    embedding = torch.nn.Embedding(50, 8)
    token = torch.randint(0, 50, (3, 1))
    assert torch.equal(generation.embed(embedding, token), embedding(token))
    calls = []
    embedding.register_forward_hook(lambda *args: calls.append(1))
    assert torch.equal(generation.embed(embedding, token), embedding.weight[token]) and len(calls) == 1
