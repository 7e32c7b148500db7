"""The Hugging Face Trainer on a tiny ResLin model, for test_trainer.py: run as `python
launch_trainer.py OUT` (one process) or under `accelerate launch` (several). The global batch is
4 rows of 24 tokens whatever the number of processes (split_batches), so every run takes the same
steps; the main process writes the logged losses to OUT."""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from conftest import REPO_ROOT, TINY

sys.path.insert(0, str(REPO_ROOT))
import train  # noqa: E402


def train_and_report(out):
    config = AutoConfig.from_pretrained(REPO_ROOT, trust_remote_code=True, **TINY, attn_type="rdn", num_v_heads=2,
                                        layer_types=["linear_attention"] * TINY["num_hidden_layers"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    ids = torch.randint(3, 20, (16, 24), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=out + ".run", max_steps=6, per_device_train_batch_size=4,
                             accelerator_config={"split_batches": True}, learning_rate=1e-2, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    if trainer.is_world_process_zero():
        with open(out, "w") as file:
            json.dump({"processes": trainer.args.world_size,
                       "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}, file)


if __name__ == "__main__":
    train_and_report(sys.argv[1])  # the model is freed on return, before the process group goes
    train.end_process()
