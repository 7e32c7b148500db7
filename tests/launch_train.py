"""train.py's main in each process of `accelerate launch` or `torchrun`, for test_train_distributed.py.

What it adds to `python train.py ARGS`:
- accelerate takes FSDP on CPUs too. accelerate 1.15 turns FSDP on for GPUs only (its
  AcceleratorState lists the accelerator kinds) and on CPUs silently trains with DDP; torch's
  FSDP2 itself runs on CPUs with gloo, so this lets the CPU tests run train.py's FSDP2 path.
- With RESLIN_TEST_LOGITS=FILE, the trained in-memory model's logits on a fixed batch go to FILE,
  with the batch (every process runs that forward: FSDP gathers weights in it).
- With RESLIN_TEST_KEEP_CHECKPOINT=FILE, a copy of the run's first checkpoint goes to FILE: a run
  resumed from it continues as if this one had stopped there.
"""

import os
import shutil
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402

INPUT_IDS = torch.arange(3, 67).reshape(2, 32)  # ids that every tokenizer of train.py has


def let_accelerate_take_fsdp_on_cpus():
    init = AcceleratorState.__init__

    def init_with_fsdp_on_cpus(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # As AcceleratorState does for GPUs: later AcceleratorState() calls copy PartialState's type.
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init_with_fsdp_on_cpus


def keep_the_trained_model():
    """A dict that holds, once main returns, the model of the last checkpoint (the final one)."""
    kept = {}
    full_training_state = train.full_training_state

    def keeping(model, optimizer):
        kept["model"] = model
        return full_training_state(model, optimizer)

    train.full_training_state = keeping
    return kept


def keep_the_first_checkpoint(copy):
    save_checkpoint = train.save_checkpoint

    def save_and_keep(path, *args):
        save_checkpoint(path, *args)
        if not os.path.exists(copy):
            shutil.copyfile(path, copy)

    train.save_checkpoint = save_and_keep


if __name__ == "__main__":
    let_accelerate_take_fsdp_on_cpus()
    kept = keep_the_trained_model()
    if "RESLIN_TEST_KEEP_CHECKPOINT" in os.environ:
        keep_the_first_checkpoint(os.environ["RESLIN_TEST_KEEP_CHECKPOINT"])
    train.main(sys.argv[1:])
    if "RESLIN_TEST_LOGITS" in os.environ:
        model = kept["model"].eval()
        with torch.no_grad():
            logits = model(input_ids=INPUT_IDS.to(PartialState().device)).logits.cpu()
        if PartialState().is_main_process:
            torch.save({"input_ids": INPUT_IDS, "logits": logits}, os.environ["RESLIN_TEST_LOGITS"])
    kept.clear()
    train.end_process()
