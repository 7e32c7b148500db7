"""The Hugging Face Trainer trains a ResLin model as it trains any causal LM: packed rows from
DataCollatorWithFlattening (position_ids restart at each sequence, no padding), gradient
checkpointing switched on by TrainingArguments, and a saved folder that loads back through remote
code with the trained model's logits; and under `accelerate launch` (DDP, 2 processes over
gloo) the Trainer takes the steps one process takes (tests/launch_trainer.py)."""

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, DataCollatorForLanguageModeling,
                          DataCollatorWithFlattening, PreTrainedTokenizerFast, Trainer, TrainingArguments)

from conftest import REPO_ROOT, TINY, build_model
from test_train_distributed import free_port


def test_trainer_trains_packed_rows_with_checkpointing_and_saves_what_loads(repo_copy, load_remote, tmp_path):
    config = AutoConfig.from_pretrained(repo_copy, trust_remote_code=True, **TINY, attn_type="rdn", num_v_heads=2,
                                        layer_types=["linear_attention"] * TINY["num_hidden_layers"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 20, (n,), generator=generator).tolist()}
            for n in (12, 7, 20, 9, 15, 11, 18, 6)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=8, per_device_train_batch_size=4,
                             learning_rate=1e-2, warmup_steps=0, gradient_checkpointing=True, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=DataCollatorWithFlattening())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.5, losses  # ids drawn from 17 of 100: learnable at once
    assert model.is_gradient_checkpointing

    trainer.save_model(str(tmp_path / "saved"))
    loaded = load_remote(tmp_path / "saved").eval()
    ids = torch.randint(3, 100, (2, 16), generator=generator)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


@pytest.mark.parametrize("collation", ["padded", "packed"])
def test_gradient_accumulation_takes_the_step_of_one_batch(collation, tmp_path):
    """Rows of unequal length, 4 at once or 2 x 2 accumulated: the Trainer passes num_items_in_batch,
    the tokens of all accumulated batches, and the model divides its summed loss by it, so one SGD
    step moves every weight alike (fp32 rounding only)."""
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 100, (n,), generator=generator).tolist()} for n in (12, 3, 20, 9)]
    # Right padding: left padding adds a label (a row's first token, predicted from padding) to each padded
    # row, which makes the two runs' losses differ for any model.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(REPO_ROOT, padding_side="right")
    collator = (DataCollatorForLanguageModeling(tokenizer, mlm=False) if collation == "padded"
                else DataCollatorWithFlattening())
    weights = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = build_model("rdn")
        args = TrainingArguments(output_dir=str(tmp_path / str(accumulation)), max_steps=1, optim="sgd",
                                 learning_rate=1.0, max_grad_norm=0, per_device_train_batch_size=batch_size,
                                 gradient_accumulation_steps=accumulation, save_strategy="no", report_to=[],
                                 use_cpu=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
        trainer._get_train_sampler = lambda *args, **kwargs: torch.utils.data.SequentialSampler(rows)
        trainer.train()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(weights[0], torch.cat([p.flatten() for p in build_model("rdn").parameters()]))
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-6)


def test_trainer_label_smoothing_shifts_the_labels(tmp_path):
    """With label_smoothing_factor the Trainer computes the loss itself, shifting the labels only for
    classes it knows as causal LMs (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES): unshifted, every position would
    learn to predict its own token. A smoothing of 1e-6 barely moves the model's own (shifted) loss."""
    rows = [{"input_ids": torch.randint(3, 100, (12,), generator=torch.Generator().manual_seed(i)).tolist()}
            for i in range(4)]
    first_losses = []
    for smoothing in (0.0, 1e-6):
        args = TrainingArguments(output_dir=str(tmp_path / f"run{smoothing}"), max_steps=1, per_device_train_batch_size=4,
                                 learning_rate=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                 label_smoothing_factor=smoothing)
        trainer = Trainer(model=build_model("rdn"), args=args, train_dataset=rows,
                          data_collator=DataCollatorWithFlattening())
        trainer.train()
        first_losses.append(next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry))
    assert first_losses[1] == pytest.approx(first_losses[0], abs=1e-3)


def test_trainer_under_accelerate_ddp_takes_one_process_steps(tmp_path):
    """The same global batch (4 rows, split over the processes) and steps: the logged losses of
    2 DDP processes equal one process's up to the order of floating-point sums, which AdamW's
    first steps amplify where a gradient is near zero (measured: 1.05e-4 relative at most over
    the 6 steps; bound 1e-3: other data or a wrong average differ by far more)."""
    runs = {}
    for processes in (1, 2):
        out = tmp_path / f"losses{processes}.json"
        command = [sys.executable, str(REPO_ROOT / "tests" / "launch_trainer.py"), str(out)]
        if processes > 1:
            command[1:1] = ["-m", "accelerate.commands.launch", "--config_file",
                            str(REPO_ROOT / "accelerate_configs" / "ddp.yaml"), "--num_processes", str(processes),
                            "--main_process_port", str(free_port())]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT / "tests")
        assert result.returncode == 0, result.stderr[-5000:]
        runs[processes] = json.loads(out.read_text())
    assert [runs[p]["processes"] for p in (1, 2)] == [1, 2]
    assert len(runs[1]["losses"]) == 6
    assert runs[2]["losses"][0] == pytest.approx(runs[1]["losses"][0], rel=1e-6)  # before any update
    assert runs[2]["losses"] == pytest.approx(runs[1]["losses"], rel=1e-3)
