"""train.py on a CPU: a tiny model (torch kernels) on a tiny corpus written to a temporary folder.

One 30-step run (`trained_run`) serves as the reference of several tests: its loss falls, its
output folder loads through the Auto classes, and an interrupted copy of it resumed from its
checkpoint reproduces it bit for bit.
"""

import json
import math
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from conftest import REPO_ROOT, stop_right_after

# Repetitive code, so that a tiny model learns it within a few dozen steps.
CORPUS = {f"module_{i}.py": "".join(f"def add_{i}_{j}(a, b):\n    return a + b * {j}  # café\n\n" for j in range(40))
          for i in range(6)}
CORPUS["package/special.py"] = 'END = "<eos>"  # a literal special token is text\n\tx = "中文"   \n'
CORPUS["package/site-packages/installed.py"] = "import this\n"  # not part of the corpus
NOT_UTF8 = "latin1.py"  # skipped
ATTN_TYPES = tuple(train.ATTN_PRESETS)
TINY_MODEL = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--head-dim", "16", "--intermediate-size", "64",
              "--kernel-backend", "torch"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for name, text in CORPUS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    (folder / NOT_UTF8).write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    return folder


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def tiny_run_args(corpus, data_dir, out_dir, *extra):
    return ["--corpus", str(corpus), "--data-dir", str(data_dir), "--out-dir", str(out_dir), "--vocab-size", "300",
            *TINY_MODEL, "--seq-len", "64", "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "5",
            "--eval-interval", "10", "--eval-tokens", "256", "--save-interval", "10", *extra]


REFERENCE_RUN = ("--max-steps", "30")  # checkpoints at steps 10, 20 and 30


@pytest.fixture(scope="session")
def trained_run(corpus, data_dir, tmp_path_factory):
    """(out_dir, metrics) of the reference run."""
    out_dir = tmp_path_factory.mktemp("run") / "out"
    return out_dir, train.main(tiny_run_args(corpus, data_dir, out_dir, *REFERENCE_RUN))


def test_corpus_split_and_tokenizer(corpus, data_dir):
    args = train.parse_args(tiny_run_args(corpus, data_dir, "unused", "--max-steps", "1"))
    tokenizer, streams, meta = train.prepare_data(args)
    assert meta["skipped_not_utf8"] == [NOT_UTF8]
    assert meta["splits"]["train"]["files"] + meta["splits"]["validation"]["files"] == len(CORPUS) - 1
    assert meta["splits"]["validation"]["files"] == 1 and len(meta["validation_files"]) == 1
    # The repository's config.json and generate.py expect pad, bos, eos = 0, 1, 2.
    repo_config = json.loads((train.REPO / "config.json").read_text())
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        repo_config["pad_token_id"], repo_config["bos_token_id"], repo_config["eos_token_id"])
    assert len(tokenizer) == meta["vocab_size"] <= 300

    text = 'class A:\n\tdef f(self):  \n        return "é中文 🐍"\n\n\n'
    ids = tokenizer(text).input_ids
    assert ids[0] == train.BOS_ID  # as every document started in training
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # A literal "<eos>" in a file is text in the training data, not the end of the document.
    special = train.encode_documents(tokenizer, [CORPUS["package/special.py"]])
    assert special[0] == train.BOS_ID and special[-1] == train.EOS_ID
    assert set(special[1:-1].tolist()).isdisjoint({train.PAD_ID, train.BOS_ID, train.EOS_ID})
    assert tokenizer.decode(special[1:-1].tolist()) == CORPUS["package/special.py"]

    # Token byte lengths add up to the split's bytes: the bits per byte are exact.
    token_bytes = train.token_byte_lengths(tokenizer)
    for split, stream in streams.items():
        assert token_bytes[stream].sum() == meta["splits"][split]["bytes"]
        assert len(stream) == meta["splits"][split]["tokens"] + 2 * meta["splits"][split]["files"]


def test_split_depends_on_paths_only():
    documents = [(f"dir/file_{i}.py", "x") for i in range(40)]
    train_docs, validation = train.split_documents(documents, 0.1)
    assert len(validation) == 4 and len(train_docs) == 36
    assert train.split_documents(documents[::-1], 0.1) == (train_docs, validation)
    assert [len(split) for split in train.split_documents(documents[:2], 0.01)] == [1, 1]


