"""Pretrain a ResLin model on a local text corpus: by default the Python standard library's source.

    python train.py --out-dir out/rdn --attn-type rdn --max-steps 3000            # train
    python train.py --out-dir out/rdn --attn-type rdn --max-steps 3000 --resume   # continue it after a stop
    python train.py --out-dir out/rdn --time-budget 20                            # train for 20 minutes

On several GPUs of one machine (section 6), with DDP or FSDP2:

    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --out-dir out/rdn --max-steps 3000
    accelerate launch --config_file accelerate_configs/fsdp2.yaml train.py --out-dir out/rdn --max-steps 3000
    torchrun --nproc-per-node 2 train.py --out-dir out/rdn --max-steps 3000       # DDP

1. Data. Every file matching --pattern under --corpus is a document. Files go to the train or the
   validation split by a hash of their path (not by the seed, nor by the order files are found in).
   A byte-level BPE tokenizer is trained on the train split, and both splits are tokenized, each
   file as <bos> text <eos>. All of it is cached under --data-dir, keyed by the corpus's content and
   the data settings, so a rerun neither retrains the tokenizer nor retokenizes.
2. Batches. A split's token stream is cut into rows of --seq-len tokens. A batch is --batch-size
   rows (in an order drawn per epoch from --seed) laid end to end in ONE packed row, whose
   position_ids restart at 0 at every document and every row start: the model turns them into
   cu_seqlens, so no token sees another document or row, and no token is padding. A sequence's
   first token gets the label -100: nothing before it in its sequence predicts it.
3. Training: AdamW (no weight decay on biases, norms and the decay parameters), linear warm-up then
   cosine decay to --min-lr-ratio, gradient clipping, bf16 autocast on CUDA and fp32 on a CPU.
   The schedule follows progress = the larger of step / --max-steps and elapsed / --time-budget;
   training ends when progress reaches 1. With --max-steps alone a run is a pure function of its
   arguments (bit for bit on a CPU, resumed or not).
4. Validation every --eval-interval steps and at the end, on the first --eval-tokens validation
   tokens (0: all of them): loss in nats per predicted token, and bits per byte = total nats /
   ln 2 / the UTF-8 bytes of the predicted tokens (byte-level BPE tokens are byte strings, so this
   is exact and comparable across tokenizers).
5. Output, in --out-dir: checkpoint.pt every --save-interval steps and at the end (written to a
   temporary file, then renamed); at the end a folder that loads with
   AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True) and AutoTokenizer: weights,
   config.json with auto_map, generation_config.json, the tokenizer, the model's .py files, a model
   card (README.md) and metrics.json (losses over steps, validation figures).
6. Several processes (accelerate launch or torchrun; the configs in accelerate_configs/ start 2).
   --batch-size stays the global batch: of N processes, process r takes the r-th run of
   --batch-size / N consecutive rows of the rows one process would take (N must divide
   --batch-size), so a step sees the same data whatever N. The loss is the mean over all the
   batch's predicted tokens: each process divides the sum over its own tokens by the whole batch's
   count (not by its own: document starts leave processes with different counts), so that the
   gradients, averaged over the processes, are one process's. FSDP2 shards each ResLinBlock (the
   model's _no_split_modules) and keeps fp32 weights and fp32 gradient reduction under the same bf16
   autocast as one GPU; --gradient-checkpointing works under both. Validation rows are split the same
   way and the sums reduced over the processes. Only the main process logs and writes. Checkpoints
   hold the full weights and optimizer state (gathered from FSDP's shards) in the same file whatever N:
   --resume continues exactly under the same launch, and also with another number of processes
   (then equal up to the order of floating-point sums). The model folder holds full weights.
"""

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import sys
import sysconfig
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, broadcast
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from configuration_reslin import ATTN_PRESETS, KERNEL_BACKENDS
from generate import check_device

REPO = Path(__file__).resolve().parent
# Ids 0, 1, 2 in this order, as the repository's config.json has them (pad, bos, eos).
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = range(3)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte, then the special tokens
DATA_FORMAT = 1  # part of the cache key: bump it when the cached data's layout or meaning changes
CHECKPOINT = "checkpoint.pt"
# Files of the model folder a run writes at its end (metrics.json also with every checkpoint).
MODEL_FOLDER_FILES = ("config.json", "model.safetensors", "README.md", "metrics.json")
# What a resumed run may change; every other argument must be the checkpoint's, or the resumed
# run would not continue the same run.
CHANGEABLE_ON_RESUME = {"resume", "max_steps", "time_budget", "eval_interval", "eval_tokens", "save_interval",
                        "data_dir", "device", "compile"}


def fail(message):
    raise SystemExit(f"train.py: error: {message}")


