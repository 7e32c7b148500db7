"""benchmarks/mqar.py: the MQAR data, the accuracy's bookkeeping, and a --smoke run end to end."""

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("mqar", REPO_ROOT / "benchmarks" / "mqar.py")
mqar = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mqar)

VOCAB, PAIRS, LENGTH = 64, 6, 48


def make(num_examples=40, seq_len=LENGTH, seed=0):
    return mqar.make_mqar(num_examples, seq_len, PAIRS, VOCAB, torch.Generator().manual_seed(seed))


def test_each_query_is_a_key_of_its_sequence_and_its_answer_that_keys_value():
    inputs, query_positions, answers = make()
    keys, values = inputs[:, 0:2 * PAIRS:2], inputs[:, 1:2 * PAIRS:2]
    for row in range(len(inputs)):
        value_of = dict(zip(keys[row].tolist(), values[row].tolist()))
        assert len(value_of) == PAIRS and len(set(values[row].tolist())) == PAIRS  # distinct keys and values
        asked = inputs[row, query_positions[row]].tolist()
        assert sorted(asked) == sorted(value_of)  # every key asked exactly once
        assert answers[row].tolist() == [value_of[key] for key in asked]


def test_keys_and_values_come_from_disjoint_halves_of_the_vocabulary():
    inputs, _, answers = make()
    keys, values = inputs[:, 0:2 * PAIRS:2], inputs[:, 1:2 * PAIRS:2]
    assert keys.min() >= 1 and keys.max() < VOCAB // 2
    assert values.min() >= VOCAB // 2 and values.max() < VOCAB
    assert torch.equal(answers.sort(-1).values, values.sort(-1).values)


def test_query_positions_are_distinct_even_offsets_after_the_pairs_with_early_ones_likelier():
    _, query_positions, _ = make(num_examples=400, seq_len=512)
    offsets = query_positions - 2 * PAIRS
    assert offsets.min() >= 0 and query_positions.max() < 512 and (offsets % 2 == 0).all()
    assert all(len(set(row.tolist())) == PAIRS for row in query_positions)
    # Zoology's power law: the median query comes far sooner than under uniform gaps (~half the room).
    assert offsets.float().median() < 0.25 * (512 - 2 * PAIRS)


def test_data_is_fixed_by_the_seed():
    assert all(torch.equal(a, b) for a, b in zip(make(seed=3), make(seed=3)))
    assert not torch.equal(make(seed=3)[0], make(seed=4)[0])


def test_eval_sets_scale_the_length_and_keep_the_pairs():
    task = dict(mqar.SMOKE_TASK, train_length=LENGTH, kv_pairs=PAIRS, eval_examples=5)
    eval_sets = mqar.make_eval_sets(task, VOCAB, torch.Generator().manual_seed(0))
    assert sorted(eval_sets) == [1, 2, 4, 8]
    for factor, (inputs, query_positions, answers) in eval_sets.items():
        assert inputs.shape == (5, factor * LENGTH)
        assert query_positions.shape == answers.shape == (5, PAIRS)
        assert query_positions.max() < factor * LENGTH


def test_too_short_a_sequence_for_its_pairs_is_refused():
    with pytest.raises(ValueError, match="need length"):
        mqar.make_mqar(2, 4 * PAIRS - 2, PAIRS, VOCAB, torch.Generator())


class TableModel(torch.nn.Module):
    """Stands in for a ResLinForCausalLM: at (row, position) it predicts predictions[row, position]
    (its logits are that token's one-hot), whichever batches the rows come in."""

    def __init__(self, inputs, predictions):
        super().__init__()
        self.inputs, self.predictions = inputs, predictions
        self.lm_head = torch.nn.Identity()

    def model(self, input_ids, use_cache):
        rows = (input_ids[:, None] == self.inputs[None]).all(-1).int().argmax(1)
        return SimpleNamespace(last_hidden_state=F.one_hot(self.predictions[rows], VOCAB).float())


