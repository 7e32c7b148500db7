"""Generation steps replayed from CUDA graphs (modeling_reslin.ResLinDecodeGraph), and what they
rely on: cache states advanced in place at fixed addresses, and a decode path that never reads
tensor values on the host (a device sync at every token).

The CPU tests run everywhere; the tests of `TestOnGPU` run with `pytest -m gpu` on a machine with
CUDA and compare the graph path with the eager one (`decode_cuda_graphs=False`) on the same model:
tokens exactly, logits within 1e-5 in fp32.
"""

import pytest
import torch

from conftest import build_config, build_model, left_pad
from test_generate import cache_of


def state_tensors(cache):
    """Every conv and recurrent state tensor of a cache's linear attention layers."""
    return [x for layer in cache.conv_states + cache.recurrent_states if layer is not None
            for x in layer if x is not None]


def addresses(cache):
    return [x.data_ptr() for x in state_tensors(cache)]


# --- CPU ----------------------------------------------------------------------------------------

def test_switch_defaults_on_and_is_validated(reslin):
    assert build_config().decode_cuda_graphs is True
    assert build_config(decode_cuda_graphs=False).decode_cuda_graphs is False
    with pytest.raises(ValueError, match="decode_cuda_graphs"):
        build_config(decode_cuda_graphs="no")
    config = build_config()
    config.decode_cuda_graphs = None  # what from_pretrained(..., decode_cuda_graphs=None) does
    with pytest.raises(ValueError, match="decode_cuda_graphs"):
        reslin.ResLinForCausalLM(config)


@pytest.mark.parametrize("mixer_name", ["rdn", "gdn", "hybrid"])
@torch.no_grad()
def test_states_stay_in_place_through_steps_continuation_and_reorder(mixer_name):
    model = build_model(mixer_name)
    ids = torch.randint(1, 100, (3, 12))
    cache = cache_of(model(ids[:, :5], use_cache=True))
    held = addresses(cache)
    for start, end in ((5, 6), (6, 9), (9, 10)):  # a decode step, a continued prompt, a decode step
        before = [x.clone() for x in state_tensors(cache)]
        model(ids[:, start:end], cache=cache)
        assert addresses(cache) == held
        assert all(not torch.equal(x, y) for x, y in zip(state_tensors(cache), before))
    order = torch.tensor([2, 0, 0])
    expected = [x[order] for x in state_tensors(cache)]
    cache.reorder_cache(order)
    assert addresses(cache) == held
    for x, y in zip(state_tensors(cache), expected):
        assert torch.equal(x, y)
    nxt = torch.randint(1, 100, (3, 1))
    torch.testing.assert_close(model(nxt, cache=cache).logits,
                               model(torch.cat([ids[order, :10], nxt], dim=1)).logits[:, -1:], rtol=0, atol=1e-5)


@torch.no_grad()
def test_conv_states_do_not_keep_the_prompt_alive():
    """A convolution's new state is the window at the end of its whole input: the cache keeps a
    compact copy, not a view that would hold every layer's [B, D, T] input."""
    model = build_model("rdn")
    cache = cache_of(model(torch.randint(1, 100, (2, 40)), use_cache=True))
    for x in cache.conv_states[0]:
        assert x.is_contiguous() and x.untyped_storage().nbytes() == x.numel() * x.element_size()


def test_states_are_replaced_under_autograd_and_the_graph_dropped():
    """Under autograd an earlier step's backward may still need the old states: the cache replaces
    them, and drops a decode graph, which would write to the old tensors."""
    model = build_model("rdn")
    ids = torch.randint(1, 100, (2, 6))
    with torch.no_grad():
        cache = cache_of(model(ids[:, :5], use_cache=True))
    held = list(state_tensors(cache))  # kept alive, so that no new state can reuse their memory
    cache.decode_graph = object()  # stands for a captured graph
    model(ids[:, 5:], cache=cache).logits.sum().backward()
    assert cache.decode_graph is None
    assert not set(addresses(cache)) & {x.data_ptr() for x in held}


def test_reorder_needs_one_source_row_per_row():
    model = build_model("rdn")
    cache = cache_of(model(torch.randint(1, 100, (3, 4)), use_cache=True))
    with pytest.raises(ValueError, match="3 rows"):
        cache.reorder_cache(torch.tensor([0, 1]))


@pytest.mark.parametrize("mixer_name", ["rdn", "hybrid_window"])
@torch.no_grad()
def test_decode_steps_read_no_tensor_values_on_the_host(mixer_name, monkeypatch):
    """A decode step must not sync the device: no host read of a tensor's values anywhere in it
    (a prompt's checks do read them)."""
    model = build_model(mixer_name)
    ids, mask = left_pad([torch.randint(1, 100, (n,)) for n in (5, 2)])
    cache = cache_of(model(ids, attention_mask=mask, use_cache=True))

    def host_read(*args, **kwargs):
        raise AssertionError("a decode step read tensor values on the host")

    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, name, host_read)
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            model(torch.randint(1, 100, (2, 1)), attention_mask=mask, cache=cache)
        with pytest.raises(AssertionError, match="host"):
            model(torch.randint(1, 100, (2, 3)))  # a prompt: its checks read values