def parse_args(argv=None):
    # The module docstring tells the whole story; --help gives the flags.
    parser = argparse.ArgumentParser(
        description="Pretrain a ResLin model on a local text corpus (by default this Python's standard library "
                    "source). The top of train.py describes the data, schedule, outputs and multi-GPU runs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                      help="folder of text files (folders named site-packages are skipped, since they hold "
                           "installed packages)")
    data.add_argument("--pattern", default="*.py", help="file name pattern, searched recursively")
    data.add_argument("--val-fraction", type=float, default=0.05, help="share of files held out (at least one)")
    data.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size, special tokens included")
    data.add_argument("--data-dir", type=Path, default=Path("out/data"), help="cache of tokenizers and token ids")

    model = parser.add_argument_group("model")
    model.add_argument("--attn-type", default="rdn", choices=tuple(ATTN_PRESETS), help="the token mixer")
    model.add_argument("--hidden-size", type=int, default=384, help="model width")
    model.add_argument("--layers", type=int, default=8, help="number of blocks")
    model.add_argument("--heads", type=int, default=6, help="heads per layer")
    model.add_argument("--head-dim", type=int, default=64, help="query/key head size")
    model.add_argument("--intermediate-size", type=int, default=None, help="MLP width (None: the config's default)")
    model.add_argument("--tie-word-embeddings", action="store_true", help="share lm_head with the input embeddings")
    model.add_argument("--kernel-backend", default="auto", choices=KERNEL_BACKENDS, help="the config's kernel_backend")
    model.add_argument("--full-attention-layers", type=int, nargs="+", default=None, metavar="INDEX",
                       help="blocks (counted from 0) that use softmax attention instead of the linear mixer: "
                            "a hybrid model (the config's layer_types)")
    model.add_argument("--sliding-window", type=int, default=None,
                       help="full attention layers see only the last N tokens (the config's sliding_window)")
    model.add_argument("--residual-clip", type=float, default=1.0,
                       help="the residual rules' clip c, r = clip(v - S^T k, -c, c) (the config's residual_clip)")

    training = parser.add_argument_group("training")
    training.add_argument("--seq-len", type=int, default=1024, help="tokens per row")
    training.add_argument("--batch-size", type=int, default=32, help="rows per step")
    training.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    training.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    training.add_argument("--warmup-steps", type=int, default=100, help="steps of linear learning-rate warm-up")
    training.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on matrices only")
    training.add_argument("--beta2", type=float, default=0.95, help="AdamW's second-moment decay")
    training.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    training.add_argument("--max-steps", type=int, default=None, help="optimizer steps of the run")
    training.add_argument("--time-budget", type=float, default=None, help="minutes of training, evaluations included")
    training.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the batch order")
    training.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    training.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                          help="run the model through torch.compile (inductor when given alone): one fused kernel "
                               "where eager PyTorch makes many small elementwise passes")
    training.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                          help="one process: any device; several: cuda (each takes its LOCAL_RANK's GPU) or cpu")
    training.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                          help="auto: bf16 autocast on CUDA, fp32 elsewhere")

    output = parser.add_argument_group("evaluation and output")
    output.add_argument("--eval-interval", type=int, default=250, help="steps between validations")
    output.add_argument("--eval-tokens", type=int, default=262144,
                        help="validation tokens of every validation, the final one included (0: all)")
    output.add_argument("--save-interval", type=int, default=1000, help="steps between checkpoints")
    output.add_argument("--out-dir", type=Path, default=Path("out/reslin"), help="checkpoint and model folder")
    output.add_argument("--resume", action="store_true", help="continue the run in --out-dir from its checkpoint")

    args = parser.parse_args(argv)
    if args.seq_len < 2:
        parser.error(f"--seq-len must be at least 2 (a token and the one it predicts), got {args.seq_len}")
    if not MIN_VOCAB_SIZE <= args.vocab_size:
        parser.error(f"--vocab-size must be at least {MIN_VOCAB_SIZE} (256 bytes and the special tokens), "
                     f"got {args.vocab_size}")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must lie strictly between 0 and 1, got {args.val_fraction}")
    if args.max_steps is None and args.time_budget is None:
        parser.error("say how long to train: --max-steps, --time-budget (minutes) or both")
    for name in ("batch_size", "max_steps", "eval_interval", "save_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("val_fraction", "lr", "min_lr_ratio", "weight_decay", "beta2", "grad_clip", "time_budget",
                 "residual_clip"):
        if getattr(args, name) is not None and not math.isfinite(getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} must be a finite number, got {getattr(args, name)}")
    for name in ("warmup_steps", "eval_tokens", "weight_decay", "grad_clip"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.eval_tokens == 1:
        parser.error("--eval-tokens 1 holds only the split's first <bos>, which nothing predicts: give 0 (all) or "
                     "at least 2")
    outside = sorted(set(args.full_attention_layers or ()) - set(range(args.layers)))
    if outside:
        parser.error(f"--full-attention-layers {' '.join(map(str, outside))}: the blocks are numbered 0 to "
                     f"{args.layers - 1} (--layers {args.layers})")
    if args.sliding_window is not None and not args.full_attention_layers:
        parser.error("--sliding-window applies to full attention layers: give --full-attention-layers too")
    if args.time_budget is not None and not args.time_budget > 0:
        parser.error(f"--time-budget must be > 0 minutes, got {args.time_budget}")
    if not args.lr > 0 or not 0 <= args.min_lr_ratio <= 1 or not 0 <= args.beta2 < 1:
        parser.error("need --lr > 0, 0 <= --min-lr-ratio <= 1 and 0 <= --beta2 < 1")
    if args.compile and args.compile not in torch._dynamo.list_backends(exclude_tags=()):
        parser.error(f"--compile {args.compile}: torch.compile has no such backend (it has "
                     f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))})")
    device = check_device(parser, args.device)
    if args.kernel_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(f"--kernel-backend triton runs on CUDA (or in Triton's interpreter, TRITON_INTERPRET=1), "
                     f"not on --device {args.device}: use auto or torch")
    if args.out_dir.resolve() == REPO:
        parser.error("--out-dir must not be the repository itself (its README.md is the project's); train into "
                     "a folder of its own and copy the model files over to ship them")
    for name in ("out_dir", "data_dir"):
        if getattr(args, name).exists() and not getattr(args, name).is_dir():
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} exists and is not a folder")
    try:  # before the data's preparation, which takes minutes
        model_config(args, args.vocab_size)
    except ValueError as error:
        parser.error(f"the model flags make no valid ResLinConfig: {error}")
    return args


