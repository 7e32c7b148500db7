"""The Hugging Face Trainer trains a ResLin model as it trains any causal LM: packed rows from
DataCollatorWithFlattening (position_ids restart at each sequence, no padding), gradient
checkpointing switched on by TrainingArguments, and a saved folder that loads back through remote
code with the trained model's logits. (Several processes: accelerate launches the Trainer as it
launches train.py, tested in test_train_distributed.py.)"""

import math

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, DataCollatorWithFlattening, Trainer,
                          TrainingArguments)

from conftest import TINY


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
