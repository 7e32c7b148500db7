"""ResLinBlock.fused_decode_step (five launches a block at a generation step) against the block's
unfused forward: the same hidden states and cache states, step after step.

On a CPU the fused kernels run in Triton's interpreter in fp32 and are called directly (the model
takes the fused step on CUDA only): hidden states within 1e-4, states within 1e-5. On the GPU
(`pytest -m gpu`) the model's own switch compares the two paths in bf16 at the 400M block shape:
each no further from the fp32 step than the unfused one (the last hidden state and the states'
change, normwise), greedy tokens equal (with K split in the products too); and programmatic
dependent launch (kernels_reslin_triton_launch.PROGRAMMATIC_LAUNCH_MAX_ROWS) changes no bit.
"""

import copy
import importlib
import sys

import pytest
import torch

from conftest import MIXERS, build_model
from test_cuda_graphs import state_tensors
from test_generate import cache_of
from test_kernels import rel_err

LINEAR_MIXERS = [name for name, fields in MIXERS.items() if "layer_types" not in fields]


def split_gemv(reslin_or_modeling):
    """The kernels_reslin_triton_gemv module whose products a modeling module (or the `reslin`
    fixture's) calls: where SPLIT_K_MAX_ROWS is set for its model."""
    modeling = getattr(reslin_or_modeling, "modeling", reslin_or_modeling)
    return sys.modules[modeling.rms_norm_linear.__module__]


def fused_step(model, token, cache):
    """A generation step with every block's fused_decode_step called directly; the last hidden state."""
    base = model.model
    hidden_states = base.embed_tokens(token)
    for block in base.layers:
        hidden_states = block.fused_decode_step(hidden_states, cache)
    cache.advance(1)
    return base.norm(hidden_states)