# ---------------------------------------------------------------------------------------------
# Data: corpus, tokenizer, cached token ids


def corpus_documents(corpus, pattern):
    """(relative path, text) of every UTF-8 file matching `pattern` under `corpus`, sorted by path;
    and the relative paths of the files skipped for not being UTF-8."""
    if not corpus.is_dir():
        fail(f"--corpus {corpus} is not a folder")
    paths = sorted(path for path in corpus.rglob(pattern)
                   if path.is_file() and "site-packages" not in path.relative_to(corpus).parts)
    documents, skipped = [], []
    for path in paths:
        relative = path.relative_to(corpus).as_posix()
        try:
            documents.append((relative, path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            skipped.append(relative)
    if len(documents) < 2:
        fail(f"--corpus {corpus} has {len(documents)} UTF-8 file(s) matching {pattern!r}: the train and "
             f"validation splits need at least one each")
    return documents, skipped


def split_documents(documents, val_fraction):
    """(train, validation): the validation files are those whose path hashes lowest, so the split
    depends on the paths only. At least one file goes to each side."""
    ranked = sorted(documents, key=lambda doc: hashlib.sha256(doc[0].encode()).hexdigest())
    num_val = min(max(1, round(val_fraction * len(documents))), len(documents) - 1)
    return sorted(ranked[num_val:]), sorted(ranked[:num_val])


def train_tokenizer(texts, vocab_size):
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer, no prefix space, so decoding gives the
    text back exactly) that puts <bos> before an encoded text, as the documents were seen."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")