def test_default_corpus_is_the_standard_library():
    args = train.parse_args(["--max-steps", "1"])
    assert args.corpus == Path(sysconfig.get_paths()["stdlib"]) and args.pattern == "*.py"
    documents, _ = train.corpus_documents(args.corpus / "json", args.pattern)  # a small part of it, for speed
    assert "__init__.py" in {path for path, _ in documents}


def test_packed_batch_restarts_positions_and_masks_labels():
    rows = [torch.tensor([5, 6, 2, 1, 7, 8]).numpy(), torch.tensor([9, 2, 1, 3]).numpy()]  # 1 = <bos>, 2 = <eos>
    batch = train.packed_batch(rows, torch.device("cpu"))
    assert batch["input_ids"].tolist() == [[5, 6, 2, 1, 7, 8, 9, 2, 1, 3]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 0, 1]]
    # A sequence's first token (a row start or a <bos>) is predicted by nothing before it.
    assert batch["labels"].tolist() == [[-100, 6, 2, -100, 7, 8, -100, 2, -100, 3]]
    # The sequences' bounds, found on the host: the model needs no device sync for them.
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 6, 8, 10]


def test_validation_reads_exactly_eval_tokens():
    """--eval-tokens that is no multiple of --seq-len ends inside a row: the last row is cut there."""
    stream = torch.arange(3, 23).numpy()
    batches = train.validation_batches(stream, 4, 2, 5, torch.device("cpu"))
    assert [batch["input_ids"].tolist() for batch in batches] == [[[3, 4, 5, 6, 7]]]
    assert sum(batch["input_ids"].shape[1] for batch in train.validation_batches(stream, 4, 2, 0, "cpu")) == 20


HYBRID = ("--attn-type", "rdn", "--full-attention-layers", "1", "--sliding-window", "16")


@pytest.mark.parametrize("model_flags", [("--attn-type", attn_type) for attn_type in ATTN_TYPES] + [HYBRID],
                         ids=[*ATTN_TYPES, "hybrid"])
@torch.no_grad()
def test_packed_training_batch_equals_each_sequence_alone(corpus, data_dir, model_flags):
    """A training batch's logits are those of each of its sequences run alone (no state,
    convolution window or attention crosses a document or row boundary), and so is its loss."""
    args = train.parse_args(tiny_run_args(corpus, data_dir, "unused", "--max-steps", "1", *model_flags,
                                          "--seq-len", "48"))
    tokenizer, streams, _ = train.prepare_data(args)
    model = train.build_model(args, len(tokenizer)).eval()
    # Rows holding a document's end and the next one's start, and rows that cut a document.
    document_starts = (streams["train"] == train.BOS_ID).nonzero()[0]
    rows = [streams["train"][i:i + 48] for i in (0, document_starts[1] - 10, document_starts[2] - 40)]
    batch = train.packed_batch(rows, torch.device("cpu"))
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    assert len(starts) > 4
    packed = model(**batch)
    nats = 0.0
    for start, end in zip(starts, starts[1:]):
        alone = model(batch["input_ids"][:, start:end], labels=batch["input_ids"][:, start:end])
        torch.testing.assert_close(packed.logits[:, start:end], alone.logits, rtol=0, atol=1e-5)
        if end - start > 1:  # a one-token sequence predicts nothing
            nats += alone.loss.item() * (end - start - 1)
    predicted = (batch["labels"] != -100).sum().item()
    assert predicted == batch["input_ids"].shape[1] - (len(starts) - 1)
    assert packed.loss.item() == pytest.approx(nats / predicted, rel=1e-5)


def test_training_lowers_the_loss(trained_run):
    _, metrics = trained_run
    losses = [entry["loss"] for entry in metrics["train"]]
    assert len(losses) == 30 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    first, final = metrics["validation"][0], metrics["final_validation"]
    assert first["step"] == 0 and final["step"] == 30
    assert final["loss"] < 0.7 * first["loss"]
    assert [entry["step"] for entry in metrics["validation"]] == [0, 10, 20]  # the last one is the final one
    # Every validation reads the same first --eval-tokens 256 tokens, the final one included.
    assert final["tokens"] == first["tokens"] < 256 and final["scope"] == "the first 256 tokens of the validation split"