@pytest.mark.parametrize("split", [False, True], ids=["whole K", "split K"])
@pytest.mark.parametrize("mixer_name", LINEAR_MIXERS)
@torch.no_grad()
def test_fused_step_equals_the_unfused_forward(mixer_name, split, monkeypatch):
    """Three rows: the products' tl.dot path, with K split among as many programs as it has
    chunks where `split` (the cache's split counters left at zero after each step)."""
    model = build_model(mixer_name)
    if split:
        gemv = split_gemv(sys.modules[type(model).__module__])
        monkeypatch.setattr(gemv, "SPLIT_K_MAX_ROWS", 16)
        monkeypatch.setattr(gemv, "SPLIT_K_MAX_TILES", 2**20)
        monkeypatch.setattr(gemv, "PROGRAMS_TO_FILL", 2**20)
        monkeypatch.setattr(gemv, "DOT_BLOCK_K", 16)
    ids = torch.randint(3, 100, (3, 9))
    unfused = cache_of(model(ids[:, :6], use_cache=True))
    fused = copy.deepcopy(unfused)
    for t in range(6, 9):
        token = ids[:, t:t + 1]
        expected = model.model(token, cache=unfused).last_hidden_state
        torch.testing.assert_close(fused_step(model, token, fused), expected, rtol=1e-4, atol=1e-4)
        assert list(fused.split_counters_by_device) == [torch.device("cpu")] and not fused.split_counters("cpu").any()
        for a, b in zip(state_tensors(fused), state_tensors(unfused)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_fused_step_is_not_taken_where_it_cannot_apply(reslin):
    model = build_model("rdn")
    block = model.model.layers[0]
    cache = cache_of(model(torch.randint(3, 100, (2, 4)), use_cache=True))
    x = torch.zeros(2, 1, model.config.hidden_size)
    with torch.no_grad():
        assert not block.takes_fused_decode_step(x, cache)  # on a CPU
    assert not block.takes_fused_decode_step(x, None)


def in_fp32(cache):
    """A copy of a cache with its states in fp32, for an fp32 model to step from the same point."""
    cache = copy.deepcopy(cache)
    for states in (cache.conv_states, cache.recurrent_states):
        for layer, held in enumerate(states):
            if held is not None:
                states[layer] = tuple(None if x is None else x.float() for x in held)
    cache.side_by_side, cache.decode_graph = {}, None
    return cache


class TestOnGPU:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

    @pytest.mark.parametrize("split", [False, True], ids=["whole K", "split K"])
    @pytest.mark.parametrize("mixer_name", ["gdn", "kla", "rla", "rdn", "rkla", "sgla"])
    @pytest.mark.parametrize("batch", [1, 16])
    @torch.no_grad()
    def test_fused_step_is_as_close_to_fp32_as_the_unfused_one(self, reslin, mixer_name, batch, split, monkeypatch):
        """One step in bf16 from the same cache, fused and unfused, against the unfused step of the
        model in fp32 from that cache: the two bf16 paths round in different places (the fused one
        keeps more in fp32), so neither equals the other, and the measure is their distance to
        fp32. The fused step's normwise error, of the last hidden state and of each state's change
        in the step, at most 1.25x the unfused step's + 1e-3, and at most 2e-2. `split`: the
        products split K where gemv_launch would (up to 16 rows)."""
        monkeypatch.setattr(split_gemv(reslin), "SPLIT_K_MAX_ROWS", 16 if split else 0)
        model = build_model(mixer_name, hidden_size=1024, num_heads=8, head_dim=128, intermediate_size=2816,
                            num_hidden_layers=2, decode_cuda_graphs=False).to("cuda", torch.bfloat16)
        ids = torch.randint(3, 100, (batch, 33), device="cuda")
        prompt = cache_of(model(ids[:, :32], use_cache=True))
        start = [x.float() for x in state_tensors(prompt)]
        results = {}
        for name, fused, stepping, cache in (("fused", True, model, copy.deepcopy(prompt)),
                                             ("unfused", False, model, copy.deepcopy(prompt)),
                                             ("fp32", False, copy.deepcopy(model).float(), in_fp32(prompt))):
            monkeypatch.setattr(reslin.modeling, "FUSED_DECODE_STEP", fused)
            step_input = stepping.model.embed_tokens(ids[:, 32:])
            assert stepping.model.layers[0].takes_fused_decode_step(step_input, cache) == fused
            hidden = stepping.model(ids[:, 32:], cache=cache).last_hidden_state.float()
            results[name] = [hidden] + [x.float() - x0 for x, x0 in zip(state_tensors(cache), start)]
        for index, (fused, unfused, reference) in enumerate(zip(results["fused"], results["unfused"], results["fp32"])):
            fused_error, unfused_error = rel_err(fused, reference), rel_err(unfused, reference)
            what = "the hidden state" if index == 0 else f"state tensor {index - 1}'s change"
            assert fused_error <= min(1.25 * unfused_error + 1e-3, 2e-2), (
                f"{what}: fused {fused_error:.2e}, unfused {unfused_error:.2e} from fp32")

    @pytest.mark.parametrize("split", [False, True], ids=["whole K", "split K"])
    @torch.no_grad()
    def test_greedy_tokens_equal_the_unfused_step(self, reslin, split, monkeypatch):
        monkeypatch.setattr(split_gemv(reslin), "SPLIT_K_MAX_ROWS", 16 if split else 0)
        model = build_model("rdn", hidden_size=512, num_heads=4, head_dim=128, intermediate_size=1024,
                            num_hidden_layers=4).to("cuda", torch.bfloat16)
        ids = torch.randint(3, 100, (4, 64), device="cuda")
        outputs = []
        for fused in (True, False):
            monkeypatch.setattr(reslin.modeling, "FUSED_DECODE_STEP", fused)
            outputs.append(model.generate(ids, max_new_tokens=48, do_sample=False))
        assert torch.equal(*outputs)

    @pytest.mark.parametrize("mixer_name", ["gdn", "rdn", "kla"])
    @pytest.mark.parametrize("batch", [1, 16])
    @torch.no_grad()
    def test_programmatic_launch_changes_no_bit(self, reslin, mixer_name, batch, monkeypatch):
        """PDL changes when the step's kernels start, not what they compute: the same tokens and
        states, bit for bit, through generate's own loop (CUDA graphs) and transformers' (eager).
        At batch 1 the GEMVs load weights before their wait; at 16 they wait first (tl.dot)."""
        if torch.cuda.get_device_capability()[0] < 9:
            pytest.skip("programmatic dependent launch needs sm_90 or later")
        launch = importlib.import_module("reslin_repo.kernels_reslin_triton_launch")
        model = build_model(mixer_name, hidden_size=1024, num_heads=8, head_dim=128, intermediate_size=2816,
                            num_hidden_layers=4).to("cuda", torch.bfloat16)
        ids = torch.randint(3, 100, (batch, 64), device="cuda")
        for fast_path in (True, False):
            model.config.generate_fast_path = fast_path
            outputs = {}
            for pdl in (False, True):
                monkeypatch.setattr(launch, "PROGRAMMATIC_LAUNCH_MAX_ROWS", batch if pdl else 0)
                assert launch.programmatic_launch(ids)["PDL"] == pdl
                outputs[pdl] = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                              return_dict_in_generate=True)
            assert torch.equal(outputs[True].sequences, outputs[False].sequences)
            for a, b in zip(state_tensors(cache_of(outputs[True])), state_tensors(cache_of(outputs[False]))):
                assert torch.equal(a, b)