def encode_documents(tokenizer, texts):
    """One stream of token ids: <bos> text <eos> per document."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    # A literal "<eos>" inside a file is text, not the end of the document.
    backend.encode_special_tokens = True
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    return np.concatenate([np.array([BOS_ID, *encoding.ids, EOS_ID], dtype=np.uint32) for encoding in encodings])


def token_byte_lengths(tokenizer):
    """UTF-8 bytes of each token id: byte-level BPE spells a token with one character per byte;
    the special tokens stand for no text."""
    lengths = np.zeros(len(tokenizer), dtype=np.int64)
    for token, token_id in tokenizer.get_vocab().items():
        lengths[token_id] = 0 if token in SPECIAL_TOKENS else len(token)
    return lengths


def prepare_data(args, resumed_cache=None):
    """The tokenizer, the token streams of both splits and a description of the corpus, from the
    cache under --data-dir when the corpus and the data settings are unchanged. `resumed_cache`:
    the data cache's name of the run --resume continues, which the corpus must still give (checked
    before a new cache is built, which takes minutes on a real corpus)."""
    documents, skipped = corpus_documents(args.corpus, args.pattern)
    key = hashlib.sha256(json.dumps([DATA_FORMAT, args.pattern, args.val_fraction, args.vocab_size]).encode())
    for relative, text in documents:
        key.update(relative.encode() + b"\0" + text.encode() + b"\0")
    folder = args.data_dir / f"{args.corpus.name}-v{args.vocab_size}-{key.hexdigest()[:16]}"
    if resumed_cache is not None and folder.name != resumed_cache:
        fail(f"--resume: the files of --corpus {args.corpus} changed since the checkpoint's run (its data: "
             f"{resumed_cache}, now: {folder.name}): a new tokenizer would meet the trained weights; restore the "
             f"corpus or train a new run")
    if not (folder / "meta.json").exists():
        build_data_cache(folder, documents, skipped, args)
    else:
        print(f"data: cached in {folder}")
    meta = json.loads((folder / "meta.json").read_text())
    # This scan's, not the cache's: the cache's key covers the UTF-8 files only.
    meta["skipped_not_utf8"] = skipped
    meta["cache"] = folder.name  # names the corpus's content and the data settings: what --resume checks
    if skipped:
        print(f"data: {len(skipped)} file(s) left out for not being UTF-8: {', '.join(skipped[:3])}"
              + (", ..." if len(skipped) > 3 else ""))
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    streams = {split: np.fromfile(folder / f"{split}.bin", dtype=np.uint32) for split in ("train", "validation")}
    return tokenizer, streams, meta


def build_data_cache(folder, documents, skipped, args):
    start = time.perf_counter()
    train, validation = split_documents(documents, args.val_fraction)
    print(f"data: training a {args.vocab_size}-token BPE tokenizer on {len(train)} files, tokenizing "
          f"{len(documents)} files ...")
    tokenizer = train_tokenizer([text for _, text in train], args.vocab_size)
    # Built in a temporary folder and renamed into place: a run stopped half-way leaves no cache
    # that looks complete, and of two runs building the same cache at once, the first one wins.
    building = folder.with_name(f"{folder.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    tokenizer.save_pretrained(building / "tokenizer")
    is_stdlib = args.corpus.resolve() == Path(sysconfig.get_paths()["stdlib"]).resolve()
    corpus_name = f"the Python {platform.python_version()} standard library" if is_stdlib else args.corpus.name
    meta = {"corpus": str(args.corpus.resolve()), "corpus_name": corpus_name, "pattern": args.pattern,
            "val_fraction": args.val_fraction, "vocab_size": len(tokenizer), "skipped_not_utf8": skipped, "splits": {}}
    for split, docs in (("train", train), ("validation", validation)):
        stream = encode_documents(tokenizer, [text for _, text in docs])
        stream.tofile(building / f"{split}.bin")
        meta["splits"][split] = {"files": len(docs), "bytes": sum(len(text.encode()) for _, text in docs),
                                 "tokens": len(stream) - 2 * len(docs)}  # without <bos> and <eos>
    meta["validation_files"] = [relative for relative, _ in validation]
    (building / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        building.rename(folder)
    except OSError:  # another run finished the same cache first
        shutil.rmtree(building)
    print(f"data: built {folder} in {time.perf_counter() - start:.0f} s")


# ---------------------------------------------------------------------------------------------
# Batches


def packed_batch(rows, device):
    """Rows of token ids laid end to end in one packed row: input_ids, position_ids (restarting at
    0 at each row start and each <bos>, which starts every document) and labels (-100 at every
    sequence start, the one token nothing predicts), each [1, total length]; and cu_seq_lens_q."""
    input_ids = torch.from_numpy(np.concatenate(rows).astype(np.int64))
    index = torch.arange(len(input_ids))
    starts = input_ids == BOS_ID
    starts[torch.tensor([0] + [len(row) for row in rows[:-1]]).cumsum(0)] = True
    position_ids = index - torch.where(starts, index, 0).cummax(0).values
    labels = input_ids.masked_fill(position_ids == 0, -100)
    batch = {"input_ids": input_ids[None], "position_ids": position_ids[None], "labels": labels[None]}
    return on_device(with_sequence_starts(batch), device)


def with_sequence_starts(batch):
    """The batch with cu_seq_lens_q, its sequences' bounds, found here on the host from its
    position_ids: the model would otherwise find them on the device, a sync per step and a break
    in a torch.compile graph."""
    position_ids = batch["position_ids"][0]
    starts = (position_ids == 0).nonzero().flatten()
    return {**batch, "cu_seq_lens_q": torch.cat([starts, starts.new_tensor([len(position_ids)])])}


def on_device(batch, device):
    return {name: tensor.to(device) for name, tensor in batch.items()}


class TrainBatches:
    """Batch `step` of a run: rows taken in an order drawn afresh each epoch from the seed. A pure
    function of the step, so a checkpoint's step is also its position in the data, whatever the
    number of processes. Of `num_processes`, process `rank` takes the rank-th run of
    batch_size / num_processes consecutive rows."""

    def __init__(self, stream, seq_len, batch_size, seed, device, rank=0, num_processes=1):
        num_rows = len(stream) // seq_len
        if num_rows == 0:
            fail(f"the train split has {len(stream)} tokens, fewer than --seq-len {seq_len}")
        self.rows = stream[:num_rows * seq_len].reshape(num_rows, seq_len)
        self.batch_size, self.seed, self.device = batch_size, seed, device
        share = batch_size // num_processes * seq_len  # tokens: every row is seq_len long
        self.share = slice(rank * share, (rank + 1) * share)
        self.epoch = self.permutation = None

    def order(self, epoch):
        if epoch != self.epoch:
            self.epoch, self.permutation = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return self.permutation

    def __call__(self, step):
        """This process's share of batch `step`, and the number of tokens the whole batch predicts
        (each process holds the whole stream, so it counts them without asking the others)."""
        positions = range(step * self.batch_size, (step + 1) * self.batch_size)
        rows = [self.rows[self.order(epoch)[i]] for epoch, i in (divmod(p, len(self.rows)) for p in positions)]
        batch = packed_batch(rows, torch.device("cpu"))
        num_predicted = int((batch["labels"] != -100).sum())
        share = {name: batch[name][:, self.share] for name in ("input_ids", "position_ids", "labels")}
        return on_device(with_sequence_starts(share), self.device), num_predicted


def validation_batches(stream, seq_len, batch_size, max_tokens, device, rank=0, num_processes=1):
    """The validation stream in order, cut into rows of seq_len (the last one shorter), batch_size
    rows a batch; only its first max_tokens tokens when max_tokens > 0. Of
    `num_processes`, process `rank` takes its share of each batch's rows as in training. A process
    left without rows (the last batch can be short) gets the batch's first token, which predicts
    nothing: every process runs the same number of forwards, as FSDP's weight gathering needs."""
    stream = stream[:max_tokens] if max_tokens else stream
    rows = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
    share = batch_size // num_processes
    batches = []
    for i in range(0, len(rows), batch_size):
        own_rows = rows[i:i + batch_size][rank * share:(rank + 1) * share]
        batches.append(packed_batch(own_rows or [rows[i][:1]], device))
    return batches


# ---------------------------------------------------------------------------------------------
# Model, optimizer, schedule