def test_output_folder_loads_and_generates(trained_run):
    out_dir, metrics = trained_run
    model = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True).eval()
    # trust_remote_code: AutoTokenizer reads config.json, whose class is remote code.
    tokenizer = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=True)
    assert type(model).__name__ == "ResLinForCausalLM"
    assert model.config.auto_map["AutoModelForCausalLM"] == "modeling_reslin.ResLinForCausalLM"
    assert {"modeling_reslin.py", "configuration_reslin.py", "cache_reslin.py", "kernels_reslin.py",
            "generation_config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {
        path.name for path in out_dir.iterdir()}
    checkpoint = torch.load(out_dir / train.CHECKPOINT, weights_only=True)
    for name, tensor in load_file(out_dir / "model.safetensors").items():
        assert torch.equal(tensor, checkpoint["model"][name])

    prompt = tokenizer("def add_1_3(a, b):\n", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert output.shape[1] > prompt.input_ids.shape[1]
    assert isinstance(tokenizer.decode(output[0], skip_special_tokens=True), str)

    # Bits per byte = nats per token * tokens / bytes / ln 2.
    final = metrics["final_validation"]
    assert final["bits_per_byte"] == pytest.approx(final["loss"] * final["tokens"] / final["bytes"] / math.log(2))
    saved = json.loads((out_dir / "metrics.json").read_text())
    assert saved["final_validation"] == final and saved["step"] == 30
    card = (out_dir / "README.md").read_text()
    for fact in (f"{final['loss']:.4f}", f"{final['bits_per_byte']:.4f}", "7,680 tokens seen", metrics["commands"][0],
                 "library_name: transformers", f"On the first 256 tokens of the validation split ({final['tokens']} "):
        assert fact in card
    # The tokenizer as the repository's: a class that transformers 4.57 knows too, padding on the left.
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast" and tokenizer.padding_side == "left"


def test_main_job_streams_a_completion_of_a_trained_folder(trained_run):
    """generate.py --model FOLDER completes the prompt through the folder's tokenizer (the
    repository's own model: tests/test_shipped_model.py)."""
    result = subprocess.run([sys.executable, str(REPO_ROOT / "generate.py"), "def add_1_3(a, b):\n",
                             "--max-new-tokens", "6", "--device", "cpu", "--model", str(trained_run[0])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def add_1_3(a, b):\n") and len(result.stdout) > len("def add_1_3(a, b):\n")
    assert "<eos>" not in result.stdout and " new tokens in " in result.stderr


def test_main_job_refuses_an_unusable_device_or_a_folder_without_tokenizer(trained_run, tmp_path, capsys):
    """generate.py: one line naming the flag, not a traceback from inside torch or the tokenizer."""
    import generate

    without_tokenizer = tmp_path / "model_only"
    without_tokenizer.mkdir()
    shutil.copy(trained_run[0] / "config.json", without_tokenizer)
    for flags, message in ((["--device", "xla"], "--device xla: this PyTorch cannot use it here"),
                           (["--model", str(without_tokenizer)], "the folder holds a model but no tokenizer")):
        with pytest.raises(SystemExit):
            generate.main(["def f():", "--model", str(trained_run[0]), *flags])
        assert message in capsys.readouterr().err


def test_main_job_reads_a_special_token_spelled_in_the_prompt_as_text(trained_run):
    import generate

    tokenizer = AutoTokenizer.from_pretrained(trained_run[0], trust_remote_code=True)
    ids = generate.encode_prompt(tokenizer, CORPUS["package/special.py"])
    assert ids[0] == train.BOS_ID and train.EOS_ID not in ids
    assert ids[1:] == train.encode_documents(tokenizer, [CORPUS["package/special.py"]])[1:-1].tolist()


def test_main_job_completes_with_another_causal_lm(trained_run, tmp_path, capsys):
    """generate.py --model with a folder of another architecture (here GPT-2) completes the prompt."""
    import generate
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(trained_run[0], trust_remote_code=True)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, bos_token_id=train.BOS_ID,
                        eos_token_id=train.EOS_ID, pad_token_id=train.PAD_ID)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generate.main(["def f():", "--model", str(tmp_path), "--max-new-tokens", "2", "--device", "cpu"])
    captured = capsys.readouterr()
    assert captured.out.startswith("def f():") and "gpt2: 1 layers" in captured.err
    # A tokenizer that adds no <bos> (as GPT-2's): an empty prompt starts from its <bos>.
    tokenizer.backend_tokenizer.post_processor = None
    assert tokenizer("").input_ids == [] and generate.encode_prompt(tokenizer, "") == [train.BOS_ID]


@pytest.mark.parametrize("legacy_names", [False, True], ids=["", "checkpoint-under-earlier-names"])
def test_resumed_run_reproduces_the_uninterrupted_run(corpus, data_dir, trained_run, tmp_path, monkeypatch, capsys,
                                                       legacy_names):
    reference_dir, reference = trained_run
    argv = tiny_run_args(corpus, data_dir, tmp_path / "out", *REFERENCE_RUN)
    stop_right_after(monkeypatch, train, "save_checkpoint")  # the checkpoint of step 10
    with pytest.raises(KeyboardInterrupt):
        train.main(argv)
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="already holds a run"):
        train.main(argv)
    if legacy_names:  # as saved before the input embedding took transformers' name
        path = tmp_path / "out" / train.CHECKPOINT
        checkpoint = torch.load(path, weights_only=True)
        earlier = lambda name: name.replace("model.embed_tokens.", "model.embeddings.")
        assert any(name.startswith("model.embed_tokens.") for name in checkpoint["optimizer"]["state"])
        checkpoint["model"] = {earlier(name): value for name, value in checkpoint["model"].items()}
        checkpoint["optimizer"]["state"] = {earlier(name): value for name, value in checkpoint["optimizer"]["state"].items()}
        for group in checkpoint["optimizer"]["param_groups"]:
            group["params"] = [earlier(name) for name in group["params"]]
        torch.save(checkpoint, path)
    resumed = train.main(argv + ["--resume"])

    assert [entry["loss"] for entry in resumed["train"]] == [entry["loss"] for entry in reference["train"]]
    assert resumed["validation"] == reference["validation"]
    assert resumed["final_validation"] == reference["final_validation"]
    assert len(resumed["commands"]) == 2 and resumed["commands"][1].endswith("--resume")
    weights = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in load_file(reference_dir / "model.safetensors").items():
        assert torch.equal(weights[name], tensor), name

    capsys.readouterr()
    again = train.main(argv + ["--resume"])  # a finished run: nothing to train, and it says so
    assert "no step trains" in capsys.readouterr().out
    assert again["train"] == resumed["train"] and again["final_validation"] == resumed["final_validation"]


def test_cached_data_is_reused(corpus, data_dir, monkeypatch):
    args = train.parse_args(tiny_run_args(corpus, data_dir, "unused", "--max-steps", "1"))
    built = train.prepare_data(args)

    def must_not_run(*args):
        raise AssertionError("the cached data was rebuilt")

    monkeypatch.setattr(train, "train_tokenizer", must_not_run)
    monkeypatch.setattr(train, "encode_documents", must_not_run)
    tokenizer, streams, meta = train.prepare_data(args)
    assert meta == built[2] and len(tokenizer) == len(built[0])
    assert all((streams[split] == built[1][split]).all() for split in streams)


def test_files_left_out_are_those_of_this_corpus_scan(tmp_path, capsys):
    """A file that is not UTF-8, added after the cache was built, changes no cached data but is counted."""
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(f"{name} = 1\n")
    args = train.parse_args(tiny_run_args(tmp_path, tmp_path / "data", "unused", "--max-steps", "1"))
    assert train.prepare_data(args)[2]["skipped_not_utf8"] == []
    (tmp_path / NOT_UTF8).write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    assert train.prepare_data(args)[2]["skipped_not_utf8"] == [NOT_UTF8]
    assert f"data: 1 file(s) left out for not being UTF-8: {NOT_UTF8}" in capsys.readouterr().out


def test_gradient_checkpointing_changes_no_loss(corpus, data_dir, tmp_path):
    losses = []
    for extra in ([], ["--gradient-checkpointing"]):
        metrics = train.main(tiny_run_args(corpus, data_dir, tmp_path / str(len(losses)), "--max-steps", "3", *extra))
        losses.append([entry["loss"] for entry in metrics["train"]])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_compiled_training_gives_the_eager_losses(tmp_path, capsys, monkeypatch):
    """--compile: the model through torch.compile trains as it does eagerly, measured by
    benchmarks/bench_compile.py (an eager and a compiled train.py run, same batches). Here with
    the Triton kernels (in their interpreter) through their custom ops, in aot_eager (inductor's
    CPU code generation would take minutes): the path a GPU compiles with inductor. Relative 1e-5."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import bench_compile

    # The interpreter's time grows with the chunks the kernels run (a chunk: up to 64 tokens of one
    # sequence): --eval-tokens 64 keeps every validation, the final one included, to one batch, and
    # 2 rows a batch still give the kernels sequences (cu_seqlens) to keep apart.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        text = "".join(f"def add_{i}_{j}(a, b):\n    return a + b * {j}\n\n" for j in range(6))
        (corpus / f"module_{i}.py").write_text(text, encoding="utf-8")
    # One thread in each train.py process, as in a pytest-xdist worker (conftest): beside the other
    # worker, more threads only contend.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # The full learning rate from the first step, so that the later losses weigh the compiled
    # backward: at the default warm-up's first rate, 1e-5, a step moved the loss by 3e-4 of itself.
    runs = bench_compile.main(["--steps", "2", "--backend", "aot_eager", "--", "--corpus", str(corpus),
                               "--vocab-size", "300", *TINY_MODEL, "--kernel-backend", "triton", "--seq-len", "64",
                               "--batch-size", "2", "--eval-tokens", "64", "--lr", "3e-3", "--warmup-steps", "1",
                               "--device", "cpu"])
    eager, compiled = ([entry["loss"] for entry in metrics["train"] + metrics["validation"]]
                       + [metrics["final_validation"]["loss"]] for metrics in runs.values())
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert "compiled (aot_eager)" in capsys.readouterr().out


def test_hybrid_run_trains_saves_and_loads_its_softmax_attention_layers(corpus, data_dir, tmp_path):
    out_dir = tmp_path / "out"
    metrics = train.main(tiny_run_args(corpus, data_dir, out_dir, "--max-steps", "2", *HYBRID))
    assert all(math.isfinite(entry["loss"]) for entry in metrics["train"])
    model = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)
    assert model.config.layer_types == ["linear_attention", "full_attention"] and model.config.sliding_window == 16
    assert "softmax attention in blocks 1, a window of 16 tokens" in (out_dir / "README.md").read_text()


def test_time_budget_ends_the_run(corpus, data_dir, tmp_path):
    metrics = train.main(tiny_run_args(corpus, data_dir, tmp_path / "out", "--time-budget", "1e-4"))
    assert metrics["step"] >= 1 and "final_validation" in metrics
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_warm_up_longer_than_the_run_is_noted(corpus, data_dir, tmp_path, capsys):
    train.main(tiny_run_args(corpus, data_dir, tmp_path / "out", "--max-steps", "2"))  # --warmup-steps 5
    assert "note: --warmup-steps 5 is longer than the run (--max-steps 2): the learning rate stays below 40% of " \
           "--lr 0.003" in capsys.readouterr().out


def test_help_shows_each_default_and_no_preamble(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    description = text[text.index("\n\n") + 2:text.index("\noptions:")]
    assert description.count("\n") <= 4  # a sentence or two, wrapped
    assert text.count("(default:") == len(re.findall(r"^  --", text, re.MULTILINE))  # one per flag
    for flag, default in (("--warmup-steps", "100"), ("--eval-tokens", "262144"), ("--lr", "0.001"),
                          ("--out-dir", "out/reslin"), ("--attn-type", "rdn"), ("--resume", "False")):
        entry = text[text.index(f"  {flag}"):]
        assert f"(default: {default})" in " ".join(entry[:entry.index("(default:") + 40].split()), flag


def error_of(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        train.main([str(value) for value in argv])
    return f"{raised.value.code} {capsys.readouterr().err}"


@pytest.mark.parametrize("extra, message", [
    (["--attn-type", "mamba"], "invalid choice: 'mamba'"),
    (["--seq-len", "1"], "--seq-len must be at least 2"),
    (["--vocab-size", "100"], "--vocab-size must be at least 259"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--val-fraction", "1"], "--val-fraction must lie strictly between 0 and 1"),
    (["--head-dim", "300"], "no valid ResLinConfig: head_dim must be an integer between 1 and 256"),
    (["--compile", "nonsense"], "--compile nonsense: torch.compile has no such backend"),
    (["--residual-clip", "0"], "no valid ResLinConfig: residual_clip"),
    (["--full-attention-layers", "0", "2"], "--full-attention-layers 2: the blocks are numbered 0 to 1"),
    (["--sliding-window", "8"], "--sliding-window applies to full attention layers"),
    (["--full-attention-layers", "0", "--sliding-window", "0"], "no valid ResLinConfig: sliding_window"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number, got nan"),
    (["--eval-tokens", "1"], "--eval-tokens 1 holds only the split's first <bos>"),
    (["--device", "foo"], "--device foo: not a device"),
    (["--kernel-backend", "triton", "--device", "cpu"], "--kernel-backend triton runs on CUDA"),
    (["--device", "xla"], "--device xla: this PyTorch cannot use it here"),  # a device kind no test machine has
])
def test_bad_flags_fail_clearly(corpus, data_dir, tmp_path, capsys, monkeypatch, extra, message):
    """Before the data's preparation (tokenizer training and tokenizing take minutes on a real corpus)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(train, "prepare_data", lambda args: pytest.fail("the data was prepared before the check"))
    argv = tiny_run_args(corpus, data_dir, tmp_path / "out", *extra)
    if "--max-steps" not in extra:
        argv += ["--max-steps", "1"]
    assert message in error_of(argv, capsys)


def test_output_and_data_folders_that_are_files_are_refused(corpus, data_dir, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    for flag in ("--out-dir", "--data-dir"):
        argv = [*tiny_run_args(corpus, data_dir, tmp_path / "out"), "--max-steps", "1", flag, tmp_path / "a-file"]
        assert f"{flag} {tmp_path / 'a-file'} exists and is not a folder" in error_of(argv, capsys)


def test_bad_runs_fail_clearly(corpus, data_dir, tmp_path, capsys):
    def run(*extra, out_dir=tmp_path / "out", corpus=corpus):
        return error_of(tiny_run_args(corpus, data_dir, out_dir, *extra), capsys)

    assert "say how long to train" in run()
    assert "fewer than --seq-len 100000" in run("--max-steps", "1", "--seq-len", "100000")  # known from the data
    assert "is not a folder" in run("--max-steps", "1", corpus=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "has 0 UTF-8 file(s)" in run("--max-steps", "1", corpus=tmp_path / "empty")
    assert "must not be the repository itself" in run("--max-steps", "1", out_dir=train.REPO)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "README.md").write_text("someone's")
    assert "holds a model folder (README.md) but no run to resume" in run("--max-steps", "1", out_dir=tmp_path / "used")
    assert "holds no checkpoint" in run("--max-steps", "1", "--resume")
    (tmp_path / "out" / train.CHECKPOINT).parent.mkdir()
    (tmp_path / "out" / train.CHECKPOINT).write_text("not a checkpoint")
    assert "is not a readable checkpoint" in run("--max-steps", "1", "--resume")
    torch.save({"model": {}}, tmp_path / "out" / train.CHECKPOINT)
    assert "is not a train.py checkpoint" in run("--max-steps", "1", "--resume")
    # Before train.py ran in several processes, optimizer states were keyed by position.
    torch.save({"model": {}, "optimizer": {"state": {0: {}}}, "rng": {}, "step": 1, "args": {}},
               tmp_path / "out" / train.CHECKPOINT)
    assert "keyed by position, not by parameter name" in run("--max-steps", "1", "--resume")


def test_resume_refuses_a_changed_corpus(corpus, tmp_path, capsys, monkeypatch):
    """Same flags, other files: the data cache would give a new tokenizer to the trained weights.
    Refused before that cache is built (minutes on a real corpus)."""
    shutil.copytree(corpus, tmp_path / "corpus")
    argv = tiny_run_args(tmp_path / "corpus", tmp_path / "data", tmp_path / "out", "--max-steps", "1")
    train.main(argv)
    (tmp_path / "corpus" / "new.py").write_text("x = 1\n")
    monkeypatch.setattr(train, "build_data_cache", lambda *args: pytest.fail("a data cache was built"))
    assert "--resume: the files of --corpus" in error_of(argv + ["--max-steps", "2", "--resume"], capsys)


def test_resume_refuses_changed_settings(corpus, data_dir, trained_run, capsys):
    changed = ["--resume", "--lr", "1e-3", "--max-steps", "40"]
    message = error_of(tiny_run_args(corpus, data_dir, trained_run[0], *REFERENCE_RUN, *changed), capsys)
    assert "differ from the checkpoint's: --lr 0.001 (checkpoint: 0.003)" in message
    assert "--max-steps" not in message  # training longer is what resuming is for