@torch.no_grad()
def test_decode_steps_still_reject_bad_inputs():
    model = build_model("rdn")
    ids = torch.randint(1, 100, (2, 5))
    cache = cache_of(model(ids, use_cache=True))
    with pytest.raises(ValueError, match=r"\[2, 6\]"):  # the mask's shape is checked at every step
        model(ids[:, :1], cache=cache, attention_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch of 2"):
        model(ids[:1, :1], cache=cache)
    with pytest.raises(IndexError):  # not checked ahead (a sync): the embedding lookup refuses it
        model(torch.tensor([[1], [100]]), cache=cache)
    with pytest.raises(ValueError, match="vocab_size=100"):  # a prompt continuing the cache is checked
        model(torch.tensor([[1, 2], [3, 100]]), cache=cache)


@torch.no_grad()
def test_decode_steps_treat_the_new_token_as_real():
    """Linear layers take no mask in a decode step (generate extends the mask with ones): a step
    gives the same logits whatever its mask column says, while a prompt's padding still counts."""
    model = build_model("gdn")
    ids, mask = left_pad([torch.randint(1, 100, (n,)) for n in (5, 2)])
    logits = []
    for last in (1, 0):
        cache = cache_of(model(ids, attention_mask=mask, use_cache=True))
        step_mask = torch.cat([mask, torch.full((2, 1), last)], dim=1)
        logits.append(model(torch.randint(1, 100, (2, 1), generator=torch.Generator().manual_seed(0)),
                            attention_mask=step_mask, cache=cache).logits)
    assert torch.equal(logits[0], logits[1])


# --- GPU ----------------------------------------------------------------------------------------

def cuda_model(mixer_name, **overrides):
    return build_model(mixer_name, **overrides).cuda()


def generate_both_ways(model, *args, **kwargs):
    """generate with decode graphs, then eagerly, each from the same seed: (graph output, eager output)."""
    outputs = []
    for graphs in (True, False):
        model.config.decode_cuda_graphs = graphs
        torch.manual_seed(11)
        outputs.append(model.generate(*args, return_dict_in_generate=True, output_logits=True, **kwargs))
    model.config.decode_cuda_graphs = True
    assert cache_of(outputs[0]).decode_graph is not None, "the graph path did not run"
    assert cache_of(outputs[1]).decode_graph is None
    return outputs


def assert_same_generation(graph, eager):
    assert torch.equal(graph.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(graph.logits), torch.stack(eager.logits), rtol=0, atol=1e-5)


class TestOnGPU:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

    @pytest.mark.parametrize("mixer_name", ["rdn", "rkla", "gdn", "sgla"])
    @torch.no_grad()
    def test_greedy_left_padded_batch_matches_eager(self, mixer_name):
        model = cuda_model(mixer_name)
        ids, mask = left_pad([torch.randint(3, 100, (n,)) for n in (9, 4, 13)])
        graph, eager = generate_both_ways(model, ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12,
                                          do_sample=False)
        assert_same_generation(graph, eager)

    @pytest.mark.parametrize("mixer_name,backend", [("rdn", "auto"), ("kla", "auto"), ("rla", "auto"),
                                                    ("rdn_grouped_v", "auto"), ("rdn", "torch")])
    @torch.no_grad()
    def test_manual_steps_match_eager_logits(self, mixer_name, backend):
        model = cuda_model(mixer_name, kernel_backend=backend)
        ids = torch.randint(3, 100, (2, 16), device="cuda")
        logits = {}
        for graphs in (True, False):
            model.config.decode_cuda_graphs = graphs
            cache = cache_of(model(ids[:, :6], use_cache=True))
            steps = []
            for t in range(6, 16):
                steps.append(model(ids[:, t:t + 1], cache=cache).logits)
                if graphs:
                    if t == 6:
                        graph = cache.decode_graph
                    assert cache.decode_graph is graph is not None  # captured once, then replayed
            logits[graphs] = torch.cat(steps, dim=1)
        model.config.decode_cuda_graphs = True
        # (Each step's logits are the caller's to keep: were they the graph's output buffer, the
        # next replay would overwrite them, and every step would read as the last.)
        torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-5)

    @torch.no_grad()
    def test_beam_search_matches_eager(self):
        model = cuda_model("rdn")
        ids = torch.randint(3, 100, (2, 7), device="cuda")
        graph, eager = generate_both_ways(model, ids, max_new_tokens=10, num_beams=3, num_return_sequences=3,
                                          do_sample=False, output_scores=True)
        assert_same_generation(graph, eager)
        torch.testing.assert_close(graph.sequences_scores, eager.sequences_scores, rtol=0, atol=1e-5)

    @torch.no_grad()
    def test_sampling_with_a_seed_matches_eager(self):
        model = cuda_model("rkla")
        ids, mask = left_pad([torch.randint(3, 100, (n,)) for n in (6, 3)])
        graph, eager = generate_both_ways(model, ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16,
                                          do_sample=True, top_k=0, temperature=1.5)
        assert_same_generation(graph, eager)

    @torch.no_grad()
    def test_bf16_matches_eager(self):
        model = cuda_model("gdn").bfloat16()
        ids = torch.randint(3, 100, (3, 8), device="cuda")
        graph, eager = generate_both_ways(model, ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(graph.sequences, eager.sequences)

    @torch.no_grad()
    def test_second_generate_with_another_batch_size(self):
        model = cuda_model("gdn")
        for batch in (3, 1, 5):
            ids = torch.randint(3, 100, (batch, 6), device="cuda")
            graph, eager = generate_both_ways(model, ids, max_new_tokens=8, do_sample=False)
            assert_same_generation(graph, eager)

    @torch.no_grad()
    @pytest.mark.parametrize("fast_path", [False, True])
    def test_continuing_a_returned_cache_reuses_its_graph(self, fast_path):
        """transformers' loop keeps its step's graph on the cache, and a continuation replays it;
        generate's own loop captures its graph for each call: both continue as a fresh call does."""
        model = cuda_model("rdn", generate_fast_path=fast_path)
        ids = torch.randint(3, 100, (2, 5), device="cuda")
        first = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        cache = cache_of(first)
        graph = cache.decode_graph
        assert (graph is None) == fast_path
        extended = torch.cat([first.sequences, torch.randint(3, 100, (2, 3), device="cuda")], dim=1)
        continued = model.generate(extended, max_new_tokens=6, do_sample=False, cache=cache)
        assert cache.decode_graph is graph  # the continued prompt was copied into the same states
        model.config.decode_cuda_graphs = False
        fresh = model.generate(extended, max_new_tokens=6, do_sample=False)
        model.config.decode_cuda_graphs = True
        assert torch.equal(continued, fresh)

    @torch.no_grad()
    def test_a_cache_stepped_by_another_model_captures_for_it(self):
        """A graph replays its own model's weights: another model stepping the cache captures its own."""
        first, second = cuda_model("gdn", seed=0), cuda_model("gdn", seed=1)
        ids = torch.randint(3, 100, (2, 6), device="cuda")
        logits = {}
        for graphs in (True, False):
            first.config.decode_cuda_graphs = second.config.decode_cuda_graphs = graphs
            cache = cache_of(first(ids[:, :3], use_cache=True))
            logits[graphs] = [model(ids[:, t:t + 1], cache=cache).logits
                              for model, t in ((first, 3), (second, 4), (second, 5))]
        for got, expected in zip(logits[True], logits[False]):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    @torch.no_grad()
    def test_switched_off_runs_eagerly(self):
        model = cuda_model("rdn", decode_cuda_graphs=False)
        out = model.generate(torch.randint(3, 100, (2, 5), device="cuda"), max_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True)
        assert cache_of(out).decode_graph is None

    @torch.no_grad()
    def test_hybrid_model_generates_eagerly(self):
        model = cuda_model("hybrid_window")
        rows = [torch.randint(3, 100, (n,)) for n in (7, 3)]
        ids, mask = left_pad(rows)
        out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=6, do_sample=False,
                             return_dict_in_generate=True)
        assert cache_of(out).decode_graph is None
        for i, row in enumerate(rows):
            alone = model.generate(row[None].cuda(), max_new_tokens=6, do_sample=False)
            assert torch.equal(out.sequences[i, -6:], alone[0, -6:])

    @pytest.mark.parametrize("mixer_name,graphs", [("rdn", True), ("rdn", False), ("hybrid", False)])
    @torch.no_grad()
    def test_decode_steps_do_not_sync(self, mixer_name, graphs):
        model = cuda_model(mixer_name, decode_cuda_graphs=graphs)
        ids, mask = left_pad([torch.randint(3, 100, (n,)) for n in (6, 2)])
        ids, mask = ids.cuda(), mask.cuda()
        cache = cache_of(model(ids, attention_mask=mask, use_cache=True))
        nxt = torch.randint(3, 100, (2, 1), device="cuda")
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        model(nxt, attention_mask=mask, cache=cache)  # the first step captures (and compiles): not timed
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                model(nxt, attention_mask=mask, cache=cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