def model_config(args, vocab_size):
    """The model's config from the flags, through the remote-code loader as a Hub user gets it;
    ValueError names a bad flag's field."""
    config_class = get_class_from_dynamic_module("configuration_reslin.ResLinConfig", str(REPO))
    full_attention = set(args.full_attention_layers or ())
    layer_types = ["full_attention" if index in full_attention else "linear_attention" for index in range(args.layers)]
    return config_class(layer_types=layer_types, sliding_window=args.sliding_window,
        name_or_path=str(REPO), vocab_size=vocab_size, attn_type=args.attn_type, hidden_size=args.hidden_size,
        num_hidden_layers=args.layers, num_heads=args.heads, head_dim=args.head_dim,
        intermediate_size=args.intermediate_size, tie_word_embeddings=args.tie_word_embeddings,
        kernel_backend=args.kernel_backend, residual_clip=args.residual_clip, max_position_embeddings=args.seq_len,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def build_model(args, vocab_size):
    """A fresh model from the flags (checked by parse_args)."""
    config = model_config(args, vocab_size)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True)


def build_optimizer(model, args, device):
    """AdamW; weight decay only on matrices (and convolution taps) not marked _no_weight_decay."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.dim() >= 2 and not getattr(parameter, "_no_weight_decay", False):
            decay.append(parameter)
        else:
            no_decay.append(parameter)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2), fused=device.type == "cuda")


def learning_rate(peak, step, progress, warmup_steps, min_lr_ratio):
    """Linear warm-up over the first warmup_steps, times a cosine from the peak to
    min_lr_ratio * peak over the run's progress (a fraction of --max-steps or of --time-budget)."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return peak * warmup * (min_lr_ratio + (1 - min_lr_ratio) * cosine)


def run_progress(args, step, seconds):
    fractions = [step / args.max_steps] if args.max_steps else []
    if args.time_budget:
        fractions.append(seconds / (60 * args.time_budget))
    return max(fractions)


@torch.no_grad()
def evaluate(model, batches, token_bytes, autocast, accelerator):
    """Validation loss (nats per predicted token) and bits per byte over `batches`, this process's
    share of them, summed over all processes."""
    model.eval()
    nats, tokens, num_bytes = 0.0, 0, 0
    for batch in batches:
        with autocast:
            loss = model(**batch, use_cache=False).loss
        targets = batch["labels"][batch["labels"] != -100].cpu().numpy()
        if len(targets):  # the loss of a batch that predicts nothing is NaN
            nats += loss.item() * len(targets)
        tokens += len(targets)
        num_bytes += int(token_bytes[targets].sum())
    model.train()
    sums = torch.tensor([nats, tokens, num_bytes], dtype=torch.float64, device=batch["input_ids"].device)
    nats, tokens, num_bytes = accelerator.reduce(sums, "sum").tolist()
    tokens, num_bytes = int(tokens), int(num_bytes)
    return {"loss": nats / tokens, "bits_per_byte": nats / math.log(2) / num_bytes, "tokens": tokens,
            "bytes": num_bytes}


# ---------------------------------------------------------------------------------------------
# Checkpoints and output


def full_training_state(model, optimizer):
    """(weights, optimizer state), whole and on the CPU of the main process (empty elsewhere); the
    optimizer's state is keyed by parameter name. Every process must call it: FSDP gathers its
    shards. The same for one process, DDP and FSDP, so a checkpoint resumes under any of them."""
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_training_state(model, optimizer, checkpoint):
    """The inverse of full_training_state, in every process from the whole checkpoint (FSDP keeps
    each process's shard of it)."""
    checkpoint = with_current_names(checkpoint)
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"],
                   options=StateDictOptions(full_state_dict=True))


def save_checkpoint(path, model_state, optimizer_state, state):
    """The whole training state; written to a temporary file and renamed, so a stop while
    writing leaves the previous checkpoint whole."""
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent writers (compare_rules --jobs)
    torch.save({"model": model_state, "optimizer": optimizer_state, "rng": rng, **state}, temporary)
    os.replace(temporary, path)


def load_checkpoint(path, args):
    if not path.is_file():
        fail(f"--resume: {path.parent} holds no checkpoint ({CHECKPOINT}): nothing to resume")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        fail(f"--resume: {path} is not a readable checkpoint ({type(error).__name__}: {error})")
    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "rng", "step", "args"} <= checkpoint.keys():
        fail(f"--resume: {path} is not a train.py checkpoint")
    if any(not isinstance(name, str) for name in checkpoint["optimizer"].get("state", {})):
        fail(f"--resume: {path} comes from a train.py older than its multi-process version (its optimizer state "
             f"is keyed by position, not by parameter name): continue that run with the train.py that started it")
    saved = checkpoint["args"]
    changed = [f"--{name.replace('_', '-')} {value} (checkpoint: {saved.get(name)})"
               for name, value in saved_args(args).items()
               if name not in CHANGEABLE_ON_RESUME and value != saved.get(name)]
    if changed:
        fail("--resume continues a run with its own settings; these differ from the checkpoint's: "
             + ", ".join(changed))
    return checkpoint


def with_current_names(checkpoint):
    """A checkpoint saved under earlier parameter names (the modeling file's LEGACY_KEYS: the input
    embedding was `model.embeddings`) with today's, in the weights and in the optimizer's state
    keyed by them. LEGACY_KEYS comes from the remote-code module the model was built from, which
    train.py imports only through the loader (a second, direct import costs ~2 s at every start)."""
    legacy_keys = get_class_from_dynamic_module("modeling_reslin.LEGACY_KEYS", str(REPO))

    def current(name):
        for pattern, replacement in legacy_keys.items():
            name = re.sub(pattern, replacement, name)
        return name

    optimizer = checkpoint["optimizer"]
    checkpoint["model"] = {current(name): value for name, value in checkpoint["model"].items()}
    optimizer["state"] = {current(name): value for name, value in optimizer.get("state", {}).items()}
    for group in optimizer.get("param_groups", []):
        group["params"] = [current(name) for name in group["params"]]
    return checkpoint


