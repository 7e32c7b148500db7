"""The step graph that generate's own loop keeps between a model's calls (generation_reslin.KeptStep).

A later call of the same settings replays the graph captured by an earlier one, on the kept states
and buffers, lent to its cache for the call. On a CPU the graph is stood in for by
`AddressCheckingGraph`, which replays the step eagerly after checking what a CUDA graph relies on:
every state and buffer the step touches is the tensor it was captured with. Tokens and returned
caches are compared with transformers' loop (`generate_fast_path=False`), as in
test_generation_loop. The GPU tests do the same through real CUDA graphs.
"""

import gc
import weakref

import pytest
import torch

from conftest import build_model
from test_cuda_graphs import state_tensors
from test_generate import cache_of
from test_generation_loop import assert_user_built_caches_continue_alike, generate_both, generation_module


def kept_addresses(reslin, model):
    module = generation_module(reslin)
    return {x.data_ptr() for x in module._state_tensors(module._KEPT_STEPS[model].states)}


def touched_tensors(steps):
    """What a replay of `steps`' step reads and writes besides the weights: the cache's states, the
    side-by-side weights, the step's buffers."""
    cache = steps.cache
    return (state_tensors(cache) + [weight for _, weight in cache.side_by_side.values()]
            + [x for x in steps.buffers() if x is not None])


class AddressCheckingGraph:
    captures = 0

    @classmethod
    def capture(cls, model, step, *inputs):
        graph = cls()
        output = step(*inputs)  # the warm-up (side-by-side weights are made here)
        graph.step, graph.steps = step, step.__self__
        graph.addresses = [x.data_ptr() for x in touched_tensors(graph.steps)]
        cls.captures += 1
        return output, graph

    def replay(self):
        assert [x.data_ptr() for x in touched_tensors(self.steps)] == self.addresses, \
            "a replay would read tensors other than those it was captured with"
        self.step()


@pytest.fixture
def captures(reslin, monkeypatch):
    """Generation on the CPU through AddressCheckingGraph; a callable giving the captures so far."""
    module = generation_module(reslin)
    monkeypatch.setattr(module, "ResLinDecodeGraph", AddressCheckingGraph)
    monkeypatch.setattr(module, "graph_can_run", lambda model, cache, device: True)
    monkeypatch.setattr(AddressCheckingGraph, "captures", 0)
    return lambda: AddressCheckingGraph.captures


def prompt(batch, length, seed):
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_a_later_call_replays_the_kept_graph_and_equals_transformers_loop(captures):
    model = build_model("rdn")
    for seed, new_tokens in enumerate((20, 33, 5)):  # fewer tokens than the first call's fit its buffers
        fast, slow = generate_both(model, prompt(2, 4 + seed, seed), max_new_tokens=new_tokens, do_sample=False)
        assert torch.equal(fast, slow)
    assert captures() == 1


@torch.no_grad()
def test_sampling_from_a_kept_graph_equals_transformers_loop(captures):
    model = build_model("gdn")
    settings = dict(do_sample=True, temperature=0.7, top_k=12, min_new_tokens=3, max_new_tokens=12)
    for seed in range(3):
        fast, slow = generate_both(model, prompt(3, 5, seed), seed=seed, **settings)
        assert torch.equal(fast, slow)
    assert captures() == 1
    # Another temperature is another graph.
    generate_both(model, prompt(3, 5, 0), **{**settings, "temperature": 0.9})
    assert captures() == 2


@torch.no_grad()
def test_the_returned_cache_keeps_its_own_states(captures, reslin):
    model = build_model("rla")
    ids, more = prompt(2, 5, 0), prompt(2, 5, 1)
    fast, slow = generate_both(model, ids, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(fast.sequences, slow.sequences)
    returned = cache_of(fast)
    assert not {x.data_ptr() for x in state_tensors(returned)} & kept_addresses(reslin, model)
    for a, b in zip(state_tensors(returned), state_tensors(cache_of(slow))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    before = [x.clone() for x in state_tensors(returned)]
    model.generate(more, max_new_tokens=20, do_sample=False)  # replays on the kept states
    assert captures() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, state_tensors(returned)))
    # A passed cache is continued exactly through the kept graph too.
    assert_user_built_caches_continue_alike(reslin, model, ids)
    assert captures() == 1