def test_accuracy_reads_only_the_answer_positions(monkeypatch):
    inputs, query_positions, answers = make(num_examples=10)
    monkeypatch.setattr(mqar, "EVAL_TOKENS_PER_BATCH", 3 * LENGTH)  # several batches, the last one short

    def predicting(at_positions, rows=slice(None)):
        predictions = torch.zeros_like(inputs)  # token 0 is never an answer
        predictions[rows].scatter_(1, at_positions[rows], answers[rows])
        return TableModel(inputs, predictions)

    assert mqar.accuracy(predicting(query_positions), inputs, query_positions, answers) == 1.0
    # Right one position later (where a next-token shift would look) is wrong.
    assert mqar.accuracy(predicting(query_positions + 1), inputs, query_positions, answers) == 0.0
    assert mqar.accuracy(predicting(query_positions, rows=slice(0, 5)), inputs, query_positions, answers) == 0.5


def test_smoke_run_trains_every_type_and_lr_and_writes_its_json(tmp_path):
    out = tmp_path / "mqar.json"
    mqar.main(["--smoke", "--attn-types", "gdn", "rkla", "--lr", "1e-3", "3e-3", "--steps", "4",
               "--kernel-backend", "torch", "--out", str(out)])
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["attn_type"], r["lr"]) for r in runs] == [("gdn", 1e-3), ("gdn", 3e-3), ("rkla", 1e-3), ("rkla", 3e-3)]
    assert result["eval_lengths"] == {"1x": 32, "2x": 64, "4x": 128, "8x": 256}
    for r in runs:
        assert sorted(r["accuracy"]) == ["1x", "2x", "4x", "8x"]
        assert all(0 <= a <= 1 for a in r["accuracy"].values()) and r["final_loss"] > 0
    for attn_type, index in result["best"].items():
        assert runs[index]["accuracy"]["1x"] == max(r["accuracy"]["1x"] for r in runs if r["attn_type"] == attn_type)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attn_type", ["gdn", "kla", "rdn", "rkla"])
def test_paper_model_step_through_triton_matches_the_torch_backend_on_cuda(attn_type):
    """The paper's model runs the chunked Triton kernels at head sizes 48 / 96, which the kernel
    tests do not cover: one bf16-autocast training step (loss, every gradient) and the evaluation
    forward at 8x through "auto" (Triton) against the torch backend, same weights, same batch. The
    bounds are loose for bf16 on purpose: the failures seen on the H200 at untested head sizes
    (wrong values, illegal addresses) were errors of order one."""
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    train_batch = mqar.make_mqar(32, 256, 32, 8192, generator)
    eval_batch = mqar.make_mqar(4, 2048, 32, 8192, generator)
    results = {}
    for backend in ("torch", "auto"):
        model = mqar.build_model(attn_type, mqar.PAPER_MODEL, backend, seed=0, device=device)
        with mqar.autocast(device):
            logits = mqar.answer_logits(model, *train_batch[:2])
        loss = F.cross_entropy(logits.float().flatten(0, 1), train_batch[2].flatten())
        loss.backward()
        with torch.no_grad(), mqar.autocast(device):
            eval_logits = mqar.answer_logits(model.eval(), *eval_batch[:2]).float()
        results[backend] = loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]), eval_logits

    def rel_err(got, ref):
        return ((got - ref).norm() / ref.norm()).item()

    (loss, grads, eval_logits), (ref_loss, ref_grads, ref_eval_logits) = results["auto"], results["torch"]
    assert abs(loss - ref_loss) < 1e-2 * ref_loss
    assert rel_err(grads, ref_grads) < 5e-2
    assert rel_err(eval_logits, ref_eval_logits) < 5e-2


def test_compiled_training_gives_the_eager_run(tmp_path):
    """--compile: the training forward through torch.compile (inductor, one graph, no break)
    trains as the eager run does. Inductor's fused fp32 arithmetic rounds differently: after 4
    AdamW steps the losses differed by 2.4e-5 (relative) when measured; bound 2e-4."""
    results = {}
    for compile_flags in ([], ["--compile"]):
        out = tmp_path / f"mqar{len(compile_flags)}.json"
        mqar.main(["--smoke", "--attn-types", "rdn", "--steps", "4", "--kernel-backend", "torch", "--out", str(out),
                   *compile_flags])
        results[bool(compile_flags)] = json.loads(out.read_text())["runs"][0]
    assert results[True]["compile"] == "inductor" and results[False]["compile"] is None
    assert results[True]["final_loss"] == pytest.approx(results[False]["final_loss"], rel=2e-4)
    assert results[True]["accuracy"] == results[False]["accuracy"]