def saved_args(args):
    return {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()}


def write_json(path, data):
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent writers (compare_rules --jobs)
    temporary.write_text(json.dumps(data, indent=1))
    os.replace(temporary, path)


def device_description(device, accelerator):
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, torch threads: {torch.get_num_threads()})"
    if accelerator.num_processes == 1:
        return name
    return f"{accelerator.num_processes} processes, {parallelism(accelerator)}, each on {name}"


def parallelism(accelerator):
    return "FSDP2" if accelerator.distributed_type == DistributedType.FSDP else "DDP"


def model_card(args, config, metrics):
    meta, final = metrics["data"], metrics["final_validation"]
    train, validation = meta["splits"]["train"], meta["splits"]["validation"]
    commands = "\n".join(metrics["commands"])
    full_attention = [index for index, kind in enumerate(config.layer_types) if kind == "full_attention"]
    hybrid = (f"; softmax attention in blocks {', '.join(map(str, full_attention))}"
              + (f", a window of {config.sliding_window} tokens" if config.sliding_window else "")
              if full_attention else "")
    return f"""---
library_name: transformers
pipeline_tag: text-generation
license: apache-2.0
tags:
  - custom_code
  - linear-attention
---

# ResLin {config.attn_type} ({metrics['parameters']:,} parameters) pretrained on {meta['corpus_name']}

A {config.num_hidden_layers}-layer ResLin causal LM (`attn_type="{config.attn_type}"`, hidden size
{config.hidden_size}, {config.num_heads} heads of {config.head_dim}{hybrid}) trained from scratch by `train.py`.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # it reads config.json too
```

## Training data

Source: {meta['corpus_name']} (`{meta['corpus']}`): every `{meta['pattern']}` file, folders named
site-packages skipped, each file one document; {len(meta['skipped_not_utf8'])} files that are not UTF-8 were
left out. Split by file: the files whose path hashes lowest (a share of {meta['val_fraction']}, at least
one) are held out for validation; `metrics.json` lists them.

| split | files | bytes | tokens |
|---|---|---|---|
| train | {train['files']} | {train['bytes']:,} | {train['tokens']:,} |
| validation | {validation['files']} | {validation['bytes']:,} | {validation['tokens']:,} |

Tokenizer: byte-level BPE with {meta['vocab_size']} tokens trained on the train split
({train['bytes'] / train['tokens']:.2f} bytes per token there); `<pad>`, `<bos>`, `<eos>` are ids 0, 1, 2.
A document is `<bos>` text `<eos>`; the tokenizer puts `<bos>` before what it encodes.

## Training

- {metrics['step']} steps of {args.batch_size} x {args.seq_len} tokens, packed (sequences never cross a
  document), {metrics['tokens_seen']:,} tokens seen (about {metrics['tokens_seen'] / train['tokens']:.2f} epochs)
- AdamW, peak learning rate {args.lr}, {args.warmup_steps} warm-up steps, cosine decay to
  {args.min_lr_ratio} x peak, weight decay {args.weight_decay}, gradient clipping {args.grad_clip},
  {metrics['precision']}, seed {args.seed}
- training time {metrics['train_seconds'] / 60:.1f} min (evaluations included) on {metrics['device']};
  {metrics['tokens_per_second']:,.0f} tokens/s in training steps (of the last session, if resumed)

## Results

On {final['scope']} ({final['tokens']:,} predicted tokens, {final['bytes']:,} bytes):
validation loss **{final['loss']:.4f}** nats per token, **{final['bits_per_byte']:.4f}** bits per byte.
Loss and validation curves are in `metrics.json`.

## Reproduce

```bash
{commands}
```
"""


def save_model_folder(out_dir, model_class, config, model_state, tokenizer, args, metrics):
    """A folder that loads through the Auto classes: save_pretrained writes the weights
    (`model_state`, whole), the config with auto_map, the generation config and the model's .py
    files. It saves through a weightless model of the trained one's class: FSDP2 gives the trained
    model a class of its own, whose torch module save_pretrained would copy in place of ours."""
    with torch.device("meta"):
        model = model_class(config)
    # A tied weight is in model_state under each of its names; FSDP gathers them into separate
    # tensors, which save_pretrained (it drops names of tensors that share memory) would all keep.
    own_names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    model.save_pretrained(out_dir, state_dict={name: value for name, value in model_state.items() if name in own_names})
    save_tokenizer(tokenizer, out_dir)
    (out_dir / "README.md").write_text(model_card(args, config, metrics))


def save_tokenizer(tokenizer, folder):
    """The tokenizer files of a model folder, as the repository's own: padding on the left, as batched
    generation needs, and tokenizer_config.json naming PreTrainedTokenizerFast, which transformers 4.57
    and 5 both have (5 writes its own name, TokenizersBackend, which 4.57 lacks). With a class named
    there, 4.57's AutoTokenizer reads no config.json, whose classes are remote code."""
    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    # (Setting tokenizer.padding_side would not do: save_pretrained writes the arguments it was loaded with.)
    tokenizer_config = {**json.loads(path.read_text()), "tokenizer_class": "PreTrainedTokenizerFast",
                        "padding_side": "left"}
    path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------


