"""benchmarks/mqar.py: both protocols' data against their definitions, the accuracy's bookkeeping,
kla-authors' early stopping and best checkpoint, and --smoke runs end to end."""

import importlib.util
import io
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("mqar", REPO_ROOT / "benchmarks" / "mqar.py")
mqar = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mqar)

VOCAB, PAIRS, LENGTH = 64, 6, 48
CPU = torch.device("cpu")


def make(num_examples=40, seq_len=LENGTH, seed=0):
    return mqar.make_mqar(num_examples, seq_len, PAIRS, VOCAB, torch.Generator().manual_seed(seed))


def make_kla(num_examples=40, seq_len=LENGTH, seed=0, kv_pairs=PAIRS, vocab_size=VOCAB):
    return mqar.make_kla_authors_mqar(num_examples, seq_len, kv_pairs, vocab_size, torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# kla-authors: the generator against its definition


def test_kla_authors_pairs_open_the_sequence_keys_and_values_from_the_two_halves():
    inputs, _, _ = make_kla(num_examples=500)
    keys, values = inputs[:, 0:2 * PAIRS:2], inputs[:, 1:2 * PAIRS:2]
    assert keys.min() == 0 and keys.max() == VOCAB // 2 - 1  # [0, V/2): token 0 is a key too
    assert values.min() == VOCAB // 2 and values.max() == VOCAB - 1
    # The filler covers the whole vocabulary, both halves.
    filler = inputs[:, 2 * PAIRS:]
    assert filler.min() == 0 and filler.max() == VOCAB - 1


def repeat_probability(draws, choices):
    """P(some token drawn twice) for `draws` uniform draws with replacement from `choices` tokens."""
    return 1 - math.prod(1 - i / choices for i in range(draws))


def test_kla_authors_keys_and_values_are_drawn_with_replacement_at_the_expected_rate():
    # The paper's sizes: 32 draws from 4096 tokens repeat one with probability 0.1143. Over 3000
    # sequences the observed share has a standard deviation of 0.0058: bound 4 of them, 0.023.
    sequences, pairs, vocab_size = 3000, 32, 8192
    inputs, _, _ = make_kla(num_examples=sequences, seq_len=2 * pairs + 16, kv_pairs=pairs, vocab_size=vocab_size)
    expected = repeat_probability(pairs, vocab_size // 2)
    assert expected == pytest.approx(0.1143, abs=1e-4)
    tolerance = 4 * math.sqrt(expected * (1 - expected) / sequences)
    for drawn in (inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2]):  # keys, values
        repeats = (drawn.sort(-1).values.diff(dim=-1) == 0).any(-1).float().mean().item()
        assert abs(repeats - expected) < tolerance


def power_law_cdf(positions, low, high, power=0.1):
    """P(X < x) for X of density ~ x ** -power on [low, high)."""
    e = 1 - power
    return (positions.double() ** e - low ** e) / (high ** e - low ** e)


def test_kla_authors_query_positions_follow_the_power_law():
    """Kolmogorov-Smirnov: the query positions' empirical CDF within 1.95 / sqrt(n) of the power
    law's (its 0.1% critical value; the discrete positions make the test conservative), and the
    uniform law's CDF beyond that bound, so the test tells the two apart. A position is the
    integer part of a draw: P(position <= k) = F(k + 1)."""
    seq_len, low = 2048, 2 * 32
    high = seq_len - 2
    _, query_positions, _ = make_kla(num_examples=1000, seq_len=seq_len, kv_pairs=32, vocab_size=8192)
    assert query_positions.min() >= low and query_positions.max() < high
    samples = query_positions.flatten()
    support = torch.arange(low, high)
    empirical = (samples[None, :] <= support[:, None]).double().mean(-1)
    bound = 1.95 / math.sqrt(len(samples))
    assert (empirical - power_law_cdf(support + 1, low, high)).abs().max() < bound
    assert (empirical - (support + 1 - low).double() / (high - low)).abs().max() > bound


def test_kla_authors_pairs_are_asked_in_a_random_order():
    """The j-th query placed (the one a later query may overwrite) asks a uniformly random pair:
    each pair is first with probability 1 / P. A fixed order (pair 0 first) would make the later
    pairs win every collision. Values of 8192 tokens are told apart by value; a row repeating a
    value, or whose first query was overwritten, is skipped. The counts' standard deviation is
    sqrt(n p (1 - p)): bound 4 of them."""
    pairs = 6
    inputs, _, answers = make_kla(num_examples=3000, seq_len=2048, kv_pairs=pairs, vocab_size=8192)
    values = inputs[:, 1:2 * pairs:2]
    usable = (answers[:, 0] != mqar.IGNORE_INDEX) & (values.sort(-1).values.diff(dim=-1) != 0).all(-1)
    first_pair = (values[usable] == answers[usable, :1]).int().argmax(-1)
    counts, n = first_pair.bincount(minlength=pairs), usable.sum().item()
    assert n > 2900
    assert ((counts - n / pairs).abs() < 4 * math.sqrt(n * (1 / pairs) * (1 - 1 / pairs))).all(), counts


def test_kla_authors_answers_sit_at_the_query_positions_and_a_later_query_overwrites_an_earlier():
    """Each scored answer's position holds its key, after the pairs and before length - 2, and
    (key, answer) is one of its sequence's pairs; an answer is not scored exactly when a later
    query took its position; the positions scored are distinct, one query per pair."""
    inputs, query_positions, answers = make_kla(num_examples=400)
    collisions = 0
    for row in range(len(inputs)):
        pairs = set(zip(inputs[row, 0:2 * PAIRS:2].tolist(), inputs[row, 1:2 * PAIRS:2].tolist()))
        positions, row_answers = query_positions[row].tolist(), answers[row].tolist()
        assert all(2 * PAIRS <= p < LENGTH - 2 for p in positions)
        scored = [(p, a) for p, a in zip(positions, row_answers) if a != mqar.IGNORE_INDEX]
        assert len({p for p, _ in scored}) == len(scored) == len(set(positions))
        assert all((inputs[row, p].item(), a) in pairs for p, a in scored)
        for j, (p, a) in enumerate(zip(positions, row_answers)):
            assert (a == mqar.IGNORE_INDEX) == (p in positions[j + 1:])
        collisions += len(positions) - len(scored)
    assert collisions > 0  # 6 queries over 34 positions: collisions are common, and covered
    assert query_positions.shape == answers.shape == (len(inputs), PAIRS)


def test_kla_authors_data_are_fixed_by_the_seed():
    assert all(torch.equal(a, b) for a, b in zip(make_kla(seed=3), make_kla(seed=3)))
    assert not torch.equal(make_kla(seed=3)[0], make_kla(seed=4)[0])


def test_kla_authors_sets_come_from_their_own_seeds_at_every_length():
    task = dict(mqar.SMOKE_TASK, train_length=LENGTH, kv_pairs=PAIRS, train_examples=7, eval_examples=5)
    train_set, validation_set, test_sets = mqar.make_kla_authors_sets(task, VOCAB, CPU)
    assert all(torch.equal(a, b) for a, b in zip(train_set, make_kla(7, seed=42)))
    assert all(torch.equal(a, b) for a, b in zip(validation_set, make_kla(5, seed=43)))
    assert sorted(test_sets) == [1, 2, 4, 8]
    for factor, seed in ((1, 44), (2, 45), (4, 46), (8, 47)):
        assert all(torch.equal(a, b) for a, b in zip(test_sets[factor], make_kla(5, factor * LENGTH, seed=seed)))


def test_kla_authors_too_short_a_sequence_for_its_pairs_is_refused():
    make_kla(2, 2 * PAIRS + 3)  # one query position: enough
    with pytest.raises(ValueError, match="need length >= 15"):
        make_kla(2, 2 * PAIRS + 2)


def test_kla_authors_lr_is_constant_and_reslin_gap_warms_up_then_decays():
    constant = mqar.lr_schedule("kla-authors", 1e-3, 100)
    assert [constant(step) for step in (0, 1, 50, 99)] == [1e-3] * 4
    # reslin-gap's schedule, pinned: 2 warm-up steps of 100, cosine to 0.
    schedule = mqar.lr_schedule("reslin-gap", 1e-3, 100)
    assert [schedule(step) for step in (0, 1, 2, 50, 99)] == pytest.approx(
        [0.0005, 0.0009997532801828658, 0.0009990133642141358, 0.0005, 2.467198171342e-07], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# reslin-gap: the earlier variant, unchanged


def test_reslin_gap_data_are_pinned():
    """Values generated before the kla-authors protocol was added: the variant must not drift."""
    inputs, query_positions, answers = make(num_examples=3, seed=0)
    assert inputs[0].tolist() == [27, 39, 22, 52, 8, 53, 24, 40, 18, 50, 2, 35, 27, 51, 46, 20, 22, 29, 3, 35, 18, 9,
                                  9, 41, 23, 3, 2, 26, 50, 44, 3, 31, 9, 10, 27, 45, 8, 39, 61, 21, 33, 44, 34, 34, 24,
                                  33, 24, 40]
    assert query_positions.tolist() == [[12, 16, 36, 46, 20, 26], [28, 30, 24, 18, 32, 26], [14, 12, 20, 22, 18, 30]]
    assert answers.tolist() == [[39, 52, 53, 40, 50, 35], [49, 47, 41, 53, 46, 48], [47, 45, 53, 57, 50, 59]]
    assert (inputs.sum().item(), query_positions.sum().item(), answers.sum().item()) == (4330, 430, 864)
    inputs, query_positions, answers = mqar.make_mqar(50, 256, 32, 8192, torch.Generator().manual_seed(42))
    assert (inputs.sum().item(), query_positions.sum().item(), answers.sum().item()) == (49429804, 202042, 9814927)
    assert inputs[7, :6].tolist() == [2424, 4624, 2770, 5530, 3161, 4160]
    assert query_positions[7, :6].tolist() == [66, 64, 70, 82, 130, 68]
    batches = mqar.shuffled_batches(100, 7, 32, torch.Generator().manual_seed(1))
    assert batches.sum().item() == 11175 and batches[0, :8].tolist() == [45, 15, 90, 32, 35, 63, 17, 72]


def test_reslin_gap_each_query_is_a_key_of_its_sequence_and_its_answer_that_keys_value():
    inputs, query_positions, answers = make()
    keys, values = inputs[:, 0:2 * PAIRS:2], inputs[:, 1:2 * PAIRS:2]
    for row in range(len(inputs)):
        value_of = dict(zip(keys[row].tolist(), values[row].tolist()))
        assert len(value_of) == PAIRS and len(set(values[row].tolist())) == PAIRS  # distinct keys and values
        asked = inputs[row, query_positions[row]].tolist()
        assert sorted(asked) == sorted(value_of)  # every key asked exactly once
        assert answers[row].tolist() == [value_of[key] for key in asked]


def test_reslin_gap_keys_and_values_come_from_disjoint_halves_of_the_vocabulary():
    inputs, _, answers = make()
    keys, values = inputs[:, 0:2 * PAIRS:2], inputs[:, 1:2 * PAIRS:2]
    assert keys.min() >= 1 and keys.max() < VOCAB // 2
    assert values.min() >= VOCAB // 2 and values.max() < VOCAB
    assert torch.equal(answers.sort(-1).values, values.sort(-1).values)


def test_reslin_gap_query_positions_are_distinct_even_offsets_after_the_pairs_with_early_ones_likelier():
    _, query_positions, _ = make(num_examples=400, seq_len=512)
    offsets = query_positions - 2 * PAIRS
    assert offsets.min() >= 0 and query_positions.max() < 512 and (offsets % 2 == 0).all()
    assert all(len(set(row.tolist())) == PAIRS for row in query_positions)
    # Zoology's power law: the median query comes far sooner than under uniform gaps (~half the room).
    assert offsets.float().median() < 0.25 * (512 - 2 * PAIRS)


def test_reslin_gap_data_is_fixed_by_the_seed():
    assert all(torch.equal(a, b) for a, b in zip(make(seed=3), make(seed=3)))
    assert not torch.equal(make(seed=3)[0], make(seed=4)[0])


def test_reslin_gap_eval_sets_scale_the_length_and_keep_the_pairs():
    task = dict(mqar.SMOKE_TASK, train_length=LENGTH, kv_pairs=PAIRS, eval_examples=5)
    eval_sets = mqar.make_eval_sets(task, VOCAB, torch.Generator().manual_seed(0))
    assert sorted(eval_sets) == [1, 2, 4, 8]
    for factor, (inputs, query_positions, answers) in eval_sets.items():
        assert inputs.shape == (5, factor * LENGTH)
        assert query_positions.shape == answers.shape == (5, PAIRS)
        assert query_positions.max() < factor * LENGTH


def test_reslin_gap_too_short_a_sequence_for_its_pairs_is_refused():
    with pytest.raises(ValueError, match="need length"):
        mqar.make_mqar(2, 4 * PAIRS - 2, PAIRS, VOCAB, torch.Generator())


# ---------------------------------------------------------------------------------------------
# Scoring and training


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


def predicting(inputs, at_positions, answers, rows=slice(None)):
    """A TableModel right at `at_positions` of `rows` (answers IGNORE_INDEX excepted), token 0 (never
    a reslin-gap answer) elsewhere."""
    predictions = torch.zeros_like(inputs)
    for row in range(len(inputs))[rows]:
        scored = answers[row] != mqar.IGNORE_INDEX
        predictions[row, at_positions[row][scored]] = answers[row][scored]
    return TableModel(inputs, predictions)


def test_accuracy_reads_only_the_answer_positions(monkeypatch):
    inputs, query_positions, answers = make(num_examples=10)
    monkeypatch.setattr(mqar, "EVAL_TOKENS_PER_BATCH", 3 * LENGTH)  # several batches, the last one short
    assert mqar.accuracy(predicting(inputs, query_positions, answers), inputs, query_positions, answers) == 1.0
    # Right one position later (where a next-token shift would look) is wrong.
    assert mqar.accuracy(predicting(inputs, query_positions + 1, answers), inputs, query_positions, answers) == 0.0
    half = predicting(inputs, query_positions, answers, rows=slice(0, 5))
    assert mqar.accuracy(half, inputs, query_positions, answers) == 0.5


def test_accuracy_counts_only_the_scored_answers_of_kla_authors():
    inputs, query_positions, answers = make_kla(num_examples=10)
    scored = (answers != mqar.IGNORE_INDEX).sum().item()
    assert scored < answers.numel()  # some queries were overwritten
    assert mqar.accuracy(predicting(inputs, query_positions, answers), inputs, query_positions, answers) == 1.0
    first_row = predicting(inputs, query_positions, answers, rows=slice(0, 1))
    assert mqar.accuracy(first_row, inputs, query_positions, answers) == (answers[0] >= 0).sum().item() / scored


def scripted_training(monkeypatch, scores, steps, eval_interval, patience, seed=0, saved=None, save=None):
    """mqar.train on the smoke model with the validation accuracies `scores`, in turn; returns
    its result, the model, and the output layer's weights at each validation. The data and the
    batch order are the same at every call; `seed`, the initial weights'."""
    model = mqar.build_model("gdn", mqar.SMOKE_MODEL, "torch", seed=seed, device=CPU)
    generator = torch.Generator().manual_seed(0)
    train_set = mqar.make_kla_authors_mqar(64, 32, 4, VOCAB, generator)
    validation_set = mqar.make_kla_authors_mqar(8, 32, 4, VOCAB, generator)
    scores, weights = iter(scores), []

    def scripted_accuracy(model, *examples):
        assert all(torch.equal(a, b) for a, b in zip(examples, validation_set))
        weights.append(model.lm_head.weight.detach().clone())
        return next(scores)

    monkeypatch.setattr(mqar, "accuracy", scripted_accuracy)
    batches = mqar.shuffled_batches(64, steps, 8, generator)
    result = mqar.train(model, train_set, batches, lambda step: 1e-2, log_every=4,
                        early_stopping=(validation_set, eval_interval, patience), saved=saved, save=save)
    return result, model, weights


def test_early_stopping_stops_after_patience_validations_without_a_gain_and_keeps_the_best(monkeypatch):
    # Best 0.5 at the 2nd validation (step 4); a tie (0.5) is no gain; the 3rd without one stops at step 10.
    result, model, weights = scripted_training(monkeypatch, [0.1, 0.5, 0.4, 0.5, 0.3, 0.9], steps=30,
                                               eval_interval=2, patience=3)
    assert result["validations"] == [[2, 0.1], [4, 0.5], [6, 0.4], [8, 0.5], [10, 0.3]]
    assert (result["steps_run"], result["best_step"], result["validation_accuracy"]) == (10, 4, 0.5)
    assert result["stop_reason"] == "no validation gain in 3 validations after step 4"
    assert not torch.equal(weights[1], weights[4])  # it trained on after its best
    assert torch.equal(model.lm_head.weight, weights[1])  # and is back at it
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied


def test_without_patience_running_out_the_last_step_is_validated_too(monkeypatch):
    result, model, weights = scripted_training(monkeypatch, [0.1, 0.2, 0.3], steps=7, eval_interval=3, patience=10)
    assert result["validations"] == [[3, 0.1], [6, 0.2], [7, 0.3]]
    assert (result["steps_run"], result["best_step"], result["stop_reason"]) == (7, 7, "reached the 7 steps")
    assert torch.equal(model.lm_head.weight, weights[2])


def through_a_file(state):
    """The state as written and read back (torch.save, torch.load with weights_only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


TIMES = ("ms_per_step", "train_seconds")


@pytest.mark.parametrize("resume_after", [1, 3, 5], ids=["best-is-current", "best-is-earlier", "at-the-stop"])
def test_training_resumed_from_a_saved_state_is_the_uninterrupted_training(monkeypatch, resume_after):
    """A state saved at each validation, written and read back, continues the training bit for bit
    (weights, losses, validations, the best checkpoint): after the 1st validation (the best so far,
    the current weights), the 3rd (the best one validation back, at step 4) and the 5th (where
    training stops, the best restored). Loss logs (every 4 steps) fall between validations (every
    2): a log window is cut by the stop. The resumed model starts from other initial weights."""
    scores = [0.1, 0.5, 0.4, 0.5, 0.3, 0.9]
    states = []
    whole, whole_model, _ = scripted_training(monkeypatch, scores, steps=30, eval_interval=2, patience=3,
                                              save=lambda state: states.append(through_a_file(state)))
    assert [state["step"] for state in states] == [2, 4, 6, 8, 10] and whole["steps_run"] == 10
    saved = states[resume_after - 1]
    assert (saved["best_model"] is None) == (resume_after == 1) and saved["done"] == (resume_after == 5)
    resumed, resumed_model, _ = scripted_training(monkeypatch, scores[resume_after:], steps=30, eval_interval=2,
                                                  patience=3, seed=1, saved=saved)
    assert resumed.pop("resumed_at_steps") == [saved["step"]] and whole.pop("resumed_at_steps") == []
    assert {k: v for k, v in resumed.items() if k not in TIMES} == {k: v for k, v in whole.items() if k not in TIMES}
    assert resumed["final_loss"] == whole["final_loss"]  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(resumed_model.state_dict().values(),
                                                  whole_model.state_dict().values()))
    assert resumed_model.lm_head.weight is resumed_model.get_input_embeddings().weight  # still tied


# Two runs of 3 validations each (steps 2, 4 and 6): a saved state at each.
SWEEP = ["--smoke", "--attn-types", "gdn", "--lr", "1e-3", "3e-3", "--steps", "6", "--eval-interval", "2",
         "--kernel-backend", "torch", "--device", "cpu"]
RUN_TIMES = (*TIMES, "eval_seconds", "run_seconds")


def sweep(out, stop_after=None):
    """mqar.main on SWEEP into `out`, stopped (KeyboardInterrupt, as at the end of a GPU call) right
    after its `stop_after`-th saved state; returns the weights of the last model it built."""
    built, saves = [], []
    build_model, save_partial_state = mqar.build_model, mqar.save_partial_state

    def save_then_stop(*args):
        save_partial_state(*args)
        saves.append(args)
        if len(saves) == stop_after:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mqar, "build_model", lambda *args, **kwargs: built.append(build_model(*args, **kwargs))
                      or built[-1])
        patch.setattr(mqar, "save_partial_state", save_then_stop)
        if stop_after is None:
            mqar.main([*SWEEP, "--out", str(out)])
        else:
            with pytest.raises(KeyboardInterrupt):
                mqar.main([*SWEEP, "--out", str(out)])
    return built[-1].state_dict() if built else None


@pytest.fixture(scope="module")
def uninterrupted_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "mqar.json"
    weights = sweep(out)
    return json.loads(out.read_text()), weights


@pytest.mark.parametrize("stop_after", [1, 3, 5], ids=["first-run", "first-run-at-its-end", "second-run"])
def test_a_stopped_run_resumes_from_its_saved_state_to_the_uninterrupted_result(tmp_path, uninterrupted_sweep,
                                                                                stop_after):
    """mqar.main stopped after a validation, then run again with the same flags: it resumes from
    <out>.partial.pt and writes the JSON (accuracies, validations, best and last steps, losses)
    and the final weights of the run never stopped, then removes its saved state. Stopped after
    the 1st run's first validation, its last (training over, not yet tested) and the 2nd run's
    second (the 1st run's record in the state)."""
    out = tmp_path / "mqar.json"
    sweep(out, stop_after)
    state_path = tmp_path / "mqar.partial.pt"
    assert not out.exists() and state_path.is_file() and not state_path.with_name("mqar.partial.pt.tmp").exists()
    saved = torch.load(state_path, weights_only=True)
    assert (len(saved["runs"]), saved["current"]["lr"], saved["current"]["step"], saved["current"]["done"]) == {
        1: (0, 1e-3, 2, False), 3: (0, 1e-3, 6, True), 5: (1, 3e-3, 4, False)}[stop_after]

    weights = sweep(out)
    assert not state_path.exists()
    expected, expected_weights = uninterrupted_sweep
    result = json.loads(out.read_text())
    for run, expected_run in zip(result["runs"], expected["runs"], strict=True):
        assert {k: v for k, v in run.items() if k not in RUN_TIMES + ("resumed_at_steps",)} == \
            {k: v for k, v in expected_run.items() if k not in RUN_TIMES + ("resumed_at_steps",)}
        assert expected_run["resumed_at_steps"] == []
    assert [run["resumed_at_steps"] for run in result["runs"]] == {1: [[2], []], 3: [[6], []], 5: [[], [4]]}[stop_after]
    assert {k: v for k, v in result.items() if k not in ("runs", "argv")} == \
        {k: v for k, v in expected.items() if k not in ("runs", "argv")}
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)


def test_a_saved_state_of_other_flags_is_refused(tmp_path, capsys):
    out = tmp_path / "mqar.json"
    sweep(out, stop_after=1)
    with pytest.raises(SystemExit, match=r"mqar.py: error: .*mqar.partial.pt holds the saved state of runs with other "
                                         r"flags: --lr 0.001 \(saved: 0.001 0.003\), --seed 1 \(saved: 42\); give its "
                                         r"flags to resume them, or delete it to start afresh"):
        mqar.main([*SWEEP[:5], "--seed", "1", *SWEEP[6:], "--out", str(out)])  # --lr 1e-3 alone
    (tmp_path / "mqar.partial.pt").write_bytes(b"not a state")
    with pytest.raises(SystemExit, match="mqar.partial.pt is not a readable saved state .*: delete it to start afresh"):
        mqar.main([*SWEEP, "--out", str(out)])
    assert not out.exists()


@pytest.mark.parametrize("model_shape", [mqar.SMOKE_MODEL, mqar.PAPER_MODEL], ids=["smoke", "paper"])
def test_the_model_ties_its_embeddings_and_keeps_fp32_weights_and_no_padding_token(model_shape):
    """The shipped config.json, which build_model starts from, says bf16 and pad_token_id 0: the
    task's model takes neither (AdamW would update bf16 weights; token 0, a key, would keep a zero
    embedding without a gradient)."""
    model = mqar.build_model("kla", model_shape, "torch", seed=0, device=CPU)
    embeddings = model.get_input_embeddings()
    assert model.lm_head.weight is embeddings.weight
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    assert embeddings.padding_idx is None and embeddings.weight[0].abs().max() > 0


def test_smoke_run_of_kla_authors_records_the_protocol_and_the_early_stop(tmp_path):
    out = tmp_path / "mqar.json"
    mqar.main(["--smoke", "--attn-types", "gdn", "--lr", "1e-3", "3e-3", "--steps", "6", "--eval-interval", "2",
               "--patience", "1", "--kernel-backend", "torch", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["protocol"] == "kla-authors" and result["model"]["tie_word_embeddings"] is True
    assert result["task"]["eval_interval"] == 2 and result["task"]["patience"] == 1
    assert result["data_seeds"] == {"train": 42, "validation": 43, "test 1x": 44, "test 2x": 45, "test 4x": 46,
                                    "test 8x": 47}
    assert result["eval_lengths"] == {"1x": 32, "2x": 64, "4x": 128, "8x": 256}
    runs = result["runs"]
    for r in runs:
        assert sorted(r["accuracy"]) == ["1x", "2x", "4x", "8x"] and r["final_loss"] > 0
        assert r["steps_run"] <= 6 and r["best_step"] in [step for step, _ in r["validations"]]
        assert r["validation_accuracy"] == max(accuracy for _, accuracy in r["validations"])
        assert r["stop_reason"]
    best = runs[result["best"]["gdn"]]
    assert result["best_selected_by"] == "validation_accuracy"
    assert best["validation_accuracy"] == max(r["validation_accuracy"] for r in runs)


def test_smoke_run_of_reslin_gap_trains_every_type_and_lr_and_writes_its_json(tmp_path):
    out = tmp_path / "mqar.json"
    mqar.main(["--smoke", "--protocol", "reslin-gap", "--attn-types", "gdn", "rkla", "--lr", "1e-3", "3e-3",
               "--steps", "4", "--kernel-backend", "torch", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["protocol"] == "reslin-gap" and result["model"]["tie_word_embeddings"] is True
    runs = result["runs"]
    assert [(r["attn_type"], r["lr"]) for r in runs] == [("gdn", 1e-3), ("gdn", 3e-3), ("rkla", 1e-3), ("rkla", 3e-3)]
    assert result["eval_lengths"] == {"1x": 32, "2x": 64, "4x": 128, "8x": 256}
    for r in runs:
        assert sorted(r["accuracy"]) == ["1x", "2x", "4x", "8x"]
        assert all(0 <= a <= 1 for a in r["accuracy"].values()) and r["final_loss"] > 0
        assert r["steps_run"] == r["best_step"] == 4 and "validations" not in r
    for attn_type, index in result["best"].items():
        assert runs[index]["accuracy"]["1x"] == max(r["accuracy"]["1x"] for r in runs if r["attn_type"] == attn_type)


@pytest.mark.parametrize("argv, message", [
    (["--protocol", "zoology"], "argument --protocol: invalid choice: 'zoology'"),
    (["--protocol", "reslin-gap", "--patience", "3"], "--patience: for --protocol kla-authors only"),
    (["--eval-interval", "0"], "--eval-interval must be >= 1, got 0"),
    (["--steps", "-1"], "--steps must be >= 1, got -1"),
])
def test_bad_arguments_fail_clearly(capsys, argv, message):
    with pytest.raises(SystemExit):
        mqar.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attn_type", ["gdn", "kla", "rdn", "rkla", "rla", "sgla"])
def test_paper_model_step_through_triton_matches_the_torch_backend_on_cuda(attn_type):
    """The paper's model runs the chunked Triton kernels at head sizes 48 / 96, which the kernel
    tests do not cover: one bf16-autocast training step (loss, every gradient) and the evaluation
    forward at 8x through "auto" (Triton) against the torch backend, same weights, same batch. The
    bounds are loose for bf16 on purpose: the failures seen on the H200 at untested head sizes
    (wrong values, illegal addresses) were errors of order one."""
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    train_batch = mqar.make_kla_authors_mqar(32, 256, 32, 8192, generator)
    eval_batch = mqar.make_kla_authors_mqar(4, 2048, 32, 8192, generator)
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
    trains as the eager run does, validations between its steps included. Inductor's fused fp32
    arithmetic rounds differently: after 4 AdamW steps the losses differed by 2.4e-5 (relative)
    when measured; bound 2e-4."""
    results = {}
    for compile_flags in ([], ["--compile"]):
        out = tmp_path / f"mqar{len(compile_flags)}.json"
        mqar.main(["--smoke", "--attn-types", "rdn", "--steps", "4", "--eval-interval", "2", "--kernel-backend",
                   "torch", "--out", str(out), *compile_flags])
        results[bool(compile_flags)] = json.loads(out.read_text())["runs"][0]
    assert results[True]["compile"] == "inductor" and results[False]["compile"] is None
    assert results[True]["final_loss"] == pytest.approx(results[False]["final_loss"], rel=2e-4)
    assert results[True]["accuracy"] == results[False]["accuracy"]
    assert results[True]["validations"] == results[False]["validations"]