@torch.no_grad()
def test_weights_changed_in_place_or_replaced_are_captured_again(captures):
    model = build_model("gdn")
    ids = prompt(2, 6, 0)
    model.generate(ids, max_new_tokens=8, do_sample=False)
    model.model.layers[0].attn.q_proj.weight.mul_(0.5)  # as an optimiser step does
    fast, slow = generate_both(model, ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(fast, slow) and captures() == 2
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
    model.generate(ids, max_new_tokens=8, do_sample=False)
    assert captures() == 3


@torch.no_grad()
def test_other_batch_sizes_settings_and_release_capture_again(captures, reslin, monkeypatch):
    model = build_model("gdn")
    model.generate(prompt(2, 6, 0), max_new_tokens=8, do_sample=False)
    model.generate(prompt(3, 6, 0), max_new_tokens=8, do_sample=False)
    assert captures() == 2
    model.generate(prompt(3, 6, 1), max_new_tokens=8, do_sample=False, eos_token_id=[5, 7], pad_token_id=0)
    assert captures() == 3
    model.generate(prompt(3, 6, 1), max_new_tokens=2000, do_sample=False)  # past the buffers' tokens
    assert captures() == 4
    model.generate(prompt(3, 6, 1), max_new_tokens=8, do_sample=False)
    assert captures() == 4  # the longer call's buffers hold this one's tokens
    model.release_generation_graph()
    model.generate(prompt(3, 6, 1), max_new_tokens=8, do_sample=False)
    assert captures() == 5
    launch = generation_module(reslin).triton_launch
    if launch is not None:
        monkeypatch.setattr(launch, "PROGRAMMATIC_LAUNCH_MAX_ROWS", launch.PROGRAMMATIC_LAUNCH_MAX_ROWS + 1)
        model.generate(prompt(3, 6, 1), max_new_tokens=8, do_sample=False)
        assert captures() == 6


def test_a_model_made_under_inference_mode_keeps_its_graph(captures):
    """Its weights track no in-place modification (their place alone tells them apart); a call
    under inference_mode and one outside it keep a graph each (the kept states are written only
    where they were made)."""
    with torch.inference_mode():
        model = build_model("gdn")
        outputs = [model.generate(prompt(2, 5, seed), max_new_tokens=6, do_sample=False) for seed in (0, 1)]
    assert captures() == 1
    with torch.no_grad():
        assert torch.equal(model.generate(prompt(2, 5, 1), max_new_tokens=6, do_sample=False), outputs[1])
    assert captures() == 2


@torch.no_grad()
def test_the_kept_step_does_not_keep_its_model_alive(captures, reslin):
    model = build_model("gdn")
    model.generate(prompt(1, 4, 0), max_new_tokens=5, do_sample=False)
    kept = generation_module(reslin)._KEPT_STEPS
    assert model in kept
    dead = weakref.ref(model)
    del model
    gc.collect()
    assert dead() is None and len(kept) == 0


@torch.no_grad()
def test_a_call_that_fails_gives_the_cache_its_states_back(captures, reslin, monkeypatch):
    model = build_model("gdn")
    ids = prompt(2, 5, 0)
    model.generate(ids, max_new_tokens=8, do_sample=False)
    cache = reslin.ResLinCache(model.config, 2)

    def fail(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generation_module(reslin).DeviceDecoding, "decode", fail)
    with pytest.raises(KeyboardInterrupt):
        model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False)
    assert not generation_module(reslin)._KEPT_STEPS[model].in_use
    assert not {x.data_ptr() for x in state_tensors(cache)} & kept_addresses(reslin, model)


class TestOnGPU:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

    @pytest.mark.parametrize("mixer_name", ["gdn", "rkla"])
    @torch.no_grad()
    def test_later_calls_equal_transformers_loop(self, mixer_name, reslin):
        model = build_model(mixer_name, hidden_size=256, num_heads=2, head_dim=128, intermediate_size=512,
                            num_hidden_layers=3).to("cuda", torch.bfloat16)
        kept = generation_module(reslin)._KEPT_STEPS
        graphs = []
        for seed, settings in enumerate([dict(do_sample=False), dict(do_sample=False),
                                         dict(do_sample=True, top_k=20), dict(do_sample=True, top_k=20)]):
            fast, slow = generate_both(model, prompt(4, 30 + seed, seed).cuda(), seed=seed, max_new_tokens=40,
                                       **settings)
            assert torch.equal(fast, slow), settings
            graphs.append(kept[model].steps.graph)
        assert graphs[1] is graphs[0] and graphs[3] is graphs[2] and graphs[2] is not graphs[0]
        # Weights changed in place: the side-by-side copy the graph read is stale, so it captures again.
        model.model.layers[1].attn.k_proj.weight.mul_(0.5)
        fast, slow = generate_both(model, prompt(4, 30, 0).cuda(), max_new_tokens=40, do_sample=False)
        assert torch.equal(fast, slow)
        assert kept[model].steps.graph is not graphs[2]