def start_accelerator(args):
    """This process's Accelerator: alone, or one of several started by accelerate launch or torchrun
    (DDP, or FSDP2 from the accelerate config)."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") != "no":
        fail("train.py applies bf16 autocast itself (--precision): launch with accelerate's mixed_precision 'no', "
             "as the configs in accelerate_configs/ do")
    # One process trains on --device, whichever GPU it names: no device placement by accelerate, and
    # no cpu switch, which only picks gloo for several processes (and which accelerate refuses after
    # a run on a GPU in the same Python process).
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(cpu=several and torch.device(args.device).type == "cpu", mixed_precision="no",
                              device_placement=False)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not accelerator.is_fsdp2:
        fail(f"the accelerate config asks for FSDP, but accelerate set up {accelerator.distributed_type.value} here: "
             f"train.py takes FSDP2 (fsdp_version: 2), which accelerate runs on GPUs only (on CPUs it would "
             f"silently train with DDP)")
    if accelerator.num_processes > 1 and torch.device(args.device).index is not None:
        fail(f"--device {args.device}: each of several processes takes the GPU of its LOCAL_RANK; pass --device cuda")
    if args.batch_size % accelerator.num_processes:
        fail(f"--batch-size {args.batch_size} is the global batch, split evenly across the processes: it must be a "
             f"multiple of the number of processes, {accelerator.num_processes}")
    return accelerator


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    accelerator = start_accelerator(args)
    # Every process runs the whole loop; the main one reports, the others would repeat its lines.
    with open(os.devnull, "w") as sink:
        with contextlib.redirect_stdout(sys.stdout if accelerator.is_main_process else sink):
            return train(args, argv, accelerator)


def train(args, argv, accelerator):
    checkpoint_path = args.out_dir / CHECKPOINT
    checkpoint = load_checkpoint(checkpoint_path, args) if args.resume else None
    if checkpoint is None and checkpoint_path.exists():
        fail(f"{args.out_dir} already holds a run ({CHECKPOINT}): pass --resume to continue it, or choose "
             f"another --out-dir")
    # A model folder (one whose checkpoint was deleted, or one that save_pretrained wrote) that this run's
    # would replace; other files, such as a benchmark's records, may share the folder.
    found = [name for name in MODEL_FOLDER_FILES if checkpoint is None and (args.out_dir / name).exists()]
    if found:
        fail(f"--out-dir {args.out_dir} holds a model folder ({', '.join(found)}) but no run to resume ({CHECKPOINT}): "
             f"this run's model folder would replace it; choose another --out-dir")
    rank, num_processes = accelerator.process_index, accelerator.num_processes
    device = accelerator.device if num_processes > 1 else torch.device(args.device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    # The main process first: it builds the data cache and copies the model's code into the
    # remote-code module cache, then the others read them.
    with accelerator.main_process_first():
        tokenizer, streams, meta = prepare_data(
            args, resumed_cache=None if checkpoint is None else checkpoint["metrics"]["data"].get("cache"))
        model = build_model(args, len(tokenizer)).to(device)
    for split, figures in meta["splits"].items():
        print(f"data: {split}: {figures['files']} files, {figures['bytes']:,} bytes, {figures['tokens']:,} tokens "
              f"({figures['bytes'] / figures['tokens']:.2f} bytes per token)")
    token_bytes = token_byte_lengths(tokenizer)
    train_batches = TrainBatches(streams["train"], args.seq_len, args.batch_size, args.seed, device, rank,
                                 num_processes)
    validation_subset = validation_batches(streams["validation"], args.seq_len, args.batch_size, args.eval_tokens,
                                           device, rank, num_processes)
    whole_split = not args.eval_tokens or args.eval_tokens >= len(streams["validation"])
    validation_scope = ("the whole validation split" if whole_split
                        else f"the first {args.eval_tokens:,} tokens of the validation split")
    if args.max_steps and args.warmup_steps > args.max_steps:
        print(f"note: --warmup-steps {args.warmup_steps} is longer than the run (--max-steps {args.max_steps}): the "
              f"learning rate stays below {args.max_steps / args.warmup_steps:.0%} of --lr {args.lr}")

    if args.gradient_checkpointing:
        # transformers 5.24 deprecates gradient_checkpointing_enable for activation_checkpointing_enable:
        # take whichever this version has.
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    if args.compile:
        # Block by block: compiling the whole 8-layer model had not finished its first step after
        # 200 s on the H200. In place, so that the state dict's names stay the model's.
        model.compile_blocks(backend=args.compile)
    optimizer = build_optimizer(model, args, device)
    parameters = sum(p.numel() for p in model.parameters())
    model_class = type(model)
    # DDP wraps the model, FSDP2 shards it in place (each ResLinBlock a unit); both with the optimizer.
    model, optimizer = accelerator.prepare(model, optimizer)
    print(f"model: {args.attn_type}, {parameters:,} parameters ({parameters / 1e6:.1f}M), "
          f"{args.batch_size * args.seq_len:,} tokens per step, {'bf16 autocast' if bf16 else 'fp32'} on {device}"
          + (f", {num_processes} processes ({parallelism(accelerator)})" if num_processes > 1 else ""))

    command = shlex.join(["python", "train.py", *argv])
    if num_processes > 1:
        command += f"  # in each of {num_processes} processes ({parallelism(accelerator)})"
    if checkpoint is None:
        step, seconds = 0, 0.0
        metrics = {"args": saved_args(args), "parameters": parameters, "data": meta, "commands": [command],
                   "train": [], "validation": []}
    else:
        load_training_state(model, optimizer.optimizer, checkpoint)
        random.setstate(checkpoint["rng"]["python"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if checkpoint["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
        step, seconds, metrics = checkpoint["step"], checkpoint["train_seconds"], checkpoint["metrics"]
        metrics["commands"].append(command)
        print(f"resumed from {checkpoint_path} at step {step}")
        if run_progress(args, step, seconds) >= 1:
            print(f"note: step {step} already ends the run by --max-steps / --time-budget: no step trains; the final "
                  f"validation runs and the model is written again (raise them to train on)")
    metrics.update(device=device_description(device, accelerator), precision="bf16 autocast" if bf16 else "fp32")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def validate(batches, label):
        result = {"step": step, "tokens_seen": step * args.batch_size * args.seq_len,
                  **evaluate(model, batches, token_bytes, autocast, accelerator)}
        tqdm.write(f"step {step}: {label} loss {result['loss']:.4f}, {result['bits_per_byte']:.4f} bits per byte")
        return result

    def checkpoint_now():
        """Returns the whole weights in the main process."""
        metrics.update(step=step, train_seconds=seconds, tokens_seen=step * args.batch_size * args.seq_len)
        model_state, optimizer_state = full_training_state(model, optimizer.optimizer)
        if accelerator.is_main_process:
            save_checkpoint(checkpoint_path, model_state, optimizer_state,
                            {"step": step, "train_seconds": seconds, "args": saved_args(args), "metrics": metrics})
            write_json(args.out_dir / "metrics.json", metrics)
        return model_state

    def elapsed():
        """Seconds of training by the main process's clock: all processes must take the same
        learning rates and validate, save and stop at the same steps. One process needs no device
        round trip for it."""
        seconds = start_seconds + time.perf_counter() - session_start
        if num_processes == 1:
            return seconds
        return broadcast(torch.tensor([seconds], dtype=torch.float64, device=device)).item()

    if step == 0:
        metrics["validation"].append(validate(validation_subset, "validation"))
    session_start, start_seconds = time.perf_counter(), seconds
    session_tokens, session_step_seconds = 0, 0.0  # for the throughput: training steps only
    # Into a log file rather than a terminal, a line every 30 s, not ten a second.
    progress_bar = tqdm(total=args.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                        mininterval=0.1 if sys.stderr.isatty() else 30, disable=not accelerator.is_main_process)
    while (progress := run_progress(args, step, seconds)) < 1:
        step_start = time.perf_counter()
        lr = learning_rate(args.lr, step, progress, args.warmup_steps, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch, num_predicted = train_batches(step)
        with autocast:
            # This process's sum of token losses over the whole batch's count of predicted tokens,
            # times the number of processes, since DDP and FSDP average the gradients over them: the
            # gradient is that of the batch's mean token loss, as in one process.
            loss = model(**batch, num_items_in_batch=num_predicted).loss * num_processes
        accelerator.backward(loss)
        if args.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The batch's mean token loss; .item() waits for the step, so the time below is the step's.
        loss = accelerator.reduce(loss.detach(), "mean").item()
        step += 1
        session_step_seconds += time.perf_counter() - step_start
        session_tokens += args.batch_size * args.seq_len
        metrics["tokens_per_second"] = session_tokens / session_step_seconds
        seconds = elapsed()
        metrics["train"].append({"step": step, "loss": loss, "lr": lr, "seconds": round(seconds, 3)})
        progress_bar.update()
        progress_bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{metrics['tokens_per_second']:,.0f}")
        if not math.isfinite(loss):
            fail(f"the training loss is {loss} at step {step}: lower --lr or raise --warmup-steps")
        finished = run_progress(args, step, seconds) >= 1
        if step % args.eval_interval == 0 and not finished:
            metrics["validation"].append(validate(validation_subset, "validation"))
        if step % args.save_interval == 0 and not finished:
            checkpoint_now()
        seconds = elapsed()  # evaluations count against the budget
    progress_bar.close()

    final = {**validate(validation_subset, f"final validation ({validation_scope})"), "scope": validation_scope}
    metrics["final_validation"] = final
    model_state = checkpoint_now()
    if accelerator.is_main_process:
        save_model_folder(args.out_dir, model_class, accelerator.unwrap_model(model).config, model_state, tokenizer,
                          args, metrics)
    print(f"saved {args.out_dir}: {step} steps, {metrics['tokens_seen']:,} tokens in {seconds / 60:.1f} min, "
          f"validation loss {final['loss']:.4f}, {final['bits_per_byte']:.4f} bits per byte")
    return metrics


def end_process():
    """Ends this process of a run whose files are all written. With several processes: a barrier,
    so that no process closes its connections while another still uses them; the group destroyed;
    then os._exit(0) once stdout and stderr are flushed. Left to the interpreter's exit, DDP's
    reducer and gloo's threads have aborted finished runs ("terminate called without an active
    exception": the Trainer DDP test one run in three before the group was destroyed here, and the
    FSDP2 test once in CI after that); os._exit skips that teardown, which has nothing left
    to do. Not in main: tests/launch_train.py uses the model and the group after it."""
    gc.collect()  # the model first: DDP's reducer holds the group
    state = PartialState()
    several = state.num_processes > 1
    if several:
        state.wait_for_everyone()
    state.destroy_process_group()
    if several:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
    end_process()
