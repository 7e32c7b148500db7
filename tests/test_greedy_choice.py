"""kernels_reslin_triton_choice.greedy_choice (generate's own loop on CUDA, greedy) against the torch
code of generation_reslin._Steps.choose, on the same logits, step after step: every buffer equal
exactly. In fp32 and fp16, with ties, NaNs, rows of -inf, rows that end, two minimum lengths over
different end-of-sequence ids, and a vocabulary cut into parts of 16 columns whose last part is
part empty: in Triton's interpreter on a CPU, compiled on a GPU (`pytest -m gpu`; test_generation_loop
runs it in bf16 through generate).
"""

import sys

import pytest
import torch

from conftest import build_model

choice = pytest.importorskip("kernels_reslin_triton_choice", reason="needs the triton package")
generation = pytest.importorskip("generation_reslin")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.gpu] if DEVICE.type == "cuda" else []
V = 100  # the tiny model's vocabulary
BUFFERS = ("sequences", "any_unfinished", "unfinished", "token", "position")


def steps_pair(eos, minimum_lengths, batch, new_tokens):
    """Two _Steps of one decoding, the second choosing through greedy_choice."""
    model = build_model("gdn").to(DEVICE)
    decoding = generation.DeviceDecoding(
        do_sample=False, processors=[(length, torch.tensor(ids)) for length, ids in minimum_lengths],
        max_length=10 + new_tokens, eos_token_id=None if eos is None else torch.tensor(eos),
        pad_token_id=None if eos is None else torch.tensor(0))
    cache = sys.modules[type(model).__module__].ResLinCache(model.config, batch)  # no states: no graph
    torch_steps, fused_steps = (generation._Steps(decoding, model, cache, batch, 10, new_tokens, DEVICE)
                                for _ in range(2))
    assert fused_steps.fused_choice == (DEVICE.type == "cuda")  # a CPU's loop keeps the torch code: forced here
    torch_steps.fused_choice, fused_steps.fused_choice = False, True
    return torch_steps, fused_steps


def awkward_logits(generator, batch, dtype, step):
    logits = torch.randn(batch, V, generator=generator).round(decimals=1)  # ties between columns
    logits[0, 40] = logits[0, 70] = logits[0].max() + 1  # a tie for the largest: the first wins
    if step == 1:
        logits[1, [5, 9]] = float("nan")  # the first NaN wins, as torch.argmax takes it
    if step == 2:
        logits[-1] = float("-inf")  # every column -inf: column 0
    if step >= 3:
        logits[:, 2] = 50.0  # end-of-sequence id 2 is the largest from here on
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("eos,minimum_lengths", [
    (None, []),
    ([2, 7], []),
    ([2, 7], [(14, [2, 7]), (12, [3])]),  # a minimum length of 4 new tokens over 2 and 7, of 2 over 3
])
def test_greedy_choice_writes_what_the_torch_code_writes(eos, minimum_lengths, dtype, monkeypatch):
    monkeypatch.setattr(choice, "PART_COLUMNS", 16)
    batch, new_tokens = 3, 7
    torch_steps, fused_steps = steps_pair(eos, minimum_lengths, batch, new_tokens)
    generator = torch.Generator().manual_seed(0)
    for step in range(new_tokens):
        logits = awkward_logits(generator, batch, dtype, step).to(DEVICE)
        torch_steps.choose(logits)
        fused_steps.choose(logits)
        for name in BUFFERS:
            assert torch.equal(getattr(fused_steps, name), getattr(torch_steps, name)), (step, name)
    if eos is not None:
        assert not torch_steps.unfinished.any()  # the rows did end: the padding id was written after


def test_greedy_choice_refuses_more_rows_than_one_program_holds(monkeypatch):
    monkeypatch.setattr(choice, "MAX_ROWS", 2)
    long = dict(dtype=torch.long, device=DEVICE)
    position = torch.zeros(1, **long)
    with pytest.raises(ValueError, match="at most 2 rows"):
        choice.greedy_choice(torch.zeros(3, V, device=DEVICE), position[:0], position[:0], None, None,
                             torch.ones(3, dtype=torch.bool, device=DEVICE), torch.zeros(3, 4, **long),
                             torch.zeros(4, dtype=torch.bool, device=DEVICE), torch.zeros(3, 1, **long), position)
